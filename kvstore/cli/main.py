"""The ``tlkv`` command line: one parser, each command group registered by its module.

Groups: ``codec`` (hash, inspect, verify), ``http`` (the client commands and ``serve``),
``archive``. Exit codes are the table of :mod:`kvstore.cli.common`; an error is one line
on stderr naming the rule.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._version import __version__
from ..codec.checksum import KERNEL
from ..errors import TlkvError
from . import archive, codec, http
from .common import EXIT_FAILURE, EXIT_USAGE, exit_code_for

GROUPS = (codec, http, archive)


def build_parser() -> argparse.ArgumentParser:
    """The ``tlkv`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="tlkv", description="tlkv: KV-cache block store")
    parser.add_argument(
        "--version", action="version", version=f"tlkv {__version__} (CRC-32C: {KERNEL})"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tlkv`` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except (TlkvError, ValueError) as exc:
        print(f"tlkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_code_for(exc) if isinstance(exc, TlkvError) else EXIT_USAGE
    except OSError as exc:
        print(f"tlkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
