"""Build hook: the optional C kernels (kvstore/_native.c, kvstore/_fp8.c).

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
    ]
)
