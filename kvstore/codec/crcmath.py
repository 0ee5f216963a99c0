"""CRC-32C algebra: combine the CRCs of adjacent pieces without reading their bytes again.

``crc32c(a + b) == shift(len(b))(crc32c(a)) ^ crc32c(b)`` for the standard (pre- and
post-inverted) CRC-32C; ``shift(n)`` multiplies by ``x^(8n)`` modulo the Castagnoli
polynomial (the method of zlib's ``crc32_combine``). The store uses it to check a
multi-block envelope's CRC and derive every single-block envelope's CRC in one pass.
"""

from __future__ import annotations

from functools import lru_cache

# Reflected Castagnoli polynomial (FORMAT.md 2.2: reflected polynomial 0x82F63B78).
_POLY = 0x82F63B78
_X0 = 1 << 31  # the polynomial 1 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x) mod p(x)`` in the reflected representation (``a`` must be non-zero)."""
    m = _X0
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """``x^(2^k) mod p`` for k in 0..31."""
    table = []
    p = _X0 >> 1  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _x8n(nbytes: int) -> int:
    """``x^(8 * nbytes) mod p``."""
    p = _X0
    k = 3  # 8 = 2^3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


class CrcShift:
    """The linear map ``crc -> crc * x^(8n) mod p`` for a fixed ``n``, as four byte tables."""

    __slots__ = ("_t0", "_t1", "_t2", "_t3", "nbytes")

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, found {nbytes}")
        self.nbytes = nbytes
        op = _x8n(nbytes)
        bits = [_multmodp(op, 1 << j) for j in range(32)]
        tables = []
        for k in range(4):
            t = [0] * 256
            for v in range(1, 256):
                low = v & -v
                t[v] = t[v ^ low] ^ bits[8 * k + low.bit_length() - 1]
            tables.append(t)
        self._t0, self._t1, self._t2, self._t3 = tables

    def __call__(self, crc: int) -> int:
        """``crc`` advanced over ``nbytes`` bytes, ready to XOR with the next piece's CRC."""
        return (
            self._t0[crc & 0xFF]
            ^ self._t1[(crc >> 8) & 0xFF]
            ^ self._t2[(crc >> 16) & 0xFF]
            ^ self._t3[crc >> 24]
        )


@lru_cache(maxsize=64)
def crc_shift(nbytes: int) -> CrcShift:
    """The (cached) shift over ``nbytes`` bytes."""
    return CrcShift(nbytes)


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and ``len(b)``."""
    return crc_shift(len2)(crc1) ^ crc2
