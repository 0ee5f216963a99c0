"""Token ids kept per block and the store's KV event log (kvstore/store/tokentxn.py,
eventlog.py): what each change of the block space logs, in which order, under which
sequence numbers; the checks that refuse tokens not hashing to their blocks."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL
from prompts import flat, log_events, prompt

from kvstore import Store, split
from kvstore.codec.tokens import BlockTokens
from kvstore.errors import TokenMismatchError
from kvstore.events.wire import MEDIUM_STORAGE, MEDIUM_TIER
from kvstore.store.debug import raw_snapshot
from kvstore.store.kvevents import DEFAULT_EVENTS_LIMIT

SINGLE = SMALL.envelope_bytes(1)


def _stored(events: list[dict]) -> list[tuple[list[int], int | None, list[int]]]:
    return [
        (e["block_hashes"], e["parent_block_hash"], e["token_ids"])
        for e in events
        if e["type"] == "BlockStored"
    ]


def test_a_put_with_tokens_is_checked_kept_and_announced_in_chain_order(tmp_path: Path) -> None:
    ids, hashes, env = prompt(22)
    with Store(tmp_path / "s", events=100) as s:
        assert s.events_bounds() == (0, 0, 100)
        assert s.put(env, tokens=ids).stored == 5
        [(seq, model, events)] = log_events(s)
        assert (seq, model) == (0, "default")
        assert _stored(events) == [(hashes, None, ids[:20])]
        assert events[0]["medium"] == MEDIUM_STORAGE and events[0]["block_size"] == 4
        kept = s.block_tokens(hashes)
        assert [p for p, _ in kept] == [0, *hashes[:-1]]  # type: ignore[misc]
        assert np.concatenate([t for _, t in kept]).tolist() == ids[:20]  # type: ignore[misc]
        assert s.events_bounds() == (0, 1, 100)


@pytest.mark.parametrize("what", ["put", "put_sequence", "import_batch"])
def test_tokens_that_do_not_hash_to_their_block_store_nothing(tmp_path: Path, what: str) -> None:
    ids, hashes, env = prompt(20)
    bad = list(ids)
    bad[13] += 1  # block 3
    with Store(tmp_path / "s", events=100) as s:
        before = s.stats()
        with pytest.raises(TokenMismatchError, match=f"block 3 \\({hashes[3]:016x}\\)") as exc:
            if what == "put":
                s.put(env, tokens=bad)
            elif what == "put_sequence":
                s.put_sequence("q", env, tokens=bad)
            else:
                rows = BlockTokens(
                    np.array([0, *hashes[:-1]], "<u8"), np.array(bad, "<u4").reshape(5, 4)
                )
                s.import_batch([env], tokens=[rows])
        assert exc.value.block_hash == hashes[3]
        assert s.stats() == before and s.sequences() == []
        assert s.has(hashes) == [False] * 5 and s.block_tokens(hashes) == [None] * 5
        assert log_events(s) == [] and s.events_bounds()[1] == 0


def test_blocks_without_tokens_stay_valid_and_gain_them_from_a_later_put(tmp_path: Path) -> None:
    ids, hashes, env = prompt(16)
    with Store(tmp_path / "s", events=100) as s:
        s.put(env)
        assert s.block_tokens(hashes) == [None] * 4 and log_events(s) == []
        assert s.get(hashes[0]) is not None
        assert s.put(env, tokens=ids).duplicate == 4
        assert _stored(log_events(s)[0][2]) == [(hashes, None, ids)]
        s.put(env, tokens=ids)  # announced already: nothing new
        assert s.events_bounds()[1] == 1


def test_a_child_is_announced_only_after_its_parent(tmp_path: Path) -> None:
    ids, hashes, env = prompt(20)
    parts = split(env)
    with Store(tmp_path / "s", events=100) as s:
        # blocks 2..4 first, chained from block 1, which is not here: kept, not announced
        s.put(_join(parts[2:]), tokens=ids[8:], parent=hashes[1])
        assert log_events(s) == []
        assert s.block_tokens([hashes[2]])[0][0] == hashes[1]  # type: ignore[index]
        s.put(_join(parts[:2]), tokens=ids[:8])  # the parents: their waiting children follow
        chains = [st for _, _, ev in log_events(s) for st in _stored(ev)]
        assert chains == [(hashes, None, ids[:20])]  # one chain, each after its parent
        s.put(env, tokens=ids)  # nothing new to announce
        assert s.events_bounds()[1] == 1
        with raw_snapshot(s) as (txn, dbs):
            assert txn.stat(dbs.waiting)["entries"] == 0


def test_an_orphan_that_leaves_stops_waiting(tmp_path: Path) -> None:
    ids, hashes, env = prompt(12)
    parts = split(env)
    with Store(tmp_path / "s", events=100) as s:
        s.put(_join(parts[1:]), tokens=ids[4:], parent=hashes[0])
        with raw_snapshot(s) as (txn, dbs):
            assert txn.stat(dbs.waiting)["entries"] == 2  # 1 waits for 0, 2 for 1
        s.delete(hashes[1])
        with raw_snapshot(s) as (txn, dbs):
            assert txn.stat(dbs.waiting)["entries"] == 1  # 2 for 1, which may come back
        s.put(parts[0], tokens=ids[:4])
        assert [st[0] for _, _, ev in log_events(s) for st in _stored(ev)] == [[hashes[0]]]
        s.put(parts[1], tokens=ids[4:8], parent=hashes[0])  # 1 is back: 2 follows it
        assert [st[0] for _, _, ev in log_events(s, 1) for st in _stored(ev)] == [hashes[1:]]


def _join(parts: list[bytes]) -> bytes:
    from kvstore import join

    return join(parts)


def test_every_way_a_block_leaves_is_a_removal(tmp_path: Path) -> None:
    ids, hashes, env = prompt(20)
    with Store(tmp_path / "s", events=100, capacity_bytes=5 * SINGLE) as s:
        s.put(env, tokens=ids)
        s.delete(hashes[4])
        ids2, hashes2, env2 = prompt(8, seed=1)
        s.put(env2, tokens=ids2)  # 2 more blocks: evicts the 1 oldest over capacity
        journal = s.begin_restore()
        ids3, hashes3, env3 = prompt(4, seed=2)
        s.import_batch([env3], journal=journal, tokens=[_rows(ids3, hashes3)])
        s.end_restore(journal, keep=False)  # undone: its block leaves again
        assert flat(log_events(s, 1)) == [
            ("BlockRemoved", [hashes[4]], MEDIUM_STORAGE),  # deleted
            ("BlockRemoved", [hashes[0]], MEDIUM_STORAGE),  # evicted to make room
            ("BlockStored", hashes2, MEDIUM_STORAGE),
            ("BlockRemoved", [hashes[1]], MEDIUM_STORAGE),  # evicted by the restore
            ("BlockStored", hashes3, MEDIUM_STORAGE),
            ("BlockRemoved", hashes3, MEDIUM_STORAGE),  # the restore undone
        ]
        assert s.block_tokens([hashes[0], hashes[4], hashes3[0]]) == [None] * 3


def _rows(ids: list[int], hashes: list[int]) -> BlockTokens:
    from kvstore.codec.tokens import chain_tokens

    return chain_tokens(ids, hashes, SMALL.block_tokens)


def test_a_quarantined_block_is_removed(tmp_path: Path) -> None:
    ids, hashes, env = prompt(8)
    with Store(tmp_path / "s", events=100) as s:
        s.put(env, tokens=ids)
        stored = s.get(hashes[1])
        assert stored is not None
    payload = stored[60:76]  # KV bytes of block 1, found in the data file and flipped
    data = (tmp_path / "s" / "data.mdb").read_bytes()
    at = data.index(payload)
    with open(tmp_path / "s" / "data.mdb", "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    with Store(tmp_path / "s") as s:
        assert s.get(hashes[1]) is None
        assert flat(log_events(s, 1)) == [("BlockRemoved", [hashes[1]], MEDIUM_STORAGE)]


def test_models_log_under_their_own_id(tmp_path: Path) -> None:
    ids, hashes, env = prompt(8)
    with Store(tmp_path / "s", events=100, capacity_bytes=3 * SINGLE) as s:
        s.model("llama/one").put(env, tokens=ids)
        ids2, hashes2, env2 = prompt(8, seed=3)
        s.model("two").put(env2, tokens=ids2)  # evicts one block of "llama/one"
        batches = log_events(s)
        assert [(m, flat([(q, m, e)])) for q, m, e in batches] == [
            ("llama/one", [("BlockStored", hashes, MEDIUM_STORAGE)]),
            ("llama/one", [("BlockRemoved", [hashes[0]], MEDIUM_STORAGE)]),  # room made first
            ("two", [("BlockStored", hashes2, MEDIUM_STORAGE)]),
        ]
        assert [q for q, _, _ in batches] == [0, 1, 2]


def test_a_deleted_model_is_one_cleared_event_under_its_id(tmp_path: Path) -> None:
    ids, hashes, env = prompt(8)
    with Store(tmp_path / "s", events=100) as s:
        s.model("m").put(env, tokens=ids)
        assert s.delete_model("m") is not None
        # one event, under the id the model had (the deletion frees its number and name)
        assert log_events(s, 1) == [(1, "m", [{"type": "AllBlocksCleared"}])]
        s.model("n").put(env, tokens=ids)  # takes the freed number: logs under its own id
        [(seq, model, events)] = log_events(s, 2)
        assert (seq, model) == (2, "n") and _stored(events) == [(hashes, None, ids)]


def test_the_log_is_bounded_and_its_numbers_never_go_back(tmp_path: Path) -> None:
    with Store(tmp_path / "s", events=3) as s:
        for seed in range(5):
            ids, _, env = prompt(4, seed=seed)
            s.put(env, tokens=ids)
        assert s.events_bounds() == (2, 5, 3)
        assert [q for q, _, _ in log_events(s)] == [2, 3, 4]
        s.set_events(0)  # off: emptied, nothing logged, the numbers stay
        ids, _, env = prompt(4, seed=9)
        s.put(env, tokens=ids)
        assert s.events_bounds() == (5, 5, 0)
    with Store(tmp_path / "s", events=DEFAULT_EVENTS_LIMIT) as s:
        ids, _, env = prompt(4, seed=10)
        s.put(env, tokens=ids)
        assert [q for q, _, _ in log_events(s)] == [5]


def _writer(path: str, seed: int, n: int) -> None:
    with Store(path) as s:
        for i in range(n):
            ids, _, env = prompt(8, seed=1000 * seed + i)
            s.put(env, tokens=ids)


def test_processes_writing_one_store_write_one_stream(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    Store(path, events=1000).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, seed, 15)) for seed in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with Store(path) as s:
        batches = log_events(s)
        assert [q for q, _, _ in batches] == list(range(45))
        announced = [h for _, _, ev in batches for st in _stored(ev) for h in st[0]]
        assert len(announced) == len(set(announced)) == 90


def test_a_block_evicted_while_the_tier_holds_it_is_announced_there(tmp_path: Path) -> None:
    tier = f"file://{tmp_path / 'tier'}"
    ids, hashes, env = prompt(12)
    with Store(tmp_path / "s", events=100, capacity_bytes=4 * SINGLE, tier=tier) as s:
        s.put(env, tokens=ids)
        assert s.wait_uploaded(30)
        ids2, hashes2, env2 = prompt(8, seed=5)
        s.put(env2, tokens=ids2)  # evicts the prompt's first block (uploaded)
        assert flat(log_events(s, 1)) == [
            ("BlockRemoved", [hashes[0]], MEDIUM_STORAGE),
            ("BlockStored", hashes2, MEDIUM_STORAGE),
            ("BlockStored", [hashes[0]], MEDIUM_TIER),
        ]
        assert s.block_tokens([hashes[0]]) == [None]  # not on this node's disk
    with Store(tmp_path / "s", tier=tier) as s:
        assert s.read_through(hashes) == 3  # back from the tier: announced here again
        [(_, _, events)] = log_events(s, 2)
        assert _stored(events) == [([hashes[0]], None, ids[:4])]
        assert events[0]["medium"] == MEDIUM_STORAGE
