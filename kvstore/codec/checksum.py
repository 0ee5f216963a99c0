"""CRC-32C (Castagnoli) over any buffer, at hardware speed.

The kernel is chosen once, at import, from the CPU's features; ``KERNEL`` names it
(``tlkv --version`` and ``GET /v1/info`` report it):

- the compiled kernels of ``kvstore.codec._native``, best first: ``vpclmulqdq-avx512``
  (512-bit VPCLMULQDQ folding), ``vpclmulqdq-avx2`` (256-bit VPCLMULQDQ folding beside
  three CRC32-instruction streams), ``sse4.2-pclmul`` (the same with 128-bit PCLMULQDQ),
  all x86-64;
- where the build has only the portable ``slicing-by-8`` tables (another architecture, or
  an x86 CPU without PCLMULQDQ), the ``crc32c`` package when it runs on the CPU's own CRC
  instructions (e.g. ARMv8 CRC32): ``crc32c-package``;
- without the compiled module, the ``crc32c`` package (``crc32c-package`` or, when it has
  no hardware path either, ``crc32c-package-software``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .layout import TRAILER

try:
    from . import _native
except ImportError:  # pragma: no cover - only where the build had no compiler
    _native = None  # type: ignore[assignment]

PORTABLE_KERNEL = "slicing-by-8"


def _choose() -> tuple[Callable[..., int], str]:
    """The fastest CRC-32C available here and its name (see the module docstring)."""
    name = _native.crc32c_kernel() if _native is not None else None
    if name is not None and name != PORTABLE_KERNEL:
        return _native.crc32c, name
    import crc32c as package

    if package.hardware_based:
        return package.crc32c, "crc32c-package"
    if name is not None:
        return _native.crc32c, name
    return package.crc32c, "crc32c-package-software"  # pragma: no cover


_crc32c, KERNEL = _choose()


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes, bytearray, memoryview, mmap, numpy), continuing ``crc``.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``crc32c(b"123456789") == 0xE3069283``.

    Raises:
        BufferError: ``data`` is not C-contiguous.
    """
    return int(_crc32c(data, crc))


def join_crc(parts: Sequence[Any]) -> bytes:
    """``b"".join(parts)`` followed by its CRC-32C as the envelope's ``TRAILER``; parts are
    C-contiguous buffers or strided ones (numpy views, read in C order).

    The compiled kernel copies and checksums each part in one pass (fused with the copy
    where the kernel has a twin, else in cache-sized chunks); elsewhere a CRC pass, then
    one join.
    """
    if _native is not None and _crc32c is _native.crc32c:
        return _native.join_crc(parts)
    # strided parts (numpy views) are read in C order, as the compiled join does
    parts = [p if memoryview(p).c_contiguous else np.ascontiguousarray(p) for p in parts]
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    return b"".join([*parts, TRAILER.pack(crc)])
