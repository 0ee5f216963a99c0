"""The envelope's objects: ``Block`` (what ``encode`` takes), and the zero-copy views a
decoded envelope gives, ``Envelope`` (the whole, its hashes and fills as strided arrays)
and ``BlockView`` (one record: hash, fill, payload as numpy views).

Spec: FORMAT.md, section 2 (layout). Nothing here validates: ``decoding.decode`` builds an
``Envelope`` only over bytes that passed every reader rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .assembly import from_records
from .geometry import Geometry
from .layout import (
    F16_DTYPE,
    HEADER_SIZE,
    RECORD,
    RECORD_HASH_DTYPE,
    RECORD_HASH_OFFSET,
    RECORD_NTOKENS_DTYPE,
    RECORD_NTOKENS_OFFSET,
    RECORD_SIZE,
    SCALE_DTYPE,
    VERSION_V1,
    VERSION_V2,
)
from .numerics import dequantize_e4m3

__all__ = ["Block", "BlockView", "Envelope"]


@dataclass(frozen=True)
class Block:
    """One block to encode: its chained hash (0 for a partial block), fill and KV.

    ``kv`` is a float array (f16, bf16, f32 or f64; any strides; a numpy array, a CPU torch
    tensor or anything with ``__array__``) of shape ``[L][2][Hkv][B][D]`` (axis 1: 0 = K,
    1 = V); only positions ``< n_tokens`` are read. It may also be a lazy window with a
    ``payload_parts(version)`` method returning the v1 payload as buffers in order, or
    None (``kvstore.kvlayout.LayerSlices``): ``encode`` then joins those, checked.
    """

    hash: int
    n_tokens: int
    kv: Any


class BlockView:
    """A read-only view of one block record inside a decoded envelope (no copy).

    ``kv`` is the f16 array ``[L][2][Hkv][B][D]`` (v1) or the uint8 E4M3 codes (v2);
    ``scales`` the f32 ``[L][2][Hkv]`` scales (v2 only). ``raw`` is the whole record.
    When ``alive`` is given (the store's readers), every access checks it first and
    raises once the memory behind the view may no longer be valid.
    """

    __slots__ = ("_alive", "_geometry", "_payload", "_version", "hash", "n_tokens", "raw_record")

    def __init__(
        self,
        record: memoryview,
        geometry: Geometry,
        version: int,
        alive: Callable[[], None] | None = None,
    ) -> None:
        self.raw_record = record
        self.hash, self.n_tokens = RECORD.unpack_from(record, 0)
        self._payload = record[RECORD_SIZE:]
        self._geometry = geometry
        self._version = version
        self._alive = alive

    def _check(self) -> None:
        if self._alive is not None:
            self._alive()

    @property
    def version(self) -> int:
        """Format version of the payload (1 = f16, 2 = E4M3 + scales)."""
        return self._version

    @property
    def geometry(self) -> Geometry:
        """Geometry of the block."""
        return self._geometry

    @property
    def raw(self) -> memoryview:
        """The whole block record (hash, n_tokens, payload) as a memoryview."""
        self._check()
        return self.raw_record

    @property
    def kv(self) -> np.ndarray:
        """Read-only payload view: f16 (v1) or uint8 codes (v2), ``[L][2][Hkv][B][D]``."""
        self._check()
        g = self._geometry
        dtype = F16_DTYPE if self._version == VERSION_V1 else np.uint8
        arr = np.frombuffer(self._payload, dtype=dtype, count=g.elements).reshape(g.kv_shape)
        arr.flags.writeable = False
        return arr

    @property
    def scales(self) -> np.ndarray | None:
        """v2: read-only f32 scales ``[L][2][Hkv]``; v1: None."""
        self._check()
        if self._version != VERSION_V2:
            return None
        g = self._geometry
        arr = np.frombuffer(self._payload, dtype=SCALE_DTYPE, count=g.n_slabs, offset=g.elements)
        arr = arr.reshape(g.n_layers, 2, g.n_kv_heads)
        arr.flags.writeable = False
        return arr

    @property
    def k(self) -> np.ndarray:
        """Keys: ``kv[:, 0]``, shape ``[L][Hkv][B][D]``."""
        return self.kv[:, 0]

    @property
    def v(self) -> np.ndarray:
        """Values: ``kv[:, 1]``, shape ``[L][Hkv][B][D]``."""
        return self.kv[:, 1]

    def to_float32(self) -> np.ndarray:
        """The block's values in f32 (v2: ``e4m3_to_f32(byte) * scale``), a new array."""
        kv = self.kv
        if self._version == VERSION_V1:
            return kv.astype(np.float32)
        scales = self.scales
        assert scales is not None
        return dequantize_e4m3(kv, scales)

    def __repr__(self) -> str:
        return (
            f"BlockView(hash={self.hash:016x}, n_tokens={self.n_tokens}, version={self._version})"
        )


class Envelope(Sequence[BlockView]):
    """A decoded, validated envelope over the caller's buffer; indexing gives ``BlockView``s."""

    def __init__(
        self,
        data: memoryview,
        version: int,
        geometry: Geometry,
        n_blocks: int,
        alive: Callable[[], None] | None = None,
    ) -> None:
        self.data = data
        self.version = version
        self.geometry = geometry
        self.record_bytes = geometry.record_bytes(version)
        self._n = n_blocks
        self._alive = alive

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(f"block index {index} out of range for {self._n} blocks")
        return BlockView(self.record(index), self.geometry, self.version, self._alive)

    def __iter__(self) -> Iterator[BlockView]:
        for i in range(self._n):
            yield self[i]

    def record(self, index: int) -> memoryview:
        """Memoryview of block record ``index`` (hash, n_tokens, payload)."""
        start = HEADER_SIZE + index * self.record_bytes
        return self.data[start : start + self.record_bytes]

    def single(self, index: int) -> bytes:
        """Block ``index`` as a single-block envelope (its own header and CRC)."""
        return from_records(self.version, self.geometry, [self.record(index)])

    def _field(self, dtype: str, offset: int) -> np.ndarray:
        field: np.ndarray = np.ndarray(
            shape=(self._n,),
            dtype=dtype,
            buffer=self.data,
            offset=HEADER_SIZE + offset,
            strides=(self.record_bytes,),
        )
        return field

    @property
    def hashes(self) -> np.ndarray:
        """Every block's hash as a strided ``<u8`` view (no copy)."""
        return self._field(RECORD_HASH_DTYPE, RECORD_HASH_OFFSET)

    @property
    def fills(self) -> np.ndarray:
        """Every block's n_tokens as a strided ``<u4`` view (no copy)."""
        return self._field(RECORD_NTOKENS_DTYPE, RECORD_NTOKENS_OFFSET)

    def __repr__(self) -> str:
        return f"Envelope(version={self.version}, geometry={self.geometry}, n_blocks={self._n})"
