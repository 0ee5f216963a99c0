"""The store's sequences: byte-identical round trips, blocks pinned and shared with the
block space, and the rules of their names and blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL, make_blocks, make_envelope
from store_helpers import (
    check_consistency,
    full_blocks,
    hashes_of,
)

from kvstore import (
    FormatError,
    PutResult,
    Store,
    StoreError,
    encode,
    transcode,
)
from kvstore.errors import PinnedError
from kvstore.store.debug import lmdb_flags

# --- sequences ------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [3, 8, 10, 29])  # 0 tokens: refused (no block)
@pytest.mark.parametrize("version", [1, 2])
def test_sequence_round_trip_is_byte_identical(tmp_path: Path, n_tokens: int, version: int) -> None:
    envelope = make_envelope(SMALL, n_tokens, version=version, seed=n_tokens)
    with Store(tmp_path / "s") as s:
        s.put_sequence("chat-1", envelope)
        assert s.get_sequence("chat-1") == envelope
    with Store(tmp_path / "s") as s:
        assert s.get_sequence("chat-1") == envelope
        check_consistency(s)


def test_sequences_pin_their_blocks(store: Store) -> None:
    first = make_envelope(SMALL, 10, seed=25)
    h0, h1, _ = hashes_of(first)
    assert store.put_sequence("s", first) == PutResult(2, 0, 1)
    assert store.stats()["pinned_blocks"] == 2
    with pytest.raises(PinnedError) as info:
        store.delete(h0)
    assert info.value.http_status == 409
    second = encode(SMALL, full_blocks(SMALL, 1, seed=26))
    assert store.put_sequence("s", second) == PutResult(1, 0, 0)  # replaces: old pins go
    assert store.delete(h0) is True
    assert store.put_sequence("t", second) == PutResult(0, 1, 0)
    assert store.stats()["pinned_blocks"] == 1
    assert store.delete_sequence("s") is True
    assert store.delete_sequence("s") is False
    assert store.stats()["pinned_blocks"] == 1  # "t" still pins it
    store.delete_sequence("t")
    (h,) = hashes_of(second)
    assert store.delete(h) and store.delete(h1)
    assert store.stats() | {"hits": 0, "misses": 0} == {
        "blocks": 0,
        "bytes": 0,
        "capacity_bytes": None,
        "pinned_blocks": 0,
        "sequences": 0,
        "hits": 0,
        "misses": 0,
        "evictions": 0,
        "corrupt": 0,
    }
    check_consistency(store)


def test_sequence_blocks_are_deduplicated_with_the_block_space(store: Store) -> None:
    envelope = make_envelope(SMALL, 12, seed=27)
    store.put(envelope)
    assert store.put_sequence("s", envelope) == PutResult(0, 3, 0)
    assert store.stats()["blocks"] == 3
    assert store.get_sequence("s") == envelope


def test_sequence_over_blocks_stored_in_another_version_stays_identical(store: Store) -> None:
    envelope = make_envelope(SMALL, 10, seed=28)
    store.put(transcode(envelope, 2))  # the block space holds the v2 copies
    store.put_sequence("s", envelope)
    assert store.get_sequence("s") == envelope
    with store.reader() as r:
        assert next(r.iter_sequence_records())[1] is None  # not describable by reference
    check_consistency(store)


def test_a_hash_repeated_inside_a_sequence(store: Store) -> None:
    a, b = full_blocks(SMALL, 2, seed=29)
    envelope = encode(SMALL, [a, b, a])
    store.put_sequence("s", envelope)
    assert store.get_sequence("s") == envelope
    check_consistency(store)


def test_a_partial_block_must_be_the_last(store: Store) -> None:
    blocks = make_blocks(SMALL, 6, seed=30)  # full, partial
    with pytest.raises(FormatError, match="last block"):
        store.put_sequence("s", encode(SMALL, [blocks[1], blocks[0]]))
    assert store.sequences() == []


def test_a_sequence_needs_a_block(store: Store) -> None:
    with pytest.raises(ValueError, match="at least one block"):
        store.put_sequence("empty", encode(SMALL, []))
    assert store.sequences() == [] and store.stats()["bytes"] == 0


def test_a_store_path_that_is_a_file_is_a_store_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"not a store")
    with pytest.raises(StoreError):
        Store(f)


@pytest.mark.parametrize("sync", [True, False])
def test_sync_reaches_lmdb(tmp_path: Path, sync: bool) -> None:
    """sync=True must make LMDB fsync data and meta on every commit (no NOSYNC flags)."""
    with Store(tmp_path / "s", sync=sync) as s:
        flags = lmdb_flags(s)
        assert (flags["sync"], flags["metasync"]) == (sync, sync)


@pytest.mark.parametrize("name", ["", "a" * 129, "a/b", "..\\x", "ünï", "a b", None, 5, "name\n"])
def test_bad_sequence_names(store: Store, name: object) -> None:
    with pytest.raises(ValueError):
        store.put_sequence(name, make_envelope())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.get_sequence(name)  # type: ignore[arg-type]


def test_sequence_names_and_listing(store: Store) -> None:
    for name in ["z", "A.b_c-1", "a" * 128, "0"]:
        store.put_sequence(name, make_envelope(SMALL, 2))
    assert store.sequences() == sorted(["z", "A.b_c-1", "a" * 128, "0"])
    assert store.get_sequence("missing") is None
