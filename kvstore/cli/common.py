"""What every ``tlkv`` command shares: the exit-code table and argument types.

Exit codes: 0 success; 1 any other failure (e.g. a block not found); 2 usage; 3 a format
error (of an envelope or an archive, or token ids not hashing to their block); 4 shape
mismatch; 5 unsupported version; 6 done, but the input is inconsistent where the command
looked (``archive extract`` wrote a valid block from an archive whose index or manifest
disagrees with it); 7 incomplete (``archive create`` would leave a sequence or a corrupt
block out, and ``--allow-skipped`` was not given: no archive is written); 141 the reader of
the output closed it (``tlkv archive ls A | head``: the command stops quietly, the shell's
code for a tool ended by SIGPIPE).
"""

from __future__ import annotations

import argparse
import re

from ..codec.geometry import Geometry
from ..errors import (
    ArchiveError,
    EnvelopeError,
    IncompleteArchiveError,
    ShapeError,
    TokenMismatchError,
    UnsupportedVersionError,
)
from ..protocol import check_model_id, parse_versions

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_FORMAT = 3
EXIT_SHAPE = 4
EXIT_VERSION = 5
EXIT_INCONSISTENT = 6
EXIT_INCOMPLETE = 7
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``64MiB``, ``2GiB``, ``512k`` or ``1000000``.

    ``KiB/MiB/GiB/TiB`` and the bare letters ``K/M/G/T`` are powers of 1024;
    ``KB/MB/GB/TB`` are powers of 1000.

    Raises:
        ValueError: the text is not a size.
    """
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(
            f"size must be a number with an optional unit (e.g. 64MiB), found {text!r}"
        )
    number, prefix, binary, byte = m.groups()
    if binary and not prefix:
        raise ValueError(
            f"size must be a number with an optional unit (e.g. 64MiB), found {text!r}"
        )
    base = 1000 if (byte and not binary and prefix) else 1024
    value = float(number) * base ** _POWERS[prefix.lower()]
    if value != int(value):
        raise ValueError(f"size must be a whole number of bytes, found {text!r}")
    return int(value)


def parse_rate(text: str) -> int:
    """Bytes per second from a rate such as ``64MiB/s`` (``/s`` optional; sizes as
    ``parse_size``); ``0`` is a valid rate (off).

    Raises:
        ValueError: the text is not a rate.
    """
    body = text.strip()
    return parse_size(body[:-2] if body.lower().endswith("/s") else body)


def rate_arg(text: str) -> int:
    """argparse type for a rate (``parse_rate``)."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def exit_code_for(error: BaseException) -> int:
    """The exit code of an error: 4 shape, 5 version, 7 an incomplete archive, 3 any other
    envelope or archive error (token ids that do not hash to their block's name too),
    else 1."""
    if isinstance(error, IncompleteArchiveError):
        return EXIT_INCOMPLETE
    if isinstance(error, ShapeError):
        return EXIT_SHAPE
    if isinstance(error, UnsupportedVersionError):
        return EXIT_VERSION
    if isinstance(error, (EnvelopeError, ArchiveError, TokenMismatchError)):
        return EXIT_FORMAT
    return EXIT_FAILURE


def geometry_arg(text: str) -> Geometry:
    """argparse type for ``B,L,H,D``."""
    try:
        return Geometry.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_arg(text: str) -> str:
    """argparse type for a model id."""
    try:
        return check_model_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def versions_arg(text: str) -> tuple[int, ...]:
    """argparse type for ``1,2`` (``kvstore.protocol.parse_versions``)."""
    try:
        return parse_versions(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """argparse type for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value
