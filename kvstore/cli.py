"""The ``tlkv`` command line: hashing, inspecting and verifying envelopes (and, registered
below, the server, the HTTP client commands and archives).

Exit codes: 0 success; 2 usage; 3 format error; 4 shape mismatch; 5 unsupported version;
1 any other failure (e.g. a block not found). Errors are one line on stderr naming the rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .checksum import KERNEL
from .envelope import decode
from .errors import EnvelopeError, ShapeError, TlkvError, UnsupportedVersionError
from .geometry import Geometry
from .hashing import chain_hashes_array

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_FORMAT = 3
EXIT_SHAPE = 4
EXIT_VERSION = 5


def exit_code_for(error: BaseException) -> int:
    """The exit code of an error: 4 shape, 5 version, 3 any other envelope error, else 1."""
    if isinstance(error, ShapeError):
        return EXIT_SHAPE
    if isinstance(error, UnsupportedVersionError):
        return EXIT_VERSION
    if isinstance(error, EnvelopeError):
        return EXIT_FORMAT
    return EXIT_FAILURE


def geometry_arg(text: str) -> Geometry:
    """argparse type for ``B,L,H,D``."""
    try:
        return Geometry.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def versions_arg(text: str) -> tuple[int, ...]:
    """argparse type for ``1,2``."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"versions must be like 1,2; found {text!r}") from None


def _read_tokens(args_tokens: Sequence[str]) -> np.ndarray:
    words = list(args_tokens) if args_tokens else sys.stdin.read().split()
    try:
        values = [int(w) for w in words]  # decimal ids, as engines print them
    except ValueError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from None
    return np.array(values, dtype=object) if values else np.zeros(0, dtype=np.uint32)


def _cmd_hash(args: argparse.Namespace) -> int:
    tokens = _read_tokens(args.tokens)
    hashes = chain_hashes_array(list(tokens), args.block_tokens)
    sys.stdout.write("".join(f"{h:016x}\n" for h in hashes.tolist()))
    return EXIT_OK


def _absmax(arr: np.ndarray) -> float:
    return float(np.abs(arr).max()) if arr.size else 0.0


def _cmd_inspect(args: argparse.Namespace) -> int:
    data = Path(args.file).read_bytes()
    env = decode(data)
    g = env.geometry
    blocks = []
    for bv in env:
        f32 = bv.to_float32()
        blocks.append(
            {
                "hash": f"{bv.hash:016x}",
                "n_tokens": bv.n_tokens,
                "k_absmax": _absmax(f32[:, 0]),
                "v_absmax": _absmax(f32[:, 1]),
            }
        )
    header = {
        "version": env.version,
        "geometry": {
            "block_tokens": g.block_tokens,
            "n_layers": g.n_layers,
            "n_kv_heads": g.n_kv_heads,
            "head_dim": g.head_dim,
        },
        "n_blocks": len(env),
        "bytes": len(data),
    }
    if args.json:
        json.dump({**header, "blocks": blocks}, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    print(
        f"TLKV v{env.version} {'f16' if env.version == 1 else 'e4m3'} "
        f"B={g.block_tokens} L={g.n_layers} Hkv={g.n_kv_heads} D={g.head_dim} "
        f"blocks={len(env)} bytes={len(data)}"
    )
    for b in blocks:
        print(
            f"{b['hash']} n_tokens={b['n_tokens']} k_absmax={b['k_absmax']:.6g} "
            f"v_absmax={b['v_absmax']:.6g}"
        )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    data = Path(args.file).read_bytes()
    env = decode(data, args.geometry, args.versions)
    if not args.quiet:
        print(f"ok: version {env.version}, {len(env)} blocks, {len(data)} bytes")
    return EXIT_OK


def _register_codec(sub: Any) -> None:
    p = sub.add_parser("hash", help="chained block hashes of token ids (args or stdin)")
    p.add_argument("--block-tokens", type=int, default=16, help="B (default 16)")
    p.add_argument("tokens", nargs="*", help="token ids; read from stdin when none")
    p.set_defaults(func=_cmd_hash)

    p = sub.add_parser("inspect", help="print an envelope's header and blocks")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="check an envelope against every reader rule")
    p.add_argument("file")
    p.add_argument("--geometry", type=geometry_arg, default=None, help="B,L,H,D to require")
    p.add_argument("--versions", type=versions_arg, default=(1, 2), help="accepted, e.g. 1,2")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_verify)


# Each group registers its subcommands; other modules' groups are imported lazily so the
# codec commands need neither the server nor the HTTP client.
def _register_http(sub: Any) -> None:
    from .cli_http import register

    register(sub)


def _register_archive(sub: Any) -> None:
    from .cli_archive import register

    register(sub)


REGISTRARS: list[Callable[[Any], None]] = [_register_codec, _register_http, _register_archive]


def build_parser() -> argparse.ArgumentParser:
    """The ``tlkv`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="tlkv", description="tlkv: KV-cache block store")
    parser.add_argument(
        "--version", action="version", version=f"tlkv {__version__} (CRC-32C: {KERNEL})"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTRARS:
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
        return int(args.func(args))
    except (TlkvError, ValueError) as exc:
        print(f"tlkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_code_for(exc) if isinstance(exc, TlkvError) else EXIT_USAGE
    except OSError as exc:
        print(f"tlkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
