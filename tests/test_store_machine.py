"""The store against a dict model, driven by hypothesis's RuleBasedStateMachine.

Rules: put, get (with transcoding), has, longest_prefix, delete, views, sequences
(put/get/delete/list), reopen, and switching the model (namespace) the other rules use:
each model has a dict of its own, sharing one pool of blocks (the same hashes in every
model), so any leak between models shows. ``StoreModel`` runs without a capacity and predicts
every answer exactly; ``CapacityModel`` adds a capacity, where evictions are the store's
choice: answers are checked against what may have been evicted, pinned blocks and
sequences must always be exact, and the byte bound must hold.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import SMALL, make_blocks
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_store_models import check_models

from kvstore import PutResult, Store, StoreFullError, decode, encode, join, transcode
from kvstore.errors import PinnedError

# A pool of blocks: two chains of full blocks (distinct hashes) and two partial tails,
# each as a single-block envelope in both format versions.
_FULL = make_blocks(SMALL, 6 * SMALL.block_tokens, seed=1) + make_blocks(
    SMALL, 4 * SMALL.block_tokens, seed=2
)
_TAILS = [make_blocks(SMALL, 3, seed=3)[0], make_blocks(SMALL, 1, seed=4)[0]]
POOL = [{v: transcode(encode(SMALL, [b]), v) for v in (1, 2)} for b in _FULL]
TAILS = [{v: transcode(encode(SMALL, [b]), v) for v in (1, 2)} for b in _TAILS]
HASHES = [b.hash for b in _FULL]
SINGLE = SMALL.envelope_bytes(1)

indices = st.lists(st.integers(0, len(POOL) - 1), max_size=5)
versions = st.sampled_from([1, 2])
names = st.sampled_from(["a", "b", "chat-1", "x.y_z"])
MODELS = ["default", "m/1@x", "m:2"]
tails = st.none() | st.integers(0, len(TAILS) - 1)


def _envelope(idx: list[int], version: int, tail: int | None) -> bytes:
    parts = [POOL[i][version] for i in idx]
    if tail is not None:
        parts.append(TAILS[tail][version])
    return join(parts) if parts else encode(SMALL, [], version)


class StoreModel(RuleBasedStateMachine):
    """The store with no capacity: every answer is predicted exactly."""

    capacity: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tlkv-machine-"))
        self.root = Store(self.dir / "s", geometry=SMALL, capacity_bytes=self.capacity, sync=False)
        self.model = "default"
        # (model, sequence) -> full blocks the sequence keeps in its own record (stored in
        # the block space in another version): pinned by it, not referenced.
        self.kept: dict[tuple[str, str], int] = {}
        # per model: hash -> its stored single-block envelope; name -> (envelope, pins)
        self.state: dict[str, tuple[dict[int, bytes], dict[str, tuple[bytes, list[int]]]]] = {
            m: ({}, {}) for m in MODELS
        }

    def teardown(self) -> None:
        self.root.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- the model ---------------------------------------------------------------------

    @property
    def store(self) -> Store:
        return self.root.model(self.model)

    @property
    def blocks(self) -> dict[int, bytes]:
        return self.state[self.model][0]

    @property
    def seqs(self) -> dict[str, tuple[bytes, list[int]]]:
        return self.state[self.model][1]

    def pinned(self, model: str | None = None) -> set[int]:
        seqs = self.state[model or self.model][1]
        return {h for _, refs in seqs.values() for h in refs}

    def sync_evictions(self) -> None:
        """Capacity mode: forget what the store evicted, in any model (never a pinned block)."""
        if self.capacity is None:
            return
        for model, (blocks, _) in self.state.items():
            hashes = list(blocks)
            for h, present in zip(hashes, self.root.model(model).has(hashes)):
                if not present:
                    assert h not in self.pinned(model), f"pinned block {h:016x} was evicted"
                    del blocks[h]

    def learn(self, hashes: list[int], candidates: dict[int, bytes]) -> None:
        """Capacity mode: after a put, the stored bytes are the old model's or the new."""
        got = self.store.get_many(hashes)
        for h, data in zip(hashes, got):
            if data is None:
                self.blocks.pop(h, None)
                continue
            assert data in (self.blocks.get(h), candidates[h])
            self.blocks[h] = data

    # --- rules ---------------------------------------------------------------------------

    @rule(idx=indices, version=versions, tail=tails)
    def put(self, idx: list[int], version: int, tail: int | None) -> None:
        envelope = _envelope(idx, version, tail)
        self.sync_evictions()
        try:
            result = self.store.put(envelope)
        except StoreFullError:
            assert self.capacity is not None
            return
        seen: set[int] = set()
        stored = 0
        for i in idx:
            h = HASHES[i]
            if h not in seen and h not in self.blocks:
                stored += 1
            seen.add(h)
        if self.capacity is None:
            assert result == PutResult(stored, len(idx) - stored, int(tail is not None))
            for i in idx:
                self.blocks.setdefault(HASHES[i], POOL[i][version])
        else:
            assert sum(result) == len(idx) + (tail is not None)
            assert result.partial == (tail is not None)
            self.learn([HASHES[i] for i in idx], {HASHES[i]: POOL[i][version] for i in idx})
            assert all(HASHES[i] in self.blocks for i in idx)

    @rule(i=st.integers(0, len(POOL) - 1), version=st.none() | versions)
    def get(self, i: int, version: int | None) -> None:
        h = HASHES[i]
        self.sync_evictions()
        got = self.store.get(h, version=version)
        expected = self.blocks.get(h)
        if expected is not None and version is not None and decode(expected).version != version:
            expected = transcode(expected, version)
        assert got == expected

    @rule(idx=st.lists(st.integers(0, len(POOL) - 1), max_size=8), noise=st.booleans())
    def lookups(self, idx: list[int], noise: bool) -> None:
        hashes = [HASHES[i] for i in idx] + ([12345] if noise else [])
        self.sync_evictions()
        expected = [h in self.blocks for h in hashes]
        assert self.store.has(hashes) == expected
        assert self.store.has(np.array(hashes, dtype=np.uint64)) == expected
        prefix = expected.index(False) if False in expected else len(expected)
        assert self.store.longest_prefix(hashes) == prefix

    @rule(i=st.integers(0, len(POOL) - 1))
    def delete(self, i: int) -> None:
        h = HASHES[i]
        self.sync_evictions()
        if h in self.pinned():
            with pytest.raises(PinnedError):
                self.store.delete(h)
            return
        assert self.store.delete(h) == (h in self.blocks)
        self.blocks.pop(h, None)

    @rule(i=st.integers(0, len(POOL) - 1))
    def view(self, i: int) -> None:
        h = HASHES[i]
        self.sync_evictions()
        with self.store.reader() as r:
            bv = r.view(h)
            if h not in self.blocks:
                assert bv is None
                return
            expected = decode(self.blocks[h])[0]
            assert bv is not None
            assert bv.version == expected.version
            assert bytes(bv.raw) == bytes(expected.raw)
            assert np.array_equal(bv.kv, expected.kv)

    @rule(name=names, idx=indices, version=versions, tail=tails)
    def put_sequence(self, name: str, idx: list[int], version: int, tail: int | None) -> None:
        envelope = _envelope(idx, version, tail)
        self.sync_evictions()
        if not idx and tail is None:  # a sequence needs a block: refused, nothing changes
            with pytest.raises(ValueError, match="at least one block"):
                self.store.put_sequence(name, envelope)
            return
        try:
            result = self.store.put_sequence(name, envelope)
        except StoreFullError:
            assert self.capacity is not None
            return
        refs: list[int] = []
        first: dict[int, bool] = {}  # hash -> its first occurrence is referenced
        stored = kept = 0
        for i in idx:
            h, own = HASHES[i], POOL[i][version]
            if h in first:
                if first[h]:
                    refs.append(h)
                else:
                    kept += 1
                continue
            if h not in self.blocks:
                stored += 1
                self.blocks[h] = own
            first[h] = self.blocks[h] == own  # else the sequence keeps its own copy
            if first[h]:
                refs.append(h)
            else:
                kept += 1
        self.seqs[name] = (envelope, refs)
        self.kept[(self.model, name)] = kept
        if self.capacity is None:
            assert result == PutResult(stored, len(idx) - stored, int(tail is not None))

    @rule(name=names)
    def get_sequence(self, name: str) -> None:
        expected = self.seqs.get(name)
        assert self.store.get_sequence(name) == (None if expected is None else expected[0])

    @rule(name=names)
    def delete_sequence(self, name: str) -> None:
        assert self.store.delete_sequence(name) == (name in self.seqs)
        self.seqs.pop(name, None)
        self.kept.pop((self.model, name), None)

    @precondition(lambda self: self.seqs or self.blocks)
    @rule()
    def reopen(self) -> None:
        self.root.close()
        self.root = Store(self.dir / "s", capacity_bytes=self.capacity, sync=False)

    @rule(model=st.sampled_from(MODELS))
    def switch_model(self, model: str) -> None:
        self.model = model
        if not self.blocks and not self.seqs:  # not created yet, or emptied: reads nothing
            assert self.store.has(HASHES) == [False] * len(HASHES)

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.sync_evictions()
        for model, (blocks, seqs) in self.state.items():
            store = self.root.model(model)
            stats = store.stats()
            assert stats["sequences"] == len(seqs)
            assert store.sequences() == sorted(seqs)
            kept = sum(n for (m, _), n in self.kept.items() if m == model)
            assert stats["pinned_blocks"] == len(self.pinned(model)) + kept
            if self.capacity is None:
                assert stats["blocks"] == len(blocks)
        if self.capacity is not None:
            assert self.root.total_bytes() <= self.capacity
        check_models(self.root)


class CapacityModel(StoreModel):
    """The same rules under a capacity of six blocks (plus sequence records)."""

    capacity = 6 * SINGLE + 2048


StoreModel.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CapacityModel.TestCase.settings = StoreModel.TestCase.settings

TestStoreModel = StoreModel.TestCase
TestCapacityModel = CapacityModel.TestCase
