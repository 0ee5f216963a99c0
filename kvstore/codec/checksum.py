"""CRC-32C (Castagnoli) over any buffer, at hardware speed.

The compiled kernel (``kvstore._native``, interleaved SSE4.2 streams) is used when it
was built; otherwise the ``crc32c`` package, which also uses the CPU's CRC instruction.
"""

from __future__ import annotations

from typing import Any

try:
    from . import _native
except ImportError:  # pragma: no cover - only where the build had no compiler
    _native = None  # type: ignore[assignment]

if _native is not None:
    _crc32c = _native.crc32c
else:  # pragma: no cover
    from crc32c import crc32c as _crc32c


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes, bytearray, memoryview, mmap, numpy), continuing ``crc``.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``crc32c(b"123456789") == 0xE3069283``.

    Raises:
        BufferError: ``data`` is not C-contiguous.
    """
    return int(_crc32c(data, crc))
