"""The ``tlkv`` command line: one parser, each command group registered by its module.

Groups: ``codec`` (hash, inspect, verify), ``remote`` (put, get, has against a server),
``archive``, ``scrub``, ``events`` (a node's KV events), and those installed packages
declare under the ``tlkv.commands`` entry point (the service's ``serve``). Exit codes are
the table of :mod:`kvstore.cli.common`; an error is one line on stderr naming the rule.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from .._version import __version__
from ..codec.checksum import KERNEL
from ..errors import TlkvError
from . import archive, codec, events, remote, scrub
from .common import EXIT_CLOSED_PIPE, EXIT_FAILURE, EXIT_USAGE, exit_code_for

GROUPS = (codec, remote, archive, scrub, events)
# Entry-point group under which installed packages add commands (the service adds `serve`).
PLUGIN_GROUP = "tlkv.commands"


def _plugins() -> list[Callable[[Any], None]]:
    """The ``register`` functions other installed packages declare for ``tlkv``; one that
    fails to load is skipped with a warning, so the library's own commands still run."""
    registers = []
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            registers.append(ep.load())
        except Exception as exc:  # a broken plugin must not take the codec commands down
            print(
                f"tlkv: command group {ep.name!r} ({ep.value}) not loaded: {exc}", file=sys.stderr
            )
    return registers


def build_parser() -> argparse.ArgumentParser:
    """The ``tlkv`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="tlkv", description="tlkv: KV-cache block store")
    parser.add_argument(
        "--version", action="version", version=f"tlkv {__version__} (CRC-32C: {KERNEL})"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    for register in _plugins():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tlkv`` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except (TlkvError, ValueError) as exc:
        print(f"tlkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_code_for(exc) if isinstance(exc, TlkvError) else EXIT_USAGE
    except OSError as exc:
        print(f"tlkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _closed_pipe() -> int:
    """The reader of stdout went away (``| head``): stop quietly. stdout is pointed at
    /dev/null so that the interpreter's final flush does not report the pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    raise SystemExit(main())
