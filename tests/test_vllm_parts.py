"""kvstore.engines._vllm_parts without vLLM: namespace and salt rules, and the saver
thread finishing its queue at interpreter exit (a put large enough to go through the
store's helper pool)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from http_server import REPO

from kvstore import Store
from kvstore.engines._vllm_parts import namespace, salted


def test_namespaces() -> None:
    assert namespace("meta-llama/Llama-3.1-8B", "5206a32", "bfloat16") == (
        "meta-llama/Llama-3.1-8B@5206a32/bfloat16"
    )
    assert namespace("/models/my model", None, "float16") == "/models/my_model@main/float16"
    long = namespace("x" * 400, None, "float16")
    assert len(long) <= 200 - len("+salt:") - 16 and long != namespace("x" * 399, None, "float16")
    a, b = salted("m@main/float16", "tenant-a"), salted("m@main/float16", "tenant-b")
    assert a.startswith("m@main/float16+salt:") and a != b and "tenant" not in a
    assert salted("m", None) == "m" and len(salted(long, "s")) <= 200


SAVE_AT_EXIT = """
import sys
import numpy as np
from kvstore import Geometry
from kvstore.engines._vllm_parts import Saver, open_target
from kvstore.codec.envelope import Block, encode
from kvstore.codec.hashing import chain_hashes

g = Geometry(32, 12, 4, 64)  # 384 KiB a block: 32 blocks go through the store's pool
target = open_target(sys.argv[1], "m", None, 5.0)
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


def test_only_full_single_block_v1_envelopes_take_the_fused_load() -> None:
    """``_full_v1_blocks`` admits exactly the envelopes every reader rule but the CRC
    accepts as one full v1 block of the engine's geometry; the rest go through ``decode``."""
    import numpy as np

    from kvstore.codec.envelope import Block, encode, transcode
    from kvstore.codec.geometry import Geometry
    from kvstore.codec.layout import NO_HASH
    from kvstore.engines._vllm_parts import _full_v1_blocks

    g = Geometry(4, 2, 1, 8)
    kv = np.ones(g.kv_shape, np.float16)
    full = encode(g, [Block(7, 4, kv)])
    assert _full_v1_blocks([memoryview(full)] * 3, g)
    assert _full_v1_blocks([], g)
    partial = encode(g, [Block(NO_HASH, 3, kv)])
    two = encode(g, [Block(7, 4, kv), Block(8, 4, kv)])
    other = encode(Geometry(4, 2, 2, 4), [Block(7, 4, np.ones((2, 2, 2, 4, 4), np.float16))])
    bad_magic = b"XLKV" + full[4:]
    for env in (partial, two, other, transcode(full, 2), bad_magic, full[:-1], full + b"\0"):
        assert not _full_v1_blocks([memoryview(full), memoryview(env)], g)


def test_only_a_joined_v1_prefix_of_the_blocks_asked_for_takes_the_fused_load() -> None:
    """``_joined_v1_blocks`` admits a server's prefix envelope only when every reader rule
    but the CRC holds and its blocks are the leading hashes asked for, in order; anything
    else (another block, another order, a partial block, v2, another geometry, a cut or
    padded body) goes through ``decode`` and ``_same_hashes``."""
    import numpy as np

    from kvstore.codec.envelope import Block, decode, encode, transcode
    from kvstore.codec.geometry import Geometry
    from kvstore.codec.layout import NO_HASH
    from kvstore.engines._vllm_parts import _joined_v1_blocks, _same_hashes

    g = Geometry(4, 2, 1, 8)
    kv = np.ones(g.kv_shape, np.float16)
    asked = [7, 8, 9]
    prefix = encode(g, [Block(7, 4, kv), Block(8, 4, kv)])
    assert _joined_v1_blocks(prefix, g, asked) == 2
    assert _joined_v1_blocks(memoryview(prefix), g, asked[:2]) == 2
    assert _joined_v1_blocks(encode(g, [Block(7, 4, kv)]), g, asked) == 1
    others = [
        encode(g, [Block(7, 4, kv), Block(9, 4, kv)]),  # a block that was not asked for
        encode(g, [Block(8, 4, kv), Block(7, 4, kv)]),  # out of order
        encode(g, [Block(7, 4, kv), Block(NO_HASH, 3, kv)]),  # a partial block
        transcode(prefix, 2),
        encode(Geometry(4, 2, 2, 4), [Block(7, 4, np.ones((2, 2, 2, 4, 4), np.float16))]),
        prefix[:-1],
        prefix + b"\0",
        encode(g, [Block(7, 4, kv)] * 4),  # more blocks than asked for
    ]
    for env in others:
        assert _joined_v1_blocks(env, g, asked) is None
    assert _joined_v1_blocks(prefix, g, []) is None
    views = list(decode(others[0]))
    assert _same_hashes(views, asked) == 1  # block 9 where 8 was asked: only 7 is loaded
    assert _same_hashes(list(decode(prefix)), asked) == 2
    assert _same_hashes(list(decode(prefix)), [7]) == 1
