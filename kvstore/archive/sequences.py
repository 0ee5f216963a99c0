"""A tlkv archive's sequences (ARCHIVE.md 1.4): the record of a named KV state, its
parsing, and the positions and format version of the blocks it names. Sans-IO, as
``manifest``: values in, checked values or ArchiveError out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from ..codec.layout import NO_HASH
from ..errors import ArchiveError
from ..protocol import hash_hex, is_hash_hex
from .manifest import (
    MAX_SEQUENCE_BYTES,
    SEQUENCE_KEYS,
    SEQUENCE_KEYS_OWN,
    canonical_json,
    is_int_in,
    sequence_member,
    strict_json,
)


@dataclass(frozen=True)
class SequenceRecord:
    """A named KV state: its full blocks' hashes in order, its tail envelope (or None),
    and ``own``: ``(position, single-block envelope)`` of the full blocks it keeps of its
    own (version 4, positions ascending; every other position names a block member)."""

    name: str
    hashes: Sequence[int]
    tail: Any = None
    own: Sequence[tuple[int, Any]] = ()

    def to_json(self) -> bytes:
        """The canonical bytes of ``sequences/<name>.json``."""
        obj: dict[str, Any] = {
            "hashes": [hash_hex(h) for h in self.hashes],
            "name": self.name,
            "tail": self.tail is not None,
        }
        if self.own:
            obj["own"] = [p for p, _ in self.own]
        return canonical_json(obj)


def parse_sequence_json(
    data: Any, name: str, own: bool = False
) -> tuple[list[int], bool, list[int]]:
    """``(hashes, has_tail, own positions)`` of a sequence record named ``name``
    (ARCHIVE.md 1.4; ``own``: the archive is version 4, so a record may have ``own``)."""
    what = sequence_member(name)
    obj = strict_json(data, what, MAX_SEQUENCE_BYTES)
    keys = tuple(sorted(obj))
    if keys != SEQUENCE_KEYS and not (own and keys == SEQUENCE_KEYS_OWN):
        allowed = f"{SEQUENCE_KEYS} or {SEQUENCE_KEYS_OWN}" if own else f"{SEQUENCE_KEYS}"
        raise ArchiveError(f"{what}: keys must be {allowed}, found {sorted(obj)}")
    if obj["name"] != name:
        raise ArchiveError(f"{what}: records the name {obj['name']!r}")
    hashes, tail = obj["hashes"], obj["tail"]
    if not isinstance(tail, bool) or not isinstance(hashes, list):
        raise ArchiveError(f"{what}: hashes must be a list and tail a boolean")
    if not all(map(is_hash_hex, hashes)):
        raise ArchiveError(f"{what}: every hash must be 16 lowercase hex digits")
    values = [int(h, 16) for h in hashes]
    if NO_HASH in values:
        raise ArchiveError(f"{what}: hash 0 (no hash) cannot name a full block")
    if not values and not tail:
        raise ArchiveError(f"{what}: a sequence has at least one block or a tail")
    positions = obj.get("own", [])
    if "own" in obj and not (
        isinstance(positions, list)
        and positions
        and all(is_int_in(p, 0, len(values) - 1) for p in positions)
        and all(a < b for a, b in pairwise(positions))
    ):
        raise ArchiveError(
            f"{what}: own must be a non-empty list of ascending positions of its hashes"
        )
    return values, tail, positions


def referenced(hashes: Sequence[int], own: Sequence[int]) -> Sequence[int] | np.ndarray:
    """The hashes of a sequence's positions other than ``own`` (ascending positions): the
    ones that name block members."""
    if not own:
        return hashes
    keep = np.ones(len(hashes), dtype=bool)
    keep[np.asarray(own, dtype=np.intp)] = False
    return np.asarray(hashes, dtype=np.uint64)[keep]


def find_positions(
    present: np.ndarray, hashes: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, int | None]:
    """Positions of ``hashes`` in the sorted array ``present``, and the first hash that is
    not there (or None)."""
    wanted = np.asarray(hashes, dtype=np.uint64)
    if not len(wanted):
        return np.zeros(0, dtype=np.intp), None
    if not len(present):
        return np.zeros(0, dtype=np.intp), int(wanted[0])
    pos = np.searchsorted(present, wanted)
    pos[pos >= len(present)] = 0
    ok = present[pos] == wanted
    if bool(ok.all()):
        return pos, None
    return pos, int(wanted[int(np.argmin(ok))])


def sequence_version(
    what: str,
    versions: np.ndarray,
    positions: np.ndarray,
    tail_version: int | None,
    own_versions: Sequence[int] = (),
) -> int:
    """The one format version of a sequence's blocks (those at ``positions`` of the
    archive's, and its own) and tail (ARCHIVE.md rule R12)."""
    found = set(np.unique(versions[positions]).tolist()) if len(positions) else set()
    found.update(own_versions)
    if tail_version is not None:
        found.add(tail_version)
    if len(found) != 1:
        raise ArchiveError(f"{what}: blocks and tail mix format versions {sorted(found)}")
    return int(found.pop())
