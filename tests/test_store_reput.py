"""A re-put: a put whose full blocks the store holds already, in the geometry it sends.

It answers from a read snapshot and writes nothing (no write lock, no fsync): every rule
is still checked (the CRC too), the answer is the one the write path gives, and the
blocks' use is remembered as a read hit's is. A re-put carrying token ids is one too when
every block has its ids kept and is announced already. Anything else (a block missing,
token ids to keep or a block to announce, another geometry) goes through the write
transaction as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from prompts import log_events, prompt
from store_helpers import SINGLE, check_consistency, flip_byte, full_blocks, hashes_of

from kvstore import (
    Block,
    ChecksumError,
    Geometry,
    PutReport,
    ShapeError,
    Store,
    decode,
    encode,
)
from kvstore.codec.tokens import BlockTokens
from kvstore.errors import TokenMismatchError


def _txnid(s: Store) -> int:
    """The id of the store's last committed write transaction."""
    return int(s._h.env.lmdb.env.info()["last_txnid"])


def test_a_reput_answers_as_a_put_does_and_writes_nothing(tmp_path: Path) -> None:
    blocks = full_blocks(SMALL, 3, seed=1)
    a, b, c = (blk.hash for blk in blocks)
    tail = make_envelope(SMALL, 3 * SMALL.block_tokens + 2, seed=2)  # 3 full + a partial
    with Store(tmp_path / "s") as s:
        s.put(encode(SMALL, blocks))
        first = s.put_report(tail)
        full = [h for h in hashes_of(tail) if h]
        assert first == PutReport(stored=full, duplicate=[], partial=1)
        before = _txnid(s)
        assert s.put_report(tail) == PutReport(stored=[], duplicate=full, partial=1)
        again = encode(SMALL, [blocks[2], blocks[0], blocks[2]])  # one hash twice
        assert s.put_report(again) == PutReport(stored=[], duplicate=[c, a, c], partial=0)
        assert _txnid(s) == before  # no write transaction
        assert s.put_report(encode(SMALL, [blocks[1]])) == PutReport([], [b], 0)
        assert _txnid(s) == before
        check_consistency(s)


def test_a_reput_with_a_bad_crc_fails_as_a_first_put_does(tmp_path: Path) -> None:
    data = encode(SMALL, full_blocks(SMALL, 3, seed=3))
    bad = flip_byte(data, len(data) - 100)  # a payload byte: only the CRC rule fails
    with Store(tmp_path / "fresh") as fresh, pytest.raises(ChecksumError) as first:
        fresh.put(bad)
    with Store(tmp_path / "s") as s:
        s.put(data)
        held = [s.get(h) for h in hashes_of(data)]
        before = _txnid(s)
        with pytest.raises(ChecksumError) as again:
            s.put(bad)
        assert str(again.value) == str(first.value)
        assert _txnid(s) == before
        assert [s.get(h) for h in hashes_of(data)] == held
        check_consistency(s)


def test_a_put_with_one_block_missing_writes_it(tmp_path: Path) -> None:
    blocks = full_blocks(SMALL, 3, seed=4)
    with Store(tmp_path / "s") as s:
        s.put(encode(SMALL, blocks[:2]))
        before = _txnid(s)
        report = s.put_report(encode(SMALL, blocks))
        assert report == PutReport([blocks[2].hash], [blocks[0].hash, blocks[1].hash], 0)
        assert _txnid(s) == before + 1
        assert s.has([b.hash for b in blocks]) == [True] * 3
        check_consistency(s)


def test_a_reput_with_token_ids_keeps_them(tmp_path: Path) -> None:
    ids, hashes, env = prompt(22)
    with Store(tmp_path / "s") as s:
        s.put(env)
        assert s.block_tokens(hashes) == [None] * len(hashes)
        before = _txnid(s)
        assert s.put(env, tokens=ids).duplicate == len(hashes)  # the write path
        assert _txnid(s) == before + 1
        kept = s.block_tokens(hashes)
        assert np.concatenate([t for _, t in kept]).tolist() == ids[:20]  # type: ignore[misc]


def test_a_reput_with_token_ids_kept_and_announced_writes_nothing(tmp_path: Path) -> None:
    ids, hashes, env = prompt(22, seed=5)
    with Store(tmp_path / "s", events=64) as s:
        assert s.put(env, tokens=ids).stored == len(hashes)
        bounds, kept = s.events_bounds(), s.block_tokens(hashes)
        assert bounds[1] - bounds[0] == 1  # the put's BlockStored batch
        before = _txnid(s)
        assert s.put_report(env, tokens=ids) == PutReport([], hashes, 0)
        assert _txnid(s) == before  # no write transaction
        assert s.events_bounds() == bounds  # nothing announced again
        again = s.block_tokens(hashes)
        assert [(p, t.tolist()) for p, t in again] == [(p, t.tolist()) for p, t in kept]  # type: ignore[misc]
        with pytest.raises(TokenMismatchError):  # ids are still checked first
            s.put(env, tokens=ids[::-1])
        check_consistency(s)


def test_a_reput_with_token_ids_of_a_waiting_block_takes_the_write_path(tmp_path: Path) -> None:
    """A block whose parent was never announced waits; its re-put is not answered from the
    snapshot (the write transaction decides, and announces nothing either)."""
    ids, hashes, env = prompt(8, seed=6)  # two blocks
    first, second = (decode(env).single(i) for i in range(2))
    row = BlockTokens(np.array([hashes[0]], "<u8"), np.array([ids[4:8]], "<u4"))
    with Store(tmp_path / "s", events=64) as s:
        s.put(second, tokens=row)  # kept, waiting for its parent
        before = _txnid(s)
        assert s.put_report(second, tokens=row) == PutReport([], [hashes[1]], 0)
        assert _txnid(s) == before + 1  # the write path
        assert s.events_bounds()[1] == 0  # and still nothing announced
        s.put(first, tokens=ids[:4])  # announces the parent, then the waiting child
        assert [e["block_hashes"] for _, _, b in log_events(s) for e in b] == [hashes]
        before = _txnid(s)
        assert s.put_report(second, tokens=row) == PutReport([], [hashes[1]], 0)
        assert _txnid(s) == before  # announced now: from the snapshot
        check_consistency(s)


def test_a_reput_in_another_geometry_is_refused(tmp_path: Path) -> None:
    data = encode(SMALL, full_blocks(SMALL, 1, seed=6))
    other = Geometry(SMALL.block_tokens, SMALL.n_layers + 1, SMALL.n_kv_heads, SMALL.head_dim)
    with Store(tmp_path / "s") as s:
        s.put(data)
    blk = full_blocks(other, 1, seed=6)[0]
    (h,) = hashes_of(data)
    with Store(tmp_path / "s") as s, pytest.raises(ShapeError, match="receiving pool"):
        s.put(encode(other, [Block(h, other.block_tokens, blk.kv)]))


def test_a_reput_is_a_use_for_eviction(tmp_path: Path) -> None:
    """The re-put block outlives an older one when room is made, as a read one does."""
    blocks = full_blocks(SMALL, 3, seed=7)
    envs = [encode(SMALL, [b]) for b in blocks]
    with Store(tmp_path / "s", capacity_bytes=2 * SINGLE) as s:
        s.put(envs[0])
        s.put(envs[1])
        before = _txnid(s)
        s.put(envs[0])  # a re-put: block 0 is now the newer use
        assert _txnid(s) == before
        s.put(envs[2])  # evicts the least recently used: block 1
        assert s.has([b.hash for b in blocks]) == [True, False, True]
        check_consistency(s)
