"""The codec commands of ``tlkv``: ``hash``, ``inspect`` and ``verify`` (no store, no network)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..codec.envelope import decode
from ..codec.hashing import chain_hashes_array
from ..protocol import hash_hex
from .common import EXIT_OK, geometry_arg, versions_arg


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
                "hash": hash_hex(bv.hash),
                "n_tokens": bv.n_tokens,
                "k_absmax": _absmax(f32[:, 0]),
                "v_absmax": _absmax(f32[:, 1]),
            }
        )
    header = {
        "version": env.version,
        "geometry": g.as_dict(),
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


def register(sub: Any) -> None:
    """Add ``hash``, ``inspect`` and ``verify`` to the ``tlkv`` subcommands."""
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
