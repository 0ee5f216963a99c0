"""A real ``tlkv serve --grpc-port`` for the tl.kv.v1 tests, a client generated from the
.proto at test time, and the prompts and chunks those tests send."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from http_server import REPO, ServerProcess, free_port

from kvstore import Block, Geometry, chain_hashes, crc32c, decode, encode

G = Geometry(block_tokens=4, n_layers=2, n_kv_heads=2, head_dim=8)
G_ARG = ",".join(map(str, G.as_tuple()))

TOKEN = "grpc-s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
OPTIONS = [("grpc.max_send_message_length", 16 << 20)]


@contextmanager
def generated_pb(out: Path) -> Iterator[SimpleNamespace]:
    """kv_pb2 / kv_pb2_grpc generated now from the .proto into ``out`` and imported from
    there (not our own generated modules), as another implementation would."""
    from grpc_tools import protoc

    include = str(Path(protoc.__file__).parent / "_proto")
    code = protoc.main(
        [
            "protoc",
            f"-I{REPO / 'api' / 'proto'}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "tl/kv/v1/kv.proto",
        ]
    )
    assert code == 0
    sys.path.insert(0, str(out))
    try:
        mods: dict[str, ModuleType] = {
            name: importlib.import_module(f"tl.kv.v1.{name}") for name in ("kv_pb2", "kv_pb2_grpc")
        }
        yield SimpleNamespace(**mods)
    finally:
        sys.path.remove(str(out))
        for name in [m for m in sys.modules if m == "tl" or m.startswith("tl.")]:
            del sys.modules[name]


class GrpcServer(ServerProcess):
    """A ServerProcess that also serves tl.kv.v1 on its own free port."""

    def __init__(self, data: Path, *args: str, **kwargs: Any) -> None:
        self.grpc_port = free_port()
        super().__init__(data, "--grpc-port", str(self.grpc_port), *args, **kwargs)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def restart(self) -> None:
        """Stop, then start on the same data and the same gRPC port."""
        self.stop()
        self.start()


def capped_server(data: Path) -> GrpcServer:
    """The server the tl.kv.v1 tests share: their geometry, 256 KiB of capacity (so a
    test can fill it) and a bearer token."""
    return GrpcServer(data, "--geometry", G_ARG, "--capacity", "256KiB", token=TOKEN)


_seed = iter(range(1, 1 << 30))


def prompt(
    n_tokens: int, version: int = 1, tokens: list[int] | None = None
) -> tuple[list[int], bytes]:
    """Fresh random tokens (unless given) and their KV state as one envelope."""
    rng = np.random.default_rng(next(_seed))
    if tokens is None:
        tokens = rng.integers(0, 2**32, n_tokens, dtype=np.uint64).tolist()
    hashes = chain_hashes(tokens, G.block_tokens)
    blocks = []
    for i in range(-(-len(tokens) // G.block_tokens)):
        fill = min(G.block_tokens, len(tokens) - i * G.block_tokens)
        kv = rng.standard_normal(G.kv_shape).astype(np.float32)
        blocks.append(Block(hashes[i] if fill == G.block_tokens else 0, fill, kv))
    return tokens, encode(G, blocks, version)


def chunk(pb: SimpleNamespace, payload: bytes, **fields: Any) -> Any:
    """A KvChunk for a single-block envelope, fields from the payload unless overridden."""
    env = decode(payload, verify_crc=False)
    values = {
        "block_hash": env[0].hash,
        "n_tokens": env[0].n_tokens,
        "kv_format": env.version,
        "payload": payload,
        "crc32c": crc32c(payload),
    }
    values.update(fields)
    return pb.kv_pb2.KvChunk(**values)


def fresh_block(version: int = 1) -> bytes:
    _, data = prompt(G.block_tokens, version)
    return data


def held(stub: Any, pb: SimpleNamespace, *payloads: bytes) -> list[bool]:
    hashes = [decode(p)[0].hash for p in payloads]
    reply = stub.HasBlocks(pb.kv_pb2.HasBlocksRequest(block_hashes=hashes), metadata=AUTH)
    return list(reply.present)


def assert_status(exc: pytest.ExceptionInfo[grpc.RpcError], code: grpc.StatusCode) -> str:
    assert exc.value.code() == code, (exc.value.code(), exc.value.details())
    return str(exc.value.details())
