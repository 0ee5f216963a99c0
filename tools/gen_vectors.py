"""Generate the golden envelopes in tests/vectors/ (run only on purpose).

Usage: python tools/gen_vectors.py [--check]

Inputs are integer arithmetic (no RNG), so they are the same on every machine and numpy
version; tests/test_vectors.py rebuilds them with ``build_cases()`` and compares bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import Block, Geometry, chain_hashes, encode  # noqa: E402

VECTOR_DIR = ROOT / "tests" / "vectors"

# name: (geometry B,L,H,D, number of tokens, version)
CASES: dict[str, tuple[tuple[int, int, int, int], int, int]] = {
    "b2-l1-h1-d2-full-v1": ((2, 1, 1, 2), 2, 1),
    "b4-l2-h2-d8-tail-v1": ((4, 2, 2, 8), 10, 1),
    "b4-l2-h2-d8-tail-v2": ((4, 2, 2, 8), 10, 2),
    "b16-l2-h2-d16-full-v1": ((16, 2, 2, 16), 48, 1),
    "b16-l2-h2-d16-tail-v2": ((16, 2, 2, 16), 37, 2),
    "b3-l1-h4-d5-single-partial-v2": ((3, 1, 4, 5), 1, 2),
    "b8-l3-h1-d4-empty-v1": ((8, 3, 1, 4), 0, 1),
}


def tokens_for(n: int) -> list[int]:
    """Deterministic token ids spanning the u32 range."""
    return [(i * 2654435761 + 12345) % 2**32 for i in range(n)]


def kv_for(geometry: Geometry, block_index: int) -> np.ndarray:
    """Deterministic KV in f32 with a spread of magnitudes, signs, zeros."""
    count = geometry.elements
    i = np.arange(count, dtype=np.int64) + block_index * count
    values = ((i * 40503 + 17) % 4001 - 2000).astype(np.float32) / np.float32(256)
    values[i % 13 == 0] = 0
    return values.reshape(geometry.kv_shape)


def build_case(dims: tuple[int, int, int, int], n_tokens: int, version: int) -> bytes:
    """The envelope of one case."""
    geometry = Geometry(*dims)
    b = geometry.block_tokens
    hashes = chain_hashes(tokens_for(n_tokens), b)
    blocks = []
    for i in range(-(-n_tokens // b)):
        fill = min(b, n_tokens - i * b)
        blocks.append(Block(hashes[i] if fill == b else 0, fill, kv_for(geometry, i)))
    return encode(geometry, blocks, version)


def build_cases() -> dict[str, bytes]:
    """Every case by name."""
    return {name: build_case(*spec) for name, spec in CASES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    cases = build_cases()
    manifest = {
        name: {
            "geometry": list(CASES[name][0]),
            "tokens": CASES[name][1],
            "version": CASES[name][2],
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        for name, data in cases.items()
    }
    if args.check:
        bad = [n for n, d in cases.items() if (VECTOR_DIR / f"{n}.tlkv").read_bytes() != d]
        print("mismatch: " + ", ".join(bad) if bad else "all vectors match")
        return 1 if bad else 0
    VECTOR_DIR.mkdir(parents=True, exist_ok=True)
    for name, data in cases.items():
        (VECTOR_DIR / f"{name}.tlkv").write_bytes(data)
    (VECTOR_DIR / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(cases)} vectors to {VECTOR_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
