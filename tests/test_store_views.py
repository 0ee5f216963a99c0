"""The store's readers: zero-copy views (valid only inside their reader; arrays kept past
it pin nothing and never see reused pages), iteration, export and import batches.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from store_helpers import REPO, check_consistency, flip_byte, full_blocks, hashes_of

from kvstore import (
    Block,
    BlockView,
    ChecksumError,
    Geometry,
    PutResult,
    Store,
    StoreError,
    decode,
    encode,
    split,
)
from kvstore.errors import ViewClosedError

# --- readers and zero-copy views -------------------------------------------------------


def test_view_is_a_zero_copy_read_only_blockview(store: Store) -> None:
    envelope = make_envelope(SMALL, 8, seed=17)
    store.put(envelope)
    h = hashes_of(envelope)[1]
    expected = decode(envelope)[1]
    with store.reader() as r:
        bv = r.view(h)
        assert bv is not None
        assert isinstance(bv, BlockView)
        assert (bv.hash, bv.n_tokens, bv.version, bv.geometry) == (h, 4, 1, SMALL)
        assert np.array_equal(bv.kv, expected.kv) and bv.kv.dtype == np.float16
        assert np.array_equal(bv.k, expected.k) and np.array_equal(bv.v, expected.v)
        assert bytes(bv.raw) == bytes(expected.raw)
        assert not bv.kv.flags.writeable
        with pytest.raises(ValueError):
            bv.kv[0, 0, 0, 0, 0] = 1
        # No copy: the array's memory is inside the stored envelope's LMDB buffer.
        stored = r.envelope(h)
        assert stored is not None
        raw = np.frombuffer(stored, dtype=np.uint8)
        assert bv.kv.__array_interface__["data"][0] == raw.__array_interface__["data"][0] + 40
        checked = r.view(h, verify=True)
        assert checked is not None
        assert np.array_equal(checked.kv, bv.kv)
        assert r.view(999) is None and r.view(999, verify=True) is None
        assert r.envelope(999) is None
        for bad in (-1, 1 << 64):
            with pytest.raises(ValueError):
                r.view(bad)
            with pytest.raises(ValueError):
                r.envelope(bad)
        envelope_view = r.envelope(h)
        assert envelope_view is not None
        assert bytes(envelope_view) == split(envelope)[1] and envelope_view.readonly
    for use in (lambda: bv.kv, lambda: bv.k, lambda: bv.raw, lambda: bv.hash, lambda: checked.kv):
        with pytest.raises(ViewClosedError):
            use()
    assert "closed" in repr(bv)
    with pytest.raises(ValueError):  # released
        bytes(envelope_view)
    for use_reader in (lambda: r.view(h), lambda: r.envelope(h), lambda: list(r.iter_blocks())):
        with pytest.raises(ViewClosedError):
            use_reader()
    with pytest.raises(StoreError):
        r.__enter__()


def test_a_view_kept_past_its_reader_pins_nothing(store: Store) -> None:
    envelope = make_envelope(SMALL, 8, seed=19)
    store.put(envelope)
    h = hashes_of(envelope)[0]
    with store.reader() as r:
        bv = r.view(h)
        checked = r.view(h, verify=True)
        assert bv is not None and checked is not None
        assert bv.kv.sum() == checked.kv.sum() and len(bv.raw) and bv.scales is None
    assert store.lingering_snapshots() == 0  # the views themselves hold no stored memory
    with pytest.raises(ViewClosedError):
        bv.kv  # noqa: B018


def test_arrays_kept_past_the_reader_never_see_reused_pages(store: Store) -> None:
    """An array taken from a view cannot be revoked: the reader's snapshot stays open
    while it lives, so deleting the block and churning the store never changes it."""
    envelope = make_envelope(SMALL, 8, seed=20)
    store.put(envelope)
    h = hashes_of(envelope)[0]
    with store.reader() as r:
        bv = r.view(h)
        assert bv is not None
        kv, k = bv.kv, bv.k  # numpy views into LMDB's map
        raw = bv.raw[4:20]  # a slice of a memoryview
        stored = r.envelope(h)
        assert stored is not None
        whole = np.frombuffer(stored, np.uint8)
        expected = (kv.copy(), k.copy(), bytes(raw), whole.tobytes())
    assert store.lingering_snapshots() == 1
    assert store.delete(h)
    for seed in range(5):  # churn: freed pages would be reused by these writes
        store.put(encode(SMALL, full_blocks(SMALL, 64, seed=100 + seed)))
    assert np.array_equal(kv, expected[0]) and np.array_equal(k, expected[1])
    assert bytes(raw) == expected[2] and whole.tobytes() == expected[3]
    del bv, kv, k, raw, whole
    store.put(encode(SMALL, full_blocks(SMALL, 1, seed=200)))  # a write reaps
    assert store.lingering_snapshots() == 0


def _run_isolated(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (a crash there fails the test, not pytest)."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert out.returncode == 0, out.stderr  # a segfault would be -11
    return out


def test_remapping_under_an_escaped_array_is_refused_not_a_crash(tmp_path: Path) -> None:
    """Growing the map moves it: with an array from a closed reader still alive, the
    store refuses (StoreError) instead of unmapping memory under it (a segfault)."""
    script = textwrap.dedent(
        f"""
        import numpy as np
        from kvstore import Geometry, Store, StoreError, encode
        from conftest import make_blocks

        g = Geometry(16, 4, 2, 64)
        with Store({str(tmp_path / "s")!r}, map_bytes=1 << 20) as s:
            first = make_blocks(g, 32, seed=1)
            s.put(encode(g, first))
            with s.reader() as r:
                kv = r.view(first[0].hash).kv
            expected = kv.copy()
            try:
                for i in range(8):  # 4 MiB into a 1 MiB map
                    s.put(encode(g, make_blocks(g, 16 * 32, seed=10 + i)))
                print("grew")
            except StoreError as exc:
                print("refused", "zero-copy" in str(exc))
            print("intact", bool(np.array_equal(kv, expected)))
            del kv
            s.put(encode(g, make_blocks(g, 16 * 32, seed=50)))
            print("grows after", s.map_bytes > 1 << 20)
        """
    )
    out = _run_isolated(script)
    assert out.stdout.split("\n")[:3] == ["refused True", "intact True", "grows after True"]


def test_closing_with_an_escaped_array_keeps_the_map(tmp_path: Path) -> None:
    """Closing would unmap what the array points into: the environment stays mapped."""
    script = textwrap.dedent(
        f"""
        import numpy as np
        from kvstore import Store, encode
        from conftest import SMALL, make_blocks

        s = Store({str(tmp_path / "s")!r})
        blocks = make_blocks(SMALL, 16, seed=21)
        s.put(encode(SMALL, blocks))
        with s.reader() as r:
            kv = r.view(blocks[0].hash).kv
        expected = kv.copy()
        s.close()
        print("intact", bool(np.array_equal(kv, expected)))
        """
    )
    out = _run_isolated(script)
    assert out.stdout.strip() == "intact True"
    assert "stays mapped" in out.stderr


def test_v2_views_have_codes_and_scales(store: Store) -> None:
    envelope = make_envelope(SMALL, 4, version=2, seed=18)
    store.put(envelope)
    (h,) = hashes_of(envelope)
    with store.reader() as r:
        bv = r.view(np.uint64(h))
        assert bv is not None
        assert bv.kv.dtype == np.uint8 and bv.scales is not None
        assert np.array_equal(bv.to_float32(), decode(envelope)[0].to_float32())


def test_view_latency_does_not_grow_with_block_size(tmp_path: Path) -> None:
    """A view of a 2 MiB block costs about what a tiny one does, far less than a copy."""
    big_geometry = Geometry(16, 32, 8, 128)  # 2 MiB v1 payload
    latency = {}
    for name, g in (("tiny", SMALL), ("big", big_geometry)):
        kv = np.ones(g.kv_shape, dtype=np.float16)
        with Store(tmp_path / name, sync=False) as s:
            s.put(encode(g, [Block(7, g.block_tokens, kv)]))
            with s.reader() as r:
                times = []
                for _ in range(2000):
                    t0 = time.perf_counter()
                    view = r.view(7)
                    _ = view.kv if view is not None else None
                    times.append(time.perf_counter() - t0)
                latency[name] = statistics.median(times)
                value = r.envelope(7)
                assert value is not None
                copies = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    bytes(value)
                    copies.append(time.perf_counter() - t0)
                copy = statistics.median(copies)
    # py-lmdb touches one byte per 4 KiB page of a value (~10 ns each), nothing more.
    assert latency["big"] < 10 * latency["tiny"] + 20e-6, latency
    assert latency["big"] < copy / 5, (latency, copy)


def test_iter_blocks_and_sequences(store: Store) -> None:
    envelope = make_envelope(SMALL, 10, seed=19)
    store.put(envelope)
    store.put_sequence("b", envelope)
    store.put_sequence("a", make_envelope(SMALL, 3, seed=20))
    with store.reader() as r:
        blocks = list(r.iter_blocks())
        assert [h for h, _ in blocks] == sorted(h for h in hashes_of(envelope) if h)
        assert [bytes(v) for _, v in blocks] == [
            split(envelope)[hashes_of(envelope).index(h)] for h, _ in blocks
        ]
        assert list(r.iter_sequences()) == [
            ("a", store.get_sequence("a")),
            ("b", envelope),
        ]
        records = list(r.iter_sequence_records())
    a_tail = split(make_envelope(SMALL, 3, seed=20))[0]
    assert records == [("a", [], a_tail), ("b", hashes_of(envelope)[:2], split(envelope)[2])]


def test_export_and_import_batch_round_trip(tmp_path: Path) -> None:
    envelope = make_envelope(SMALL, 22, seed=21)
    with Store(tmp_path / "a") as a:
        a.put(envelope)
        a.put_sequence("s", make_envelope(SMALL, 9, seed=22))
        with a.reader() as r:
            blocks = [bytes(v) for _, v in r.iter_blocks()]
            sequences = list(r.iter_sequences())
        with Store(tmp_path / "b") as b:
            assert b.import_batch(blocks, sequences) == PutResult(7, 2, 1)
            assert b.get_sequence("s") == a.get_sequence("s")
            assert b.get_many(hashes_of(envelope)[:-1]) == split(envelope)[:-1]
            check_consistency(b)


def test_import_batch_is_all_or_nothing(store: Store) -> None:
    good = make_envelope(SMALL, 8, seed=23)
    bad = flip_byte(make_envelope(SMALL, 8, seed=24), 100)
    with pytest.raises(ChecksumError):
        store.import_batch([good, bad])
    with pytest.raises(ValueError):
        store.import_batch([good], [("bad name!", good)])
    assert store.stats()["blocks"] == 0 and store.sequences() == []
