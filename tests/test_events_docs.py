"""docs/events.md's Python block, run against a live ``tlkv serve --kv-events-endpoint``
(the endpoints it names replaced by the live ones): it prints the lookup and the event."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from event_node import Node
from http_server import REPO

DOC = (REPO / "docs" / "events.md").read_text(encoding="utf-8")


def test_the_python_block_runs_against_a_live_node(tmp_path: Path) -> None:
    marker = "<!-- snippet: run by tests/test_events_docs.py -->\n```python\n"
    code = re.search(re.escape(marker) + r"(.*?)```", DOC, re.DOTALL)
    assert code is not None
    node = Node(tmp_path / "data")
    with node.server:
        text = code.group(1)
        for example, live in (
            ("http://127.0.0.1:8000", node.server.url),
            ("tcp://127.0.0.1:5557", node.endpoint),
            ("tcp://127.0.0.1:5558", node.replay),
        ):
            assert example in text
            text = text.replace(example, live)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(text, "docs/events.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert "'local_blocks': 2" in lines[0] and "'model': 'llama/8b'" in lines[0]
    assert lines[1].startswith("kv@n1@llama/8b 0 BlockStored(")
    assert "token_ids=[1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007]" in lines[1]
