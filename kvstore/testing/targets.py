"""The engine target contract as a class of tests, ``TargetTests``: what the transformers
bridge, the vLLM connector and the SGLang backend rely on from a
``kvstore.engines.Target``.

A backend subclasses it in a pytest module and gives a ``target`` fixture: a ``Target``
on an empty namespace, fresh for each test. A backend that can damage a held block's
payload out of band also gives ``corrupt`` (a callable taking the target and a hash); the
cases that need it are skipped otherwise.

The contract: an empty namespace holds nothing and has no geometry; ``put`` stores every
block, counts the new ones, refuses a bad envelope or another geometry with the codec's
typed errors and changes nothing then; ``has`` and ``longest_prefix`` answer per hash;
``views`` gives the blocks put, byte for byte, up to the first one missing or corrupt;
``views_for_tokens`` the same by token ids; ``load`` copies the same prefix into block
slots (``ArraySlots``, with and without the fused envelope copy) and reports how many
blocks and payload bytes it placed, leaving every other slot untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from ..codec.envelope import Block, BlockView, decode, encode
from ..codec.geometry import Geometry
from ..engines.targets import Target
from ..errors import EnvelopeError, ShapeError
from ._blocks import random_blocks
from .slots import ArraySlots

__all__ = ["TargetTests"]

ABSENT = 0x0123_4567_89AB_CDEF  # a hash no test puts


class TargetTests:
    """The engine target contract (see the module docstring). ``geometry`` is the
    geometry of the blocks the cases put."""

    geometry = Geometry(block_tokens=4, n_layers=2, n_kv_heads=2, head_dim=8)

    @pytest.fixture
    def target(self) -> Target:
        raise NotImplementedError("a subclass gives a `target` fixture: an empty namespace")

    @pytest.fixture
    def corrupt(self) -> Callable[[Target, int], None] | None:
        """Flip a payload byte of the held block ``hash`` out of band (None: cannot)."""
        return None

    def _blocks(self, n: int = 5, seed: int = 0) -> tuple[list[int], list[int], list[Block]]:
        return random_blocks(self.geometry, n, seed)

    def _put(
        self, target: Target, n: int = 5, seed: int = 0
    ) -> tuple[list[int], list[int], list[Block]]:
        tokens, hashes, blocks = self._blocks(n, seed)
        assert target.put(encode(self.geometry, blocks)) == n
        return tokens, hashes, blocks

    def _same(self, views: Sequence[BlockView], blocks: Sequence[Block]) -> None:
        assert len(views) == len(blocks)
        for bv, block in zip(views, blocks):
            assert (bv.hash, bv.n_tokens) == (block.hash, block.n_tokens)
            assert bv.geometry == self.geometry
            assert bv.kv.tobytes() == np.asarray(block.kv, np.float16).tobytes()

    def test_an_empty_namespace_holds_nothing(self, target: Target) -> None:
        _, hashes, _ = self._blocks()
        assert target.geometry() is None
        assert target.has(hashes) == [False] * len(hashes)
        assert target.has([]) == []
        assert target.longest_prefix(hashes) == 0
        assert target.longest_prefix([]) == 0
        with target.views(hashes) as views:
            assert list(views) == []
        with target.views([]) as views:
            assert list(views) == []
        slots = ArraySlots(self.geometry, 8)
        assert target.load(hashes, slots, range(len(hashes))) == (0, 0)
        assert not slots.written and not slots.kv.any()

    def test_put_counts_new_blocks_and_has_answers_per_hash(self, target: Target) -> None:
        _, hashes, blocks = self._blocks()
        assert target.put(encode(self.geometry, blocks[:3])) == 3
        assert target.put(encode(self.geometry, blocks)) == 2  # blocks 0-2 are held already
        assert target.put(bytearray(encode(self.geometry, blocks))) == 0
        assert target.has([*hashes, ABSENT]) == [True] * len(hashes) + [False]
        assert target.has([ABSENT, hashes[2]]) == [False, True]
        assert target.longest_prefix(hashes) == len(hashes)
        assert target.longest_prefix([*hashes[:2], ABSENT, *hashes[2:]]) == 2
        assert target.longest_prefix([ABSENT, *hashes]) == 0
        held = target.geometry()
        assert held == (self.geometry if target.knows_geometry else None)

    def test_views_are_the_blocks_put_up_to_the_first_missing(self, target: Target) -> None:
        _, hashes, blocks = self._blocks()
        target.put(encode(self.geometry, blocks))
        with target.views(hashes) as views:
            self._same(views, blocks)
        with target.views(hashes[:3]) as views:
            self._same(views, blocks[:3])
        with target.views([*hashes[:2], ABSENT, *hashes[2:]]) as views:
            self._same(views, blocks[:2])
        with target.views(hashes[1:]) as views:  # a prefix need not start at block 0
            self._same(views, blocks[1:])
        with target.views([ABSENT, *hashes]) as views:
            assert list(views) == []

    def test_prepare_then_use(self, target: Target) -> None:
        target.prepare(1 << 20)  # connect, map receive buffers: at start-up
        target.prepare()
        _, hashes, blocks = self._put(target)
        slots = ArraySlots(self.geometry, 8)
        assert target.load(hashes, slots, range(5))[0] == 5
        with target.views(hashes) as views:
            self._same(views, blocks)

    def test_views_for_tokens(self, target: Target) -> None:
        tokens, _, blocks = self._put(target)
        with target.views_for_tokens(tokens) as views:
            self._same(views, blocks)
        with target.views_for_tokens([*tokens, 7, 7]) as views:  # a partial tail: not a block
            self._same(views, blocks)
        b = self.geometry.block_tokens
        with target.views_for_tokens(tokens[: 2 * b + 1]) as views:
            self._same(views, blocks[:2])

    def test_v2_blocks_keep_their_format(self, target: Target) -> None:
        _, hashes, blocks = self._blocks(seed=3)
        envelope = encode(self.geometry, blocks, 2)
        assert target.put(envelope) == len(blocks)
        expected = [bv.to_float32() for bv in decode(envelope)]
        with target.views(hashes) as views:
            assert [bv.version for bv in views] == [2] * len(blocks)
            assert all(np.array_equal(bv.to_float32(), e) for bv, e in zip(views, expected))
        slots = ArraySlots(self.geometry, 8)
        assert target.load(hashes, slots, [7, 6, 5, 4, 3])[0] == len(blocks)
        assert all(np.array_equal(slots.kv[7 - i], e) for i, e in enumerate(expected))

    @pytest.mark.parametrize("fused", [True, False], ids=["fused", "views"])
    def test_load_copies_the_prefix_into_its_slots(self, target: Target, fused: bool) -> None:
        _, hashes, blocks = self._blocks(seed=1)
        target.put(encode(self.geometry, blocks))
        slots = ArraySlots(self.geometry, 16, fused=fused)
        ids = [9, 2, 14, 0, 5]
        record = self.geometry.record_bytes(1)
        assert target.load(hashes, slots, ids) == (5, 5 * record)
        assert slots.written == ids
        for slot, block in zip(ids, blocks):
            assert np.array_equal(slots.kv[slot], np.asarray(block.kv, np.float32))
        untouched = [i for i in range(16) if i not in ids]
        assert not slots.kv[untouched].any()
        partial = ArraySlots(self.geometry, 16, fused=fused)
        assert target.load([*hashes[:2], ABSENT, hashes[3]], partial, ids[:4]) == (2, 2 * record)
        assert partial.written == ids[:2]
        assert not partial.kv[ids[2:]].any()

    def test_a_bad_envelope_is_refused_and_changes_nothing(self, target: Target) -> None:
        _, hashes, blocks = self._blocks()
        envelope = bytearray(encode(self.geometry, blocks))
        envelope[-10] ^= 0x01  # a payload byte: the CRC no longer matches
        with pytest.raises(EnvelopeError):
            target.put(envelope)
        with pytest.raises(EnvelopeError):
            target.put(b"not an envelope")
        assert target.has(hashes) == [False] * len(hashes)
        assert target.geometry() is None

    def test_another_geometry_is_refused(self, target: Target) -> None:
        _, hashes, _ = self._put(target)
        g = self.geometry
        other = Geometry(g.block_tokens, g.n_layers, g.n_kv_heads, g.head_dim * 2)
        _, other_hashes, other_blocks = random_blocks(other, 2, seed=9)
        with pytest.raises(ShapeError):
            target.put(encode(other, other_blocks))
        assert target.has(other_hashes) == [False, False]
        assert target.longest_prefix(hashes) == len(hashes)

    @pytest.mark.parametrize("fused", [True, False], ids=["fused", "views"])
    def test_a_corrupt_block_ends_the_prefix(
        self, target: Target, corrupt: Callable[[Target, int], None] | None, fused: bool
    ) -> None:
        if corrupt is None:
            pytest.skip("this backend cannot damage a held block out of band")
        _, hashes, blocks = self._blocks(seed=2)
        target.put(encode(self.geometry, blocks))
        corrupt(target, hashes[3])
        slots = ArraySlots(self.geometry, 8, fused=fused)
        loaded, _ = target.load(hashes, slots, range(5))
        assert loaded == 3  # blocks 0-2: nothing of block 3 or after is reported loaded
        for i in range(3):
            assert np.array_equal(slots.kv[i], np.asarray(blocks[i].kv, np.float32))
        with target.views(hashes) as views:
            self._same(views, blocks[:3])
        assert target.has(hashes) == [True] * 3 + [False, True]  # block 3 is quarantined
