"""NVIDIA Dynamo's KV router as a second, independent consumer of a node's KV events:
``dynamo._core.RadixTree`` (``ai-dynamo-runtime==1.6.1``) fed with the frames a live
``tlkv serve --kv-events-endpoint`` published, through the conversion Dynamo applies to
vLLM's events (``tests/dynamo_index.py``), finds the prefix saved on the node (its blocks'
tokens hashed as Dynamo's router hashes a prompt) and forgets it after the removal.

Dynamo's dependencies clash with this project's (pydantic, uvloop pins), so it lives in a
venv of its own: ``python3 -m venv .venv-dynamo && .venv-dynamo/bin/pip install
ai-dynamo-runtime==1.6.1`` (``.ci/run`` does); ``TLKV_DYNAMO_PYTHON`` names another.
Skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import SMALL
from event_node import Node, recv
from http_server import REPO
from prompts import prompt

from kvstore.client import Client
from kvstore.events.subscriber import Message

PYTHON = os.environ.get("TLKV_DYNAMO_PYTHON", str(REPO / ".venv-dynamo" / "bin" / "python"))
pytestmark = pytest.mark.dynamo
# A venv whose install has not finished (``.ci/run`` builds it while other tests run) is
# no venv yet: the runtime must import.
if (
    not Path(PYTHON).exists()
    or subprocess.run(
        [PYTHON, "-c", "import dynamo._core"], capture_output=True, timeout=120
    ).returncode
):
    pytest.skip(f"no Dynamo venv at {PYTHON} (see the module docstring)", allow_module_level=True)

WORKER = 7
B = SMALL.block_tokens


class DynamoIndex:
    """``tests/dynamo_index.py`` under Dynamo's Python: events in, prefix matches out."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [PYTHON, str(REPO / "tests" / "dynamo_index.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def feed(self, m: Message) -> None:
        _ts, events, *_ = msgspec.msgpack.decode(m.payload)  # the raw maps Dynamo parses
        for event in events:
            cmd = {"op": "event", "worker": WORKER, "event_id": m.seq, "block_size": B}
            self._ask({**cmd, "event": event})

    def matched(self, tokens: list[int]) -> int:
        return int(
            self._ask({"op": "match", "tokens": tokens, "block_size": B})["scores"].get(
                str(WORKER), 0
            )
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def _feed(sub: Any, index: DynamoIndex) -> None:
    """The node's next batch, into Dynamo's index."""
    [m] = recv(sub, 1)
    index.feed(m)


def test_dynamos_radix_tree_finds_a_saved_prefix_and_forgets_it(tmp_path: Path) -> None:
    single = SMALL.envelope_bytes(1)
    node = Node(tmp_path / "data", "--capacity", str(8 * single))
    node.server.start()
    index = DynamoIndex()
    sub = node.subscriber()
    try:
        ids, _hashes, env = prompt(26)  # 6 full blocks and a tail
        with Client(node.server.url) as c:
            c.put(env, tokens=ids)
            _feed(sub, index)
            assert index.matched(ids) == 6  # the whole saved prefix, found by its tokens
            diverging = [*ids[:10], 99_999, *ids[11:]]
            assert index.matched(diverging) == 2  # blocks 0-1 shared, block 2 differs
            assert index.matched(prompt(26, seed=5)[0]) == 0
            other_ids, _, other = prompt(24, seed=1)
            c.put(other, tokens=other_ids)  # 6 more blocks: the prefix's 4 oldest go
            _feed(sub, index)
            assert index.matched(other_ids) == 6
            assert index.matched(ids) == 0  # forgotten: its first blocks were removed
            c.delete(prompt(24, seed=1)[1][5])
            _feed(sub, index)
            assert index.matched(other_ids) == 5
    finally:
        sub.close()
        index.close()
        node.server.stop()
