"""tlkv as SGLang's HiCache storage backend, on SGLang's real classes: the backend made by
``StorageBackendFactory.create_backend("dynamic", ...)`` and registered as the cache
controller does, host pools of SGLang's ``MHATokenToKVPoolHost`` on CPU (both layouts),
SGLang's own page hashes and controller code, real stores, real ``tlkv serve`` over HTTP
and tl.kv.v1 (``tools/sglang_demo.py`` builds the pieces).

Skipped where SGLang is not installed (it needs a venv of its own, torch 2.14.1:
``docs/sglang.md``; ``.ci/run`` builds it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_server import REPO, ServerProcess, free_port

pytestmark = pytest.mark.sglang
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (see docs/sglang.md)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from sglang_demo import (  # noqa: E402
    blocks_of,
    fill_pages,
    make_backend,
    make_file_backend,
    make_pool,
    page_keys,
)
from sglang_pages import in_store, round_trip, same  # noqa: E402

from kvstore.engines.sglang import block_names  # noqa: E402
from kvstore.errors import CacheLayoutError  # noqa: E402

LAYOUTS = ["layer_first", "page_first"]


def test_the_factory_makes_a_hicache_storage(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"))
    assert isinstance(backend, HiCacheStorage)
    assert type(backend).__module__ == "kvstore.engines._sglang_backend"
    assert backend.namespace == "tiny@sglang-tp0of1/float16"


def test_importing_the_module_imports_no_sglang() -> None:
    code = (
        "import sys, kvstore, kvstore.engines, kvstore.engines.sglang\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'sglang'\n"
        "from kvstore.engines.sglang import TlkvHiCacheStorage\n"
        "assert 'sglang.srt.mem_cache.hicache_storage' in sys.modules\n"
        "print(TlkvHiCacheStorage.__mro__[1].__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "HiCacheStorage"


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "generic"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_byte_for_byte(tmp_path: Path, layout: str, v1: bool) -> None:
    pool = make_pool(layout)
    backend = make_backend(pool, str(tmp_path / "kv"), interface_v1=int(v1))
    keys = page_keys(12)
    written, read = round_trip(backend, pool, keys, v1)
    assert same(written, read)
    assert backend.batch_exists(keys) == 12
    assert backend.stats()["pages_saved"] == 12 and backend.stats()["pages_loaded"] == 12
    # a new backend on the same store (a re-attach) reads them too, in the other interface
    again = make_backend(make_pool(layout), str(tmp_path / "kv"), interface_v1=int(not v1))
    dest = again.mem_pool_host.alloc(12 * again.mem_pool_host.page_size)
    assert again.batch_get_v1(keys, dest) == [True] * 12
    assert same(blocks_of(again.mem_pool_host, dest), written)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_f16_pages_take_envelopes_in_one_pass_with_their_crc(layout: str) -> None:
    """The fused load (``PageSlots.scatter_envelopes``) on SGLang's real pool: pool pages
    and flat pages get exactly the blocks; a bad CRC stops at its envelope; a bf16 pool
    declines it (checked views convert)."""
    from kvstore.codec.envelope import Block, encode
    from kvstore.engines._sglang_pages import HostPages, PageSlots

    pool = make_pool(layout)
    pages = HostPages(pool)
    g = pages.geometry
    kv = np.random.default_rng(3).standard_normal((4, *g.kv_shape)).astype(np.float16)
    envs = [encode(g, [Block(100 + i, g.block_tokens, kv[i])]) for i in range(4)]
    dest = pool.alloc(4 * pool.page_size)
    starts = pages.page_starts(dest, 4)
    slots = PageSlots(pages, [pages.page(s) for s in starts])
    assert slots.scatter_envelopes(envs, range(4)) == 4
    assert same(blocks_of(pool, dest), kv)
    flat = [pool.get_dummy_flat_data_page() for _ in range(2)]
    joined = encode(g, [Block(7, g.block_tokens, kv[2]), Block(8, g.block_tokens, kv[3])])
    on_flat = PageSlots(pages, [pages.flat(t) for t in flat])
    assert on_flat.scatter_envelopes([joined], [1, 0], joined=True) == 2
    assert same(np.stack([pages.flat(t) for t in flat]), kv[[3, 2]])
    bad = bytearray(envs[1])
    bad[-1] ^= 1
    again = pool.alloc(4 * pool.page_size)
    slots = PageSlots(pages, [pages.page(s) for s in pages.page_starts(again, 4)])
    assert slots.scatter_envelopes([envs[0], bytes(bad), envs[2], envs[3]], range(4)) == 1
    bf16 = HostPages(make_pool(layout, dtype="bfloat16"))
    assert PageSlots(bf16, []).scatter_envelopes(envs[:1], [0]) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_f16_pages_are_encoded_as_the_codec_encodes_them(layout: str) -> None:
    """A save's envelopes (``HostPages.envelopes``: header, records and pages copied and
    checksummed in one pass) are the codec's ``encode`` of the same blocks byte for byte,
    from pool pages and from flat pages; a page view of another shape is refused."""
    from kvstore.codec.envelope import Block, encode
    from kvstore.engines._sglang_pages import HostPages

    pool = make_pool(layout)
    pages = HostPages(pool)
    g = pages.geometry
    written = fill_pages(pool, 3, seed=11)
    views = [pages.page(s) for s in pages.page_starts(written, 3)]
    flat = [
        pages.flat(pool.get_data_page(int(written[s]), flat=True)) for s in (0, 2 * g.block_tokens)
    ]
    for blocks in (views, flat):
        names = [0xA0 + i for i in range(len(blocks))]
        want = encode(g, [Block(n, g.block_tokens, b) for n, b in zip(names, blocks)])
        assert [bytes(e) for e in pages.envelopes(names, blocks, 1)] == [want]
    with pytest.raises(CacheLayoutError, match="shape"):
        list(pages.envelopes([1], [views[0][:, :, :, :-1]], 1))


def test_a_page_written_in_one_layout_is_read_in_the_other(tmp_path: Path) -> None:
    first = make_pool("page_first")
    keys = page_keys(5)
    written = fill_pages(first, 5, seed=3)
    assert make_backend(first, str(tmp_path / "kv")).batch_set_v1(keys, written) == [True] * 5
    second = make_pool("layer_first")
    reader = make_backend(second, str(tmp_path / "kv"))
    dest = second.alloc(5 * second.page_size)
    assert reader.batch_get_v1(keys, dest) == [True] * 5
    assert same(blocks_of(second, dest), blocks_of(first, written))
    flat = [second.get_dummy_flat_data_page() for _ in keys]  # the generic path as well
    got = reader.batch_get(keys, flat)
    for i, page in enumerate(got):
        second.set_from_flat_data_page(int(dest[i * second.page_size]), page)
    assert same(blocks_of(second, dest), blocks_of(first, written))


def _child(mode: str, spec: dict[str, Any]) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "sglang_demo.py"), mode, json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_process_reads_what_an_engine_wrote_before_a_restart(tmp_path: Path) -> None:
    """A writer process exits (an engine stopped), then another process (the engine
    restarted, with the other layout) reads its pages byte for byte, and this process too."""
    blocks = str(tmp_path / "blocks.npy")
    spec = {"target": str(tmp_path / "kv"), "pages": 9, "seed": 11, "blocks": blocks}
    assert _child("write", {**spec, "layout": "page_first"})["pages_saved"] == 9
    assert _child("read", {**spec, "layout": "layer_first"})["pages_loaded"] == 9
    pool = make_pool()
    backend = make_backend(pool, spec["target"], interface_v1=1)
    dest = pool.alloc(9 * pool.page_size)
    assert backend.batch_get_v1(page_keys(9, 11), dest) == [True] * 9
    assert same(blocks_of(pool, dest), np.load(blocks))


def test_batch_exists_is_the_leading_run(tmp_path: Path) -> None:
    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"))
    keys = page_keys(8)
    indices = fill_pages(pool, 8)
    b = pool.page_size
    held = [0, 1, 2, 3, 4, 6]
    for i in held:
        assert backend.batch_set_v1([keys[i]], indices[i * b : (i + 1) * b]) == [True]
    assert backend.batch_exists(keys) == 5
    assert backend.batch_exists(keys[6:]) == 1
    assert backend.batch_exists([]) == 0
    assert backend.batch_exists(keys[5:]) == 0 and backend.batch_exists(keys[:1]) == 1
    # a store directory reads no key past an absent first page (the common miss: one
    # lookup); past a held one, every key is read, and a bad one is refused
    assert backend.batch_exists([keys[5], "not a page hash"]) == 0
    assert backend.stats()["keys_refused"] == 0
    assert backend.batch_exists([keys[0], "not a page hash"]) == 0
    assert backend.stats()["keys_refused"] == 1
    assert [backend.exists(k) for k in keys] == [i in held for i in range(8)]
    dest = pool.alloc(8 * b)
    assert backend.batch_get_v1(keys, dest) == [True] * 5 + [False] * 3  # ends at the gap
    assert backend.stats()["pages_missed"] == 3


def test_a_page_corrupted_on_disk_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    pool = make_pool("page_first")
    data = tmp_path / "kv"
    backend = make_backend(pool, str(data), interface_v1=1)
    keys = page_keys(6)
    written = fill_pages(pool, 6, seed=5)
    assert backend.batch_set_v1(keys, written) == [True] * 6
    victim = blocks_of(pool, written)[3].tobytes()
    raw = (data / "data.mdb").read_bytes()
    at = raw.find(victim[256:512])  # a slice of page 3's payload, stored once
    assert at > 0 and raw.find(victim[256:512], at + 1) < 0
    fd = os.open(data / "data.mdb", os.O_RDWR)
    try:
        os.pwrite(fd, bytes([raw[at + 7] ^ 0x10]), at + 7)
    finally:
        os.close(fd)
    dest = pool.alloc(6 * pool.page_size)
    assert backend.batch_get_v1(keys, dest) == [True] * 3 + [False] * 3
    assert same(blocks_of(pool, dest[: 3 * pool.page_size]), blocks_of(pool, written)[:3])
    corrupt, held = in_store(
        data,
        f"m = store.model({backend.namespace!r})\n"
        f"print(json.dumps([m.stats()['corrupt'], m.has({block_names(keys)})]))",
    )
    assert corrupt == 1 and held == [True] * 3 + [False] + [True] * 2
    assert backend.batch_exists(keys) == 3
    flat = [pool.get_dummy_flat_data_page() for _ in keys]
    assert [p is not None for p in backend.batch_get(keys, flat)] == [True] * 3 + [False] * 3


def test_another_salt_or_model_gets_nothing(tmp_path: Path) -> None:
    """SGLang seeds a salted request's page chain with its salt (storage_namespace_seed):
    its keys, computed by SGLang's own hash, are found only by that salt."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pool = make_pool()
    b = pool.page_size
    tokens = list(range(1000, 1000 + 4 * b))
    try:
        salted = get_storage_hash_str(RadixKey(tokens, cache_salt="tenant-a"), page_size=b)
    except RuntimeError as exc:  # SGLang compiles its page hash with the C++ toolchain
        pytest.skip(f"SGLang's native page hash does not build here: {exc}")
    other = get_storage_hash_str(RadixKey(tokens, cache_salt="tenant-b"), page_size=b)
    plain = get_storage_hash_str(RadixKey(tokens), page_size=b)
    target = str(tmp_path / "kv")
    backend = make_backend(pool, target, interface_v1=1)
    assert backend.batch_set_v1(salted, fill_pages(pool, 4)) == [True] * 4
    assert backend.batch_exists(salted) == 4
    assert backend.batch_exists(other) == 0 and backend.batch_exists(plain) == 0
    dest = pool.alloc(4 * b)
    assert backend.batch_get_v1(plain, dest) == [False] * 4
    assert backend.batch_get_v1(other, dest) == [False] * 4
    other_model = make_backend(make_pool(), target, model_name="another-model")
    assert other_model.batch_exists(salted) == 0
    assert other_model.batch_get_v1(salted, dest) == [False] * 4


def test_a_salt_passed_beside_the_keys_gets_a_namespace_of_its_own(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"), interface_v1=1)
    keys = page_keys(3)
    a = HiCacheStorageExtraInfo(extra_info={"cache_salt": "tenant-a"})
    b = HiCacheStorageExtraInfo(extra_info={"cache_salt": "tenant-b"})
    written = fill_pages(pool, 3)
    assert backend.batch_set_v1(keys, written, a) == [True] * 3
    assert backend.batch_exists(keys, a) == 3
    assert backend.batch_exists(keys, b) == 0 and backend.batch_exists(keys) == 0
    dest = pool.alloc(3 * pool.page_size)
    assert backend.batch_get_v1(keys, dest, HiCacheStorageExtraInfo()) == [False] * 3
    assert backend.batch_get_v1(keys, dest, a) == [True] * 3
    models = in_store(tmp_path / "kv", "print(json.dumps(store.models()))")
    assert [m for m in models if m.startswith("tiny@")] == [
        "tiny@sglang-tp0of1/float16+salt:" + hashlib.sha256(b"tenant-a").hexdigest()[:16]
    ]


def _grpc(tmp_path: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    return ServerProcess(tmp_path / "srv", "--grpc-port", str(port)), f"grpc://127.0.0.1:{port}"


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_server_target_round_trips(tmp_path: Path, kind: str) -> None:
    server, url = _grpc(tmp_path) if kind == "grpc" else (ServerProcess(tmp_path / "srv"), None)
    with server:
        target = url or server.url
        pool = make_pool("page_first")
        backend = make_backend(pool, target, interface_v1=1)
        written, read = round_trip(backend, pool, page_keys(7), v1=True)
        assert same(written, read)
        assert backend.batch_exists(page_keys(7)) == 7
        backend.close()


def test_a_server_killed_mid_run_gives_misses_not_exceptions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ServerProcess(tmp_path / "srv").start()
    try:
        pool = make_pool()
        backend = make_backend(pool, server.url, interface_v1=1, timeout=2)
        keys = page_keys(4)
        indices = fill_pages(pool, 4)
        assert backend.batch_set_v1(keys, indices) == [True] * 4
        assert backend.batch_exists(keys) == 4
        assert server.proc is not None
        server.proc.kill()  # SIGKILL: gone mid-run
        server.proc.wait()
        with caplog.at_level(logging.DEBUG, logger="sglang.tlkv"):
            dest = pool.alloc(4 * pool.page_size)
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, dest) == [False] * 4
            flat = [pool.get_dummy_flat_data_page() for _ in keys]
            assert backend.batch_get(keys, flat) == [None] * 4
            assert backend.get(keys[0], flat[0]) is None and backend.exists(keys[0]) is False
            assert backend.batch_set_v1(page_keys(2, 9), fill_pages(pool, 2)) == [False] * 2
            assert backend.batch_set(keys[:1], [pool.get_data_page(0)]) is False
            assert backend.set(keys[0], pool.get_data_page(0)) is False
            assert backend.batch_exists(keys) == 0  # again: logged at DEBUG this time
    finally:
        server.stop()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(r.getMessage().split(" failed")[0] for r in warned) == [
        "tlkv load",
        "tlkv lookup",
        "tlkv save",
    ]
    stats = backend.stats()
    assert stats["lookup_errors"] == 3 and stats["load_errors"] == 3
    assert stats["save_errors"] == 3 and stats["pages_dropped"] == 4
    assert stats["pages_missed"] == 9


def test_keys_that_are_not_page_hashes_are_refused(tmp_path: Path) -> None:
    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"))
    bad = ["hash0", page_keys(1)[0].upper()]
    indices = fill_pages(pool, 2)
    assert backend.batch_set_v1(bad, indices) == [False, False]
    assert backend.batch_exists(bad) == 0
    assert backend.batch_get_v1(bad, indices) == [False, False]
    assert backend.stats()["keys_refused"] == 3
    assert in_store(tmp_path / "kv", "print(json.dumps(store.models()))") == ["default"]


def test_stats_reach_sglangs_storage_metrics(tmp_path: Path) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"))
    round_trip(backend, pool, page_keys(4), v1=True)
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [4] and metrics.prefetch_pgs == [4]
    assert len(metrics.prefetch_bandwidth) == 1 and metrics.prefetch_bandwidth[0] > 0
    assert metrics.tlkv["pages_loaded"] == 4
    assert backend.get_stats().prefetch_pgs == []  # since the last call


def test_clear_deletes_a_store_namespace(tmp_path: Path) -> None:
    pool = make_pool()
    backend = make_backend(pool, str(tmp_path / "kv"))
    keys = page_keys(3)
    assert backend.batch_set_v1(keys, fill_pages(pool, 3)) == [True] * 3
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0


def test_hicache_file_reads_the_same_pages(tmp_path: Path) -> None:
    """The comparison's peer on the same pool and pages: SGLang's own file tier."""
    pool = make_pool()
    peer = make_file_backend(pool, str(tmp_path / "file"))
    written, read = round_trip(peer, pool, page_keys(4), v1=False)
    assert same(written, read)


def test_the_docs_snippet_shows_what_an_engine_stored(tmp_path: Path) -> None:
    """docs/sglang.md's python block, as written, on pages a bf16 engine of the model it
    names saved into ./tlkv-data (run in a process of its own: LMDB's one Store per path)."""
    from readme import blocks

    docs = REPO / "docs" / "sglang.md"
    (block,) = [
        b for b in blocks(docs) if b.marker == "snippet: run by tests/test_engine_sglang.py"
    ]
    pool = make_pool(dtype="bfloat16")
    backend = make_backend(
        pool, str(tmp_path / "tlkv-data"), model_name="meta-llama/Llama-3.1-8B", interface_v1=1
    )
    assert backend.batch_set_v1(page_keys(5), fill_pages(pool, 5)) == [True] * 5
    backend.close()
    out = subprocess.run(
        [sys.executable, "-c", block.text],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        out.stdout.strip() == "Geometry(block_tokens=16, n_layers=4, n_kv_heads=2, head_dim=64) 5"
    )
