"""A bytewise CRC-32C in pure Python: the oracle the compiled kernels are checked against,
independent of every kernel and of the ``crc32c`` package."""

from __future__ import annotations


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC_TABLE = _crc_table()


def crc32c_oracle(data: bytes, crc: int = 0) -> int:
    """Bytewise CRC-32C in Python: independent of every compiled kernel and of the package."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
