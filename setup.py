"""Build hook: the optional C extensions (kvstore/codec/_native/*.c, codec/_fp8.c,
fileio/_syscalls.c).

The extension is optional: if it cannot be compiled, the package installs and
falls back to the pure-Python/NumPy implementations, which are also the test oracle.
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.codec._native",
            sources=sorted(glob("kvstore/codec/_native/*.c")),
            depends=["kvstore/codec/_native/native.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvstore.codec._fp8",
            sources=["kvstore/codec/_fp8.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvstore.fileio._syscalls", sources=["kvstore/fileio/_syscalls.c"], optional=True
        ),
    ]
)
