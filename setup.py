"""Build hook: the optional C extensions (kvstore/_native.c, _fp8.c, _syscalls.c).

The extension is optional: if it cannot be compiled, the package installs and
falls back to the pure-Python/NumPy implementations, which are also the test oracle.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._native",
            sources=["kvstore/_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvstore._fp8",
            sources=["kvstore/_fp8.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension("kvstore._syscalls", sources=["kvstore/_syscalls.c"], optional=True),
    ]
)
