"""Models (namespaces) of one store: isolation, geometries, stats, quota and store-wide
eviction, the registry, and a store written before models existed.

Every test runs a real LMDB environment under ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL, make_blocks, make_envelope

import kvstore.store.diskformat as L
from kvstore import Block, Geometry, ShapeError, Store, StoreError, StoreFullError, decode, encode
from kvstore.errors import ModelLimitError
from kvstore.store.debug import raw_snapshot

REPO = Path(__file__).resolve().parent.parent
VECTORS = REPO / "tests" / "vectors"
OTHER = Geometry(block_tokens=8, n_layers=1, n_kv_heads=1, head_dim=4)
SINGLE = SMALL.envelope_bytes(1)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "store") as s:
        yield s


def singles(n: int, seed: int, geometry: Geometry = SMALL) -> list[bytes]:
    """``n`` single-block envelopes of one chain."""
    blocks = make_blocks(geometry, n * geometry.block_tokens, seed)
    return [encode(geometry, [b]) for b in blocks]


def hashes_of(envelope: bytes) -> list[int]:
    return [int(h) for h in decode(envelope).hashes if h]


def meta_counter(s: Store, key: bytes) -> int:
    with raw_snapshot(s, buffers=False) as (txn, dbs):
        return L.counter(txn.get(key, None, dbs.meta))


def check_models(root: Store) -> None:
    """Per model: index = blocks, counters = stored values; store-wide: LRU = every
    model's unpinned blocks, totals = the sum of the models'."""
    total = 0
    lru_want: set[tuple[int, int, int]] = set()  # (tick, hash, model)
    for model in root.models():
        s = root.model(model)
        with raw_snapshot(s) as (txn, dbs):
            blocks = {bytes(k): len(v) for k, v in txn.cursor(db=dbs.blocks)}
            seqs = sum(len(v) for v in txn.cursor(db=dbs.seqs).iternext(keys=False))
            refs = {bytes(k) for k in txn.cursor(db=dbs.refs).iternext(values=False)}
            atime = {bytes(k): L.COUNTER.unpack(v)[0] for k, v in txn.cursor(db=dbs.atime)}
            cur = txn.cursor(db=dbs.index)
            dups = list(cur.iternext_dup(keys=False)) if cur.set_key(L.INDEX_KEY) else []
        assert sorted(L.INDEX_VALUE.unpack(v)[0] for v in dups) == sorted(
            L.BLOCK_KEY.unpack(k)[0] for k in blocks
        )
        assert s.stats()["bytes"] == sum(blocks.values()) + seqs
        assert set(atime) == {k for k in blocks if k not in refs}
        number = max(dbs.number, 0)
        lru_want |= {(t, L.BLOCK_KEY.unpack(k)[0], number) for k, t in atime.items()}
        total += sum(blocks.values()) + seqs
    assert root.total_bytes() == total
    with raw_snapshot(root) as (txn, dbs):
        lru = {(*L.LRU_KEY.unpack(bytes(k)), L.lru_model(v)) for k, v in txn.cursor(db=dbs.lru)}
    assert lru == lru_want


# --- isolation ----------------------------------------------------------------------------


def test_two_models_with_one_geometry_never_see_each_others_blocks(store: Store) -> None:
    base, tuned = store.model("meta-llama/Llama-3.1-8B@5206a32/bf16"), store.model("tuned+v2")
    blocks = make_blocks(SMALL, 4 * 3 + 1, seed=7)
    prompt = encode(SMALL, blocks)
    other = encode(SMALL, [Block(b.hash, b.n_tokens, b.kv + 1) for b in blocks])  # other KV
    assert hashes_of(prompt) == hashes_of(other)
    hashes = hashes_of(prompt)
    assert base.put(prompt).stored == 3
    assert tuned.has(hashes) == [False] * 3 and tuned.longest_prefix(hashes) == 0
    assert store.has(hashes) == [False] * 3  # the default model is a model too
    assert tuned.get(hashes[0]) is None and tuned.get_buffers(hashes) == []
    with tuned.reader() as r:
        assert r.view(hashes[0]) is None and list(r.iter_blocks()) == []
    assert tuned.put(other).stored == 3  # not a duplicate: another model's block
    assert base.get(hashes[0]) != tuned.get(hashes[0])
    assert base.get(hashes[0]) == decode(prompt).single(0)
    assert tuned.get(hashes[0]) == decode(other).single(0)
    base.put_sequence("chat", prompt)
    assert tuned.get_sequence("chat") is None and tuned.sequences() == []
    assert base.get_sequence("chat") == prompt
    assert tuned.delete(hashes[1]) and tuned.has(hashes) == [True, False, True]
    assert base.has(hashes) == [True, True, True]
    check_models(store)


def test_a_model_not_created_reads_nothing_and_is_created_by_its_first_write(
    store: Store,
) -> None:
    m = store.model("later")
    assert m.geometry is None and m.has([1, 2]) == [False, False] and m.get(1) is None
    assert m.sequences() == [] and m.delete(1) is False and m.delete_sequence("x") is False
    assert m.stats()["blocks"] == 0 and m.stats()["bytes"] == 0
    assert store.models() == ["default"] and not store.has_model("later")
    m.put(make_envelope(SMALL, 8, seed=1))
    assert store.models() == ["default", "later"] and store.has_model("later")
    assert store.model("later") is m  # one handle per model (and quota) per store
    assert m.model_id == "later" and store.model_id == "default"
    assert store.model("default") is store


@pytest.mark.parametrize("bad", ["", "x" * 201, "a b", "ü", "a?b", "a#b", "a%2F", 7, None, b"abc"])
def test_model_ids_are_checked(store: Store, bad: object) -> None:
    with pytest.raises(ValueError, match="model id"):
        store.model(bad)  # type: ignore[arg-type]
    assert store.models() == ["default"]


def test_a_refused_first_put_creates_no_model(store: Store) -> None:
    m = store.model("m")
    bad = bytearray(make_envelope(SMALL, 8, seed=1))
    bad[-1] ^= 1
    with pytest.raises(ValueError):
        m.put(bytes(bad))
    with pytest.raises(ValueError):
        m.put(b"junk")
    assert store.models() == ["default"]


def test_each_model_has_its_own_geometry(store: Store) -> None:
    a, b = store.model("a"), store.model("b")
    a.put(make_envelope(SMALL, 8, seed=1))
    b.put(make_envelope(OTHER, 16, seed=1))
    assert (a.geometry, b.geometry, store.geometry) == (SMALL, OTHER, None)
    with pytest.raises(ShapeError):
        a.put(make_envelope(OTHER, 16, seed=2))
    with pytest.raises(ShapeError):
        store.model("b", geometry=SMALL)
    store.put(make_envelope(OTHER, 16, seed=3))
    assert store.geometry == OTHER
    with store.model("b").reader() as r:
        (h,) = hashes_of(make_envelope(OTHER, 8, seed=1))
        view = r.view(h)
        assert view is not None and view.kv.shape == OTHER.kv_shape
    check_models(store)


def test_geometry_and_models_survive_reopening(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        s.model("a").put(make_envelope(SMALL, 8, seed=1))
        s.model("b").put(make_envelope(OTHER, 16, seed=1))
    with Store(tmp_path / "s") as s:
        assert s.models() == ["a", "b", "default"]
        assert s.model("a").geometry == SMALL and s.model("b").geometry == OTHER
        assert s.model("a").stats()["blocks"] == 2 and s.model("b").stats()["blocks"] == 2
        check_models(s)


def test_per_model_stats(store: Store) -> None:
    a = store.model("a")
    store.put(make_envelope(SMALL, 4 * 2, seed=1))
    a.put(make_envelope(SMALL, 4 * 3, seed=2))
    a.put_sequence("s", make_envelope(SMALL, 4 * 1 + 2, seed=3))
    sa, sd = a.stats(), store.stats()
    assert (sd["blocks"], sd["bytes"], sd["sequences"]) == (2, 2 * SINGLE, 0)
    assert (sa["blocks"], sa["sequences"], sa["pinned_blocks"]) == (4, 1, 1)
    assert sa["bytes"] + sd["bytes"] == store.total_bytes()  # type: ignore[operator]
    assert a.get(hashes_of(make_envelope(SMALL, 4 * 3, seed=2))[0]) is not None
    assert (a.stats()["hits"], store.stats()["hits"]) == (1, 0)
    check_models(store)


# --- capacity, quota, eviction ------------------------------------------------------------


def test_capacity_evicts_across_models_oldest_first(tmp_path: Path) -> None:
    with Store(tmp_path / "s", capacity_bytes=4 * SINGLE) as s:
        a, b = s.model("a"), s.model("b")
        old = singles(2, seed=1)
        for e in old:
            a.put(e)
        mid = singles(2, seed=2)
        for e in mid:
            b.put(e)
        new = singles(2, seed=3)
        for e in new:
            s.put(e)  # the default model's puts evict model a's (the oldest) blocks
        assert a.has([hashes_of(e)[0] for e in old]) == [False, False]
        assert b.has([hashes_of(e)[0] for e in mid]) == [True, True]
        assert a.stats()["evictions"] == 2 and b.stats()["evictions"] == 0
        assert s.stats()["evictions"] == 0 and a.stats()["bytes"] == 0
        check_models(s)


def test_quota_evicts_the_models_own_blocks_only(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        s.put(singles(1, seed=9)[0])  # the oldest block of the store, in another model
        q = s.model("q", quota_bytes=2 * SINGLE)
        assert q.quota_bytes == 2 * SINGLE
        es = singles(4, seed=1)
        for e in es:
            q.put(e)
        assert q.has([hashes_of(e)[0] for e in es]) == [False, False, True, True]
        assert q.stats()["bytes"] == 2 * SINGLE and q.stats()["evictions"] == 2
        assert s.stats()["blocks"] == 1 and s.stats()["evictions"] == 0
        with pytest.raises(StoreFullError, match="quota_bytes"):
            q.put(make_envelope(SMALL, 4 * 3, seed=5))  # 3 blocks > quota: nothing stored
        assert q.stats()["blocks"] == 2
        unbounded = s.model("q")  # the quota is the handle's: another handle may exceed it
        unbounded.put(make_envelope(SMALL, 4 * 3, seed=5))
        assert unbounded.stats()["blocks"] == 5
        check_models(s)


def test_quota_of_the_default_model(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        s.model("a").put(singles(1, seed=9)[0])
        d = s.model("default", quota_bytes=SINGLE)
        for e in singles(3, seed=1):
            d.put(e)
        assert d.stats()["blocks"] == 1 and s.model("a").stats()["blocks"] == 1
        check_models(s)


def test_eviction_of_a_model_another_process_created(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store(path, capacity_bytes=3 * SINGLE) as s:
        s.put(singles(1, seed=1)[0])
        code = textwrap.dedent(
            f"""
            import sys; sys.path.insert(0, {str(REPO / "tests")!r})
            from conftest import SMALL, make_envelope
            from kvstore import Store
            with Store({str(path)!r}) as s:
                s.model("theirs").put(make_envelope(SMALL, 8, seed=2))
            """
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert s.models() == ["default", "theirs"]
        for e in singles(3, seed=3):
            s.put(e)  # evicts the other process's model's blocks: opened on the way
        assert s.model("theirs").stats()["blocks"] == 0
        check_models(s)


def test_registry_refuses_more_than_max_models(tmp_path: Path) -> None:
    with Store(tmp_path / "s", max_models=2) as store:
        store.model("a").put(make_envelope(SMALL, 8, seed=1))
        store.model("b").put(make_envelope(SMALL, 8, seed=1))
        with pytest.raises(ModelLimitError, match="at most 2 models besides default") as info:
            store.model("c").put(make_envelope(SMALL, 8, seed=1))
        assert info.value.http_status == 507 and info.value.kind == "model_limit"
        assert store.models() == ["a", "b", "default"]
        assert store.model("a").put(make_envelope(SMALL, 8, seed=2)).stored == 2  # still fine


def test_the_default_limit_admits_200_models_and_has_room_for_all(tmp_path: Path) -> None:
    """200 models besides default: every one written, read and counted, in the process
    that made them and after reopening; the 201st is refused by name."""
    env = make_envelope(SMALL, 8, seed=1)
    hashes = hashes_of(env)
    path = tmp_path / "s"
    with Store(path) as store:
        for i in range(200):
            store.model(f"m{i}").put(env)
        with pytest.raises(ModelLimitError, match="at most 200 models"):
            store.model("one-more").put(env)
        assert len(store.models()) == 201
        models = [m for m in store.models() if m != "default"]
        assert all(store.model(m).stats()["blocks"] == 2 for m in models)
    with Store(path) as store:
        with pytest.raises(ModelLimitError):
            store.model("one-more").put(env)
        assert all(store.model(m).has(hashes) == [True, True] for m in models)
        assert store.total_bytes() == 200 * 2 * SINGLE


_REGISTER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from conftest import SMALL, make_envelope
    from kvstore import Store
    with Store(sys.argv[2], max_models=int(sys.argv[3])) as s:
        for model in sys.argv[4:]:
            s.model(model).put(make_envelope(SMALL, 8, seed=1))
    """
)


def register_elsewhere(path: Path, max_models: int, *models: str) -> None:
    """Register ``models`` from another process."""
    args = [str(REPO / "tests"), str(path), str(max_models), *models]
    subprocess.run([sys.executable, "-c", _REGISTER, *args], check=True, cwd=REPO)


def test_the_limit_holds_against_models_another_process_registered(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store(path, max_models=3) as store:
        store.model("a").put(make_envelope(SMALL, 8, seed=1))
        register_elsewhere(path, 3, "b", "c")
        with pytest.raises(ModelLimitError, match="holds 3"):
            store.model("d").put(make_envelope(SMALL, 8, seed=1))
        assert store.models() == ["a", "b", "c", "default"]
        assert store.model("c").stats()["blocks"] == 2


def test_a_store_past_the_limit_opens_and_serves_every_model(tmp_path: Path) -> None:
    """A store holding more models than the limit it is opened with (205, registered
    under a higher limit) reads every one of them and refuses a new one."""
    path = tmp_path / "s"
    register_elsewhere(path, 205, *(f"m{i}" for i in range(205)))
    with Store(path) as store:
        assert len(store.models()) == 206
        assert all(store.model(m).stats()["blocks"] == 2 for m in store.models() if m != "default")
        with pytest.raises(ModelLimitError, match="holds 205"):
            store.model("new").put(make_envelope(SMALL, 8, seed=1))
        check_models(store)
    out = tmp_path / "all.tlkv"
    ran = subprocess.run(
        [sys.executable, "-m", "kvstore", "archive", "create", "--data", str(path), "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    ran = subprocess.run(
        [sys.executable, "-m", "kvstore", "archive", "ls", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0 and "m204" in ran.stdout, ran.stderr


@pytest.mark.parametrize("bad", [-1, 1001, True, 2.0])
def test_max_models_is_checked(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="max_models"):
        Store(tmp_path / "s", max_models=bad)  # type: ignore[arg-type]


def test_model_handles_close_with_the_store(tmp_path: Path) -> None:
    s = Store(tmp_path / "s")
    m = s.model("m")
    m.put(make_envelope(SMALL, 8, seed=1))
    s.close()
    with pytest.raises(StoreError, match="closed"):
        m.has([1])


# --- a store written before models ------------------------------------------------------------


def test_a_store_written_by_the_release_before_models_opens_as_default(tmp_path: Path) -> None:
    want = json.loads((VECTORS / "format1.json").read_text())
    path = tmp_path / "old"
    shutil.copytree(VECTORS / "store-format1", path)
    with Store(path) as s:
        assert s.geometry == Geometry(*want["geometry"]) and s.models() == ["default"]
        with s.reader() as r:
            blocks = {f"{h:016x}": hashlib.sha256(bytes(v)).hexdigest() for h, v in r.iter_blocks()}
        assert blocks == want["blocks"]
        seqs = {n: hashlib.sha256(s.get_sequence(n) or b"").hexdigest() for n in s.sequences()}
        assert seqs == want["sequences"]
        stats = s.stats()
        assert {k: dict(stats)[k] for k in want["stats"]} == want["stats"]
        with raw_snapshot(s, buffers=False) as (txn, dbs):
            fmt = L.META_FORMAT_VALUE.unpack(txn.get(L.META_FORMAT, None, dbs.meta))[0]
        assert fmt == L.STORE_FORMAT  # untouched until another model exists
        s.model("new").put(make_envelope(SMALL, 8, seed=1))
        with raw_snapshot(s, buffers=False) as (txn, dbs):
            fmt = L.META_FORMAT_VALUE.unpack(txn.get(L.META_FORMAT, None, dbs.meta))[0]
        assert fmt == L.STORE_FORMAT_MODELS
        check_models(s)
    with Store(path) as s:
        assert s.models() == ["default", "new"] and s.stats()["blocks"] == want["stats"]["blocks"]


def test_a_reserved_number_taken_by_another_model_is_never_read(store: Store) -> None:
    x, y = store.model("x"), store.model("y")
    bad = bytearray(make_envelope(SMALL, 8, seed=1))
    bad[-1] ^= 1
    with pytest.raises(ValueError):
        y.put(bytes(bad))  # y reserved the next number, then registered nothing
    x.put(make_envelope(SMALL, 8, seed=1))  # x takes that number
    hashes = hashes_of(make_envelope(SMALL, 8, seed=1))
    assert x.has(hashes) == [True, True]
    assert y.has(hashes) == [False, False] and y.get(hashes[0]) is None
    y.put(make_envelope(SMALL, 8, seed=2))
    assert y.has(hashes) == [False, False] and x.has(hashes) == [True, True]
    assert store.models() == ["default", "x", "y"]
    check_models(store)


def test_a_read_between_a_new_models_number_and_its_first_write_keeps_the_number(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put resolves a new model's number, then opens its write transaction; a read of
    the same handle in between (another thread's: a reader, the tier's uploader or
    filler) keeps that number, so the put writes under it (a forgotten number would
    leave the put writing into no model: ``struct.error``). The read is made to land in
    that window here: a real read, run just before the real write."""
    m = store.model("fresh")
    lmdb_env = m._h.env.lmdb
    real_write = lmdb_env.write
    seen: list[list[bool]] = []

    def a_read_then_the_write(body: Any, need: int = 0) -> Any:
        if m._h.pending is not None and m._h.dbs.number == m._h.pending:  # the put's write
            seen.append(m.has([1]))  # its number reserved and resolved, not registered
        return real_write(body, need)

    monkeypatch.setattr(lmdb_env, "write", a_read_then_the_write)
    envelope = make_envelope(SMALL, 8, seed=3)
    m.put(envelope)
    monkeypatch.undo()
    assert seen and seen[0] == [False]
    assert m.has(hashes_of(envelope)) == [True, True] and m.geometry == SMALL
    assert store.models() == ["default", "fresh"]
    x = store.model("x")  # the next model takes the next number
    x.put(make_envelope(SMALL, 8, seed=4))
    assert x.has(hashes_of(envelope)) == [False, False]
    check_models(store)


def test_a_number_forgotten_between_resolve_and_the_write_is_resolved_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write checks the number it writes under: one forgotten by another thread after
    the put resolved it (what a model's deletion does to a handle) is resolved again
    inside the write's retry, never written as no model."""
    m = store.model("fresh")
    lmdb_env = m._h.env.lmdb
    real_write = lmdb_env.write
    forgotten: list[int] = []

    def forget_once_then_write(body: Any, need: int = 0) -> Any:
        h = m._h
        if h.pending is not None and h.dbs.number == h.pending and not forgotten:  # the put's
            forgotten.append(h.pending)  # write: its number reserved and resolved
            m._h.forget_number()
        return real_write(body, need)

    monkeypatch.setattr(lmdb_env, "write", forget_once_then_write)
    envelope = make_envelope(SMALL, 8, seed=5)
    m.put(envelope)
    monkeypatch.undo()
    assert forgotten and m._h.dbs.number == forgotten[0]  # resolved again: still free
    assert m.has(hashes_of(envelope)) == [True, True]
    assert store.models() == ["default", "fresh"]
    check_models(store)


def test_a_handle_given_a_geometry_is_kept_and_closed_with_the_store(tmp_path: Path) -> None:
    """Asking again for a model not created yet with the same geometry reuses its handle,
    and closing the store closes it (with any tier link it has)."""
    store = Store(tmp_path / "s")
    first = store.model("later", geometry=SMALL)
    assert store.model("later", geometry=SMALL) is first
    assert first.geometry == SMALL and store.model("later").geometry is None
    store.close()
    with pytest.raises(StoreError):
        first.has([1])


def test_a_models_value_gives_its_number_alone() -> None:
    """``model_number`` reads the number ``unpack_model`` reads, with or without a
    geometry adopted, from bytes or from the buffer a read transaction hands out: every
    read transaction of a model other than default confirms its number with it."""
    for number in (1, 7, 2**32 - 1):
        for geometry in (None, SMALL):
            value = L.pack_model(number, geometry)
            assert L.unpack_model(value)[0] == number
            assert L.model_number(value) == number
            assert L.model_number(memoryview(value)) == number
