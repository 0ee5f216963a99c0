"""Golden vectors in tests/vectors/ (from tools/gen_vectors.py): encode and decode to the byte."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore import Block, Geometry, decode, encode, split, transcode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gen_vectors  # noqa: E402

VECTORS = ROOT / "tests" / "vectors"
MANIFEST = json.loads((VECTORS / "manifest.json").read_text())


def test_every_case_is_committed() -> None:
    assert sorted(MANIFEST) == sorted(gen_vectors.CASES)
    assert len({m["version"] for m in MANIFEST.values()}) == 2


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_encode_reproduces_vector(name: str) -> None:
    committed = (VECTORS / f"{name}.tlkv").read_bytes()
    assert hashlib.sha256(committed).hexdigest() == MANIFEST[name]["sha256"]
    assert gen_vectors.build_case(*gen_vectors.CASES[name]) == committed


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_decode_vector(name: str) -> None:
    meta = MANIFEST[name]
    data = (VECTORS / f"{name}.tlkv").read_bytes()
    geometry = Geometry(*meta["geometry"])
    env = decode(data, geometry)
    assert env.version == meta["version"] and len(data) == meta["bytes"]
    n_tokens = meta["tokens"]
    assert sum(bv.n_tokens for bv in env) == n_tokens
    for i, bv in enumerate(env):
        if bv.n_tokens < geometry.block_tokens:
            assert bv.hash == 0 and i == len(env) - 1
        expected = gen_vectors.kv_for(geometry, i)[..., : bv.n_tokens, :]
        got = bv.to_float32()[..., : bv.n_tokens, :]
        if env.version == 1:
            assert np.array_equal(got, expected.astype(np.float16).astype(np.float32))
        else:
            assert bv.scales is not None
            assert np.allclose(got, expected, rtol=2**-4, atol=float(bv.scales.max()) * 2**-9)
    if len(env):
        assert [bytes(p) for p in split(data)] == split(bytearray(data))
        other = transcode(data, 3 - env.version)
        assert decode(other).hashes.tolist() == env.hashes.tolist()
        if env.version == 2:  # v2 -> v1 -> v2 re-quantizes f16 values of the codes: stable
            assert transcode(other, 2) == data
        else:  # v1 -> v2 is the v2 writer's rule applied to the f16 values
            blocks = [Block(b.hash, b.n_tokens, b.to_float32()) for b in env]
            assert other == encode(env.geometry, blocks, 2)
