"""The ``tlkv`` command line: ``main`` and one module per command group."""

from .main import main

__all__ = ["main"]
