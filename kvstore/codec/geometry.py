"""The geometry of a KV block and the sizes it implies (FORMAT.md, section 2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import UnsupportedVersionError
from .layout import (
    F16_SIZE,
    HEADER_SIZE,
    RECORD_SIZE,
    SCALE_SIZE,
    TRAILER_SIZE,
    U32_MAX,
    VERSION_V1,
    VERSION_V2,
)


@dataclass(frozen=True)
class Geometry:
    """Block geometry: ``B`` token positions, ``L`` layers, ``Hkv`` KV heads, ``D`` head dim."""

    block_tokens: int
    n_layers: int
    n_kv_heads: int
    head_dim: int

    # The field names, in the header's order (FORMAT.md 2.1: offsets 12..24); also the keys
    # of as_dict.
    FIELDS: ClassVar[tuple[str, ...]] = ("block_tokens", "n_layers", "n_kv_heads", "head_dim")

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Geometry.{name} must be an int, found {type(value).__name__}")
            if not 0 < value <= U32_MAX:
                raise ValueError(f"Geometry.{name} must be in 1..{U32_MAX}, found {value}")

    @classmethod
    def parse(cls, text: str) -> Geometry:
        """Geometry from ``"B,L,H,D"`` (the CLI and settings form)."""
        parts = text.replace(" ", "").split(",")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"geometry must be B,L,H,D (four positive integers), found {text!r}")
        return cls(*(int(p) for p in parts))

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Geometry:
        """Geometry from a mapping with exactly the keys of :attr:`FIELDS`.

        Raises:
            ValueError: a key is missing or extra, or a value is out of range.
            TypeError: a value is not an int.
        """
        if set(fields) != set(cls.FIELDS):
            raise ValueError(
                f"geometry must have the keys {sorted(cls.FIELDS)}, found {sorted(fields)}"
            )
        return cls(*(fields[name] for name in cls.FIELDS))

    def as_dict(self) -> dict[str, int]:
        """The fields by name (the JSON form of the service, the CLI and archive manifests)."""
        return dict(zip(self.FIELDS, self.as_tuple()))

    def as_tuple(self) -> tuple[int, int, int, int]:
        """``(block_tokens, n_layers, n_kv_heads, head_dim)``."""
        return (self.block_tokens, self.n_layers, self.n_kv_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block's KV: ``[L][2][Hkv][B][D]``."""
        return (self.n_layers, 2, self.n_kv_heads, self.block_tokens, self.head_dim)

    @property
    def n_slabs(self) -> int:
        """Number of (layer, K/V, head) slabs: ``L * 2 * Hkv``."""
        return self.n_layers * 2 * self.n_kv_heads

    @property
    def elements(self) -> int:
        """Elements of one block's KV: ``L * 2 * Hkv * B * D``."""
        return self.n_slabs * self.block_tokens * self.head_dim

    def payload_bytes(self, version: int = VERSION_V1) -> int:
        """P: payload bytes of one block record in format ``version``."""
        if version == VERSION_V1:
            return self.elements * F16_SIZE
        if version == VERSION_V2:
            return self.elements + self.n_slabs * SCALE_SIZE
        raise UnsupportedVersionError(f"format version must be 1 or 2, found {version}")

    def record_bytes(self, version: int = VERSION_V1) -> int:
        """Bytes of one block record: ``12 + P``."""
        return RECORD_SIZE + self.payload_bytes(version)

    def envelope_bytes(self, n_blocks: int, version: int = VERSION_V1) -> int:
        """Envelope size ``28 + n * (12 + P) + 4`` (tl_kv_export_bytes)."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, found {n_blocks}")
        return HEADER_SIZE + n_blocks * self.record_bytes(version) + TRAILER_SIZE
