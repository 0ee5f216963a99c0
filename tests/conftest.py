"""Shared fixtures and builders for the tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_http import fake  # noqa: F401  (a fixture, for every test module)

from kvstore import Block, Geometry, Store, chain_hashes, encode
from kvstore.codec import checksum

SMALL = Geometry(block_tokens=4, n_layers=2, n_kv_heads=2, head_dim=8)


def make_blocks(
    geometry: Geometry,
    n_tokens_total: int,
    seed: int = 0,
    dtype: type = np.float32,
    scale: float = 1.0,
) -> list[Block]:
    """Blocks for ``n_tokens_total`` random tokens: full blocks hashed, a partial tail with 0."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**32, n_tokens_total, dtype=np.uint64)
    hashes = chain_hashes(tokens, geometry.block_tokens)
    blocks = []
    b = geometry.block_tokens
    n_blocks = -(-n_tokens_total // b)
    for i in range(n_blocks):
        fill = min(b, n_tokens_total - i * b)
        kv: np.ndarray = (rng.standard_normal(geometry.kv_shape) * scale).astype(dtype)
        blocks.append(Block(hashes[i] if fill == b else 0, fill, kv))
    return blocks


def make_envelope(
    geometry: Geometry = SMALL, n_tokens_total: int = 10, version: int = 1, seed: int = 0
) -> bytes:
    """A valid envelope of random content."""
    return encode(geometry, make_blocks(geometry, n_tokens_total, seed), version)


@pytest.fixture(scope="session")
def rand_bytes() -> bytes:
    """3 MiB + 64 random bytes (seed 1234), for the compiled kernels' tests."""
    return np.random.default_rng(1234).integers(0, 256, (3 << 20) + 64, dtype=np.uint8).tobytes()


@pytest.fixture(params=[bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"])
def buffer_type(request: pytest.FixtureRequest) -> type:
    """Parametrizes a test over the three buffer types inputs may come as."""
    return request.param


@pytest.fixture(params=["compiled-join", "python-join"])
def join(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the compiled ``join_crc``/``join_crc_into`` and with their
    pure-Python fallbacks."""
    if request.param == "python-join":
        monkeypatch.setattr(checksum, "_native", None)
    elif checksum._native is None:  # type: ignore[attr-defined]  # the module's private kernel
        pytest.skip("compiled kernel not built")
    return str(request.param)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A new store under ``tmp_path`` (a test module may define its own)."""
    with Store(tmp_path / "store") as s:
        yield s


@pytest.fixture(scope="session")
def s3_server():  # type: ignore[no-untyped-def]
    """moto's S3 server on a free loopback port for the whole session (tests/s3_server.py)."""
    from s3_server import S3Server, set_credentials

    set_credentials()
    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_engine_host() -> Iterator[None]:
    """The vLLM tests' engines forked from one process that imported vLLM once
    (``tools/vllm_host.py``): each engine still runs in a process of its own, without
    importing vLLM again. A run whose environment the host cannot give starts a fresh
    interpreter."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from vllm_demo import engine_host

    with engine_host():
        yield
