"""kvstore.engines._vllm_saver without vLLM: the saver thread finishes its queue at
interpreter exit (a put large enough to go through the store's helper pool)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from http_server import REPO

from kvstore import Store

SAVE_AT_EXIT = """
import sys
import numpy as np
from kvstore import Geometry
from kvstore.engines._vllm_saver import Saver
from kvstore.engines.targets import open_target
from kvstore.codec.envelope import Block, encode
from kvstore.codec.hashing import chain_hashes

g = Geometry(32, 12, 4, 64)  # 384 KiB a block: 32 blocks go through the store's pool
target = open_target(sys.argv[1], model="m")
blocks = np.ones((32, *g.kv_shape), dtype=np.float16)
hashes = chain_hashes(list(range(32 * 32)), 32)


def save(model, hs, arr):
    target.put(encode(g, [Block(h, 32, arr[i]) for i, h in enumerate(hs)]))


assert Saver(save).submit("m", hashes, blocks)
"""  # the interpreter exits with the save still queued


def test_saver_finishes_its_queue_at_exit(tmp_path: Path) -> None:
    data = tmp_path / "tlkv-data"
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_AT_EXIT, str(data)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    with Store(str(data)) as store:
        assert store.model("m").stats()["blocks"] == 32
