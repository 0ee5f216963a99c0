"""docs/events.md's blocks, run in order against the server its first block starts (its
data directory, ports and host names swapped for a temporary directory and free loopback
ports): the server publishes, the Python block puts two blocks with their token ids and
prints the lookup and the first event, ``tlkv events`` replays that event, and the
``curl`` lookup answers the fields its comment shows."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from http_server import free_port
from readme import bash, snippets_run_by, start


def _swapped(text: str, swaps: dict[str, str]) -> str:
    for example, live in swaps.items():
        assert example in text, f"docs/events.md no longer shows {example!r}"
        text = text.replace(example, live)
    return text


def test_the_pages_blocks_run_in_order(tmp_path: Path) -> None:
    serve_block, curl_block = snippets_run_by("test_events_docs.py", "sh")
    [python_block] = snippets_run_by("test_events_docs.py", "python")
    serve, events = serve_block.text.split("\ntlkv events", 1)
    port, pub, replay = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLKV_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["HOSTNAME"] = "n1"
    serve = _swapped(serve, {"/srv/tlkv": str(tmp_path / "data"), "5557": str(pub)})
    serve = _swapped(serve, {"5558": str(replay)}) + f" --port {port}"
    url = f"http://127.0.0.1:{port}"
    proc = start(serve, tmp_path, env, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine starts it slowly
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the page's server answered no /healthz"
            time.sleep(0.2)
        time.sleep(0.5)  # the publisher binds its sockets beside the server
        code = _swapped(
            python_block.text,
            {
                "http://127.0.0.1:8000": url,
                "tcp://127.0.0.1:5557": f"tcp://127.0.0.1:{pub}",
                "tcp://127.0.0.1:5558": f"tcp://127.0.0.1:{replay}",
            },
        )
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, python_block.where, "exec"), {})
        lines = out.getvalue().splitlines()
        assert "'local_blocks': 2" in lines[0] and "'model': 'llama/8b'" in lines[0]
        assert lines[1].startswith("kv@n1@llama/8b 0 BlockStored(")
        assert "token_ids=[1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007]" in lines[1]
        # tlkv events, as the page runs it, replays that batch (--count ends the stream)
        events = _swapped(
            "tlkv events" + events,
            {"tcp://node-1:5557": f"tcp://127.0.0.1:{pub}", "node-1:5558": f"127.0.0.1:{replay}"},
        )
        done = bash(events.strip() + " --count 1", tmp_path, env)
        assert done.returncode == 0, done.stderr[-3000:]
        [line] = done.stdout.splitlines()
        batch = json.loads(line)
        assert batch["topic"] == "kv@n1@llama/8b" and batch["seq"] == 0, batch
        assert "BlockStored" in line and "1007" in line
        # the curl lookup: the fields its comment shows, for a prompt the node holds none of
        lookup = _swapped(curl_block.text, {"localhost:8000": f"127.0.0.1:{port}"})
        done = bash(lookup, tmp_path, env)
        assert done.returncode == 0, done.stderr[-3000:]
        shown = json.loads(curl_block.text.split("# ", 1)[1])
        [got] = json.loads(done.stdout)["models"]
        assert got.keys() == shown["models"][0].keys()
        assert got["model"] == "llama/8b" and got["block_tokens"] == 4
        assert got["local_blocks"] == 0  # tokens 1..5: not the prompt the Python block put
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
