"""``ArraySlots``: the plainest ``BlockSlots`` (``kvstore.engines.targets``), one numpy
array of block slots, that ``TargetTests`` loads into and compares byte for byte."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..codec.checksum import crc32c
from ..codec.envelope import BlockView
from ..codec.geometry import Geometry
from ..codec.layout import F16_DTYPE, HEADER_SIZE, RECORD_SIZE, TRAILER, TRAILER_SIZE, VERSION_V1

__all__ = ["ArraySlots"]


class ArraySlots:
    """``n_slots`` block slots of ``geometry`` as one f32 array ``kv[slot][L][2][Hkv][B][D]``
    (zeros until loaded).

    ``fused``: take v1 envelopes through ``scatter_envelopes`` (each envelope's CRC checked
    before its blocks are copied), as an engine's compiled copy does; else only checked
    views through ``scatter``. ``written`` lists the slots written, in order.
    """

    def __init__(self, geometry: Geometry, n_slots: int, *, fused: bool = True) -> None:
        self.geometry = geometry
        self.kv = np.zeros((n_slots, *geometry.kv_shape), np.float32)
        self.fused = fused
        self.written: list[int] = []

    def scatter(self, views: Sequence[BlockView], slot_ids: Sequence[int]) -> int:
        """Copy checked views into the slots (dequantized: f32); returns the payload bytes
        read."""
        for bv, slot in zip(views, slot_ids):
            if bv.geometry != self.geometry or bv.n_tokens != self.geometry.block_tokens:
                raise ValueError(f"block {bv.hash:016x} is not a full block of the slots' geometry")
            self.kv[slot] = bv.to_float32()
            self.written.append(int(slot))
        return sum(len(bv.raw) for bv in views)

    def scatter_envelopes(
        self, envelopes: Sequence[Any], slot_ids: Sequence[int], *, joined: bool = False
    ) -> int | None:
        """Copy v1 envelopes of full blocks into the slots, each envelope's CRC checked
        first; returns how many leading blocks are in place (None unless ``fused``)."""
        if not self.fused:
            return None
        g = self.geometry
        record = g.record_bytes(VERSION_V1)
        done = 0
        for env in envelopes:
            data = memoryview(env).cast("B")
            body = len(data) - TRAILER_SIZE
            if crc32c(data[:body]) != TRAILER.unpack_from(data, body)[0]:
                break
            n = (body - HEADER_SIZE) // record if joined else 1
            for i in range(n):
                at = HEADER_SIZE + i * record + RECORD_SIZE
                kv = np.frombuffer(data, F16_DTYPE, g.elements, at).reshape(g.kv_shape)
                self.kv[slot_ids[done]] = kv
                self.written.append(int(slot_ids[done]))
                done += 1
        return done
