"""Corruption on disk: a block or sequence record whose bytes changed is quarantined,
never served, and counted.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import SMALL
from store_helpers import (
    SINGLE,
    check_consistency,
    flip_on_disk,
    marked_block,
    marker_bytes,
)

from kvstore import (
    Store,
    encode,
)
from kvstore.errors import PinnedError


def test_a_corrupt_block_on_disk_is_quarantined_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = marked_block(1.0, 11), marked_block(-3.5, 12)
    with Store(tmp_path / "s") as s:
        s.put(encode(SMALL, [good, bad]))
    flip_on_disk(tmp_path / "s", marker_bytes(-3.5), 7)
    with Store(tmp_path / "s") as s, caplog.at_level(logging.WARNING, "tlkv.store"):
        assert s.has([11, 12]) == [True, True]
        assert s.get(12) is None
        assert "000000000000000c" in caplog.text
        stats = s.stats()
        assert (stats["corrupt"], stats["blocks"], stats["bytes"]) == (1, 1, SINGLE)
        assert s.has([11, 12]) == [True, False]
        assert s.get(11) is not None
        check_consistency(s)
    with Store(tmp_path / "s") as s:
        assert s.stats()["corrupt"] == 1  # persisted


def test_corrupt_blocks_found_by_views_and_get_many(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        s.put(encode(SMALL, [marked_block(2.0, 21), marked_block(-7.25, 22)]))
    flip_on_disk(tmp_path / "s", marker_bytes(-7.25), 3)
    with Store(tmp_path / "s") as s:
        with s.reader() as r:
            assert r.view(22) is not None  # unverified: the caller asked for speed
            assert r.view(22, verify=True) is None
            assert r.view(21, verify=True) is not None
        assert s.stats()["corrupt"] == 1  # quarantined when the reader closed
        assert s.get_many([21, 22]) == [s.get(21), None]


def test_a_corrupt_pinned_block_makes_its_sequence_a_miss_until_put_again(tmp_path: Path) -> None:
    blocks = [marked_block(1.5, 31), marked_block(-9.0, 32)]
    sequence = encode(SMALL, blocks)
    with Store(tmp_path / "s") as s:
        s.put_sequence("s", sequence)
    flip_on_disk(tmp_path / "s", marker_bytes(-9.0), 1)
    with Store(tmp_path / "s") as s:
        assert s.get_sequence("s") is None
        stats = s.stats()
        assert (stats["corrupt"], stats["blocks"], stats["pinned_blocks"]) == (1, 1, 1)
        with s.reader() as r:
            assert list(r.iter_sequences()) == []
        s.put(encode(SMALL, blocks[1:]))  # the hash is wanted again: served again
        assert s.get_sequence("s") == sequence
        assert s.stats()["pinned_blocks"] == 2
        with pytest.raises(PinnedError):
            s.delete(32)
        check_consistency(s)


@pytest.mark.parametrize("found_by", ["get_sequence", "put_sequence", "delete_sequence"])
def test_a_corrupt_sequence_record_is_removed_and_pins_recounted(
    tmp_path: Path, found_by: str
) -> None:
    tail = marked_block(6.5, 0, n_tokens=2)
    shared, only = marked_block(0.75, 41), marked_block(2.25, 42)
    with Store(tmp_path / "s") as s:
        s.put_sequence("broken", encode(SMALL, [shared, only, tail]))
        s.put_sequence("fine", encode(SMALL, [shared]))
    flip_on_disk(tmp_path / "s", marker_bytes(6.5), 5, once=False)
    with Store(tmp_path / "s") as s:
        if found_by == "get_sequence":
            assert s.get_sequence("broken") is None
            assert s.sequences() == ["fine"]
        elif found_by == "put_sequence":  # replacing it
            s.put_sequence("broken", encode(SMALL, [shared]))
            assert s.get_sequence("broken") == encode(SMALL, [shared])
        else:
            assert s.delete_sequence("broken") is True
            assert s.sequences() == ["fine"]
        assert s.stats()["corrupt"] == 1
        assert s.get_sequence("fine") == encode(SMALL, [shared])
        assert s.delete(42) is True  # its only pin was in the corrupt record
        with pytest.raises(PinnedError):
            s.delete(41)
        check_consistency(s)
