"""FORMAT.md, the project's specification of the block hash and the envelope, against the
codec: its example bytes (parsed out of the document) byte for byte, its layout tables
against ``kvstore.codec.layout``, and its reader-rule table against the errors ``decode``
raises for an envelope breaking each rule."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore import Block, Geometry, chain_hashes, crc32c, decode, encode, fnv1a64
from kvstore.codec import layout
from kvstore.codec.envelope import check_finite

DOC = (Path(__file__).resolve().parent.parent / "FORMAT.md").read_text(encoding="utf-8")
G = Geometry(2, 1, 1, 2)
KV = np.array([[[[[1, 2], [3, 4]]], [[[0.5, -1], [0, 0.25]]]]], dtype=np.float16)
TAIL_KV = np.array([[[[[5, 0], [0, 0]]], [[[-2, 0], [0, 0]]]]], dtype=np.float16)


def example(name: str) -> list[tuple[bytes, str]]:
    """The lines of FORMAT.md's example ``name``: (bytes, what the line says they are)."""
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```text\n(.*?)```", DOC, re.DOTALL)
    assert found is not None, f"FORMAT.md has no example {name!r}"
    lines = []
    for line in found.group(1).splitlines():
        hex_part, _, comment = line.partition("    ")
        lines.append((bytes.fromhex(hex_part), comment.strip()))
    return lines


def example_bytes(name: str) -> bytes:
    return b"".join(data for data, _ in example(name))


def table(heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table after ``heading``, as cells."""
    start = DOC.index(heading)
    rows = []
    for line in DOC[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
        elif rows:
            break
    return [r for r in rows[1:] if not set(r[0]) <= {"-"}]  # header and separator dropped


def test_hash_example_is_the_chained_fnv1a() -> None:
    lines = example("hash")
    hashes = chain_hashes([1, 2, 3, 4, 5], 2)
    assert len(hashes) == 2  # block 2 (token 5) is partial: no hash
    parent = 0
    for (data, comment), expected in zip(lines, hashes, strict=True):
        assert data[:8] == struct.pack("<Q", parent)  # the parent comes first
        assert fnv1a64(data) == expected
        assert int(comment.rpartition("-> ")[2], 16) == expected
        parent = expected
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # the check value of section 1
    assert crc32c(b"123456789") == 0xE3069283  # and of section 2.2


@pytest.mark.parametrize(
    ("name", "version", "block_hash", "n_tokens", "kv"),
    [
        ("v1", 1, 0xA91AB0C1027B9366, 2, KV),
        ("v2", 2, 0xA91AB0C1027B9366, 2, KV),
        ("v1-partial", 1, 0, 1, TAIL_KV),
    ],
)
def test_worked_examples_are_the_codec_bytes(
    name: str, version: int, block_hash: int, n_tokens: int, kv: np.ndarray
) -> None:
    data = example_bytes(name)
    assert len(data) == 60
    assert encode(G, [Block(block_hash, n_tokens, kv)], version) == data
    env = decode(data, G, versions=(version,))
    assert (env.version, len(env)) == (version, 1)
    assert env.hashes.tolist() == [block_hash] and env.fills.tolist() == [n_tokens]
    (crc,) = struct.unpack("<I", data[-4:])
    assert crc == crc32c(data[:-4])
    assert example(name)[-1][1] == f"crc32c {crc:#010X}".replace("0X", "0x")
    if version == 1:  # positions past the fill are zeros (TAIL_KV holds zeros there)
        np.testing.assert_array_equal(env[0].kv, kv)
    else:  # within E4M3's rounding: 336 -> 320 (K, 3.0 -> 2.857) is the largest error
        np.testing.assert_allclose(env[0].to_float32(), kv.astype(np.float32), rtol=0.05)


def test_header_and_record_tables_are_the_layout() -> None:
    header = table("### 2.1 Header, records, trailer")
    fields = [r for r in header if r[0].isdigit() and int(r[0]) < layout.HEADER_SIZE]
    codes = ["4s", *layout.HEADER.format.lstrip("<")[2:]]  # magic is one 4-byte field
    offset = 0
    for (doc_offset, size, _field, _value), code in zip(fields, codes, strict=True):
        assert (int(doc_offset), int(size)) == (offset, struct.calcsize("<" + code))
        offset += struct.calcsize("<" + code)
    assert offset == layout.HEADER_SIZE == 28
    record = table("Each block record:")
    assert [(int(r[0]), r[1]) for r in record] == [(0, "8"), (8, "4"), (12, "P")]
    assert layout.RECORD_HASH_OFFSET == 0 and layout.RECORD_NTOKENS_OFFSET == 8
    assert layout.RECORD_SIZE == 12 and layout.TRAILER_SIZE == 4
    assert bytes.fromhex(header[0][3].split("(")[1].strip("`)")) == layout.MAGIC


def _with(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``data`` with a field replaced and the CRC recomputed (only that rule breaks)."""
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    struct.pack_into("<I", out, len(out) - 4, crc32c(bytes(out[:-4])))
    return bytes(out)


V1 = example_bytes("v1")
V2 = example_bytes("v2")
NAN_V1 = _with(V1, 40, "<H", 0x7E00)  # K[0][0] = f16 NaN, the CRC right

# Rule number of FORMAT.md section 3 -> a check that breaks exactly that rule.
BREAKERS: dict[str, Callable[[], object]] = {
    "1": lambda: decode(V1[:31]),
    "2": lambda: decode(b"TLKX" + V1[4:]),
    "3": lambda: decode(_with(V1, 4, "<H", 9)),
    "4": lambda: decode(_with(V1, 24, "<I", 0)),
    "5": lambda: decode(V1 + b"\0"),
    "6": lambda: decode(V1[:40] + b"\x01" + V1[41:]),
    "7": lambda: decode(V2, versions=(1,)),
    "8": lambda: decode(_with(V1, 6, "<H", 3)),
    "9": lambda: decode(V1, Geometry(2, 1, 1, 4)),
    "10": lambda: decode(_with(V1, 36, "<I", 3)),
}


def test_reader_rule_table_names_the_error_decode_raises() -> None:
    rows = table("## 3. Reader rules")
    assert [r[0] for r in rows] == list(BREAKERS)
    for number, _rule, error in rows:
        with pytest.raises(Exception) as caught:
            BREAKERS[number]()
        assert type(caught.value).__name__ == error, (number, caught.value)
        assert "rule" in str(caught.value) or number == "1"


def test_rule_11_nonfinite_is_refused_by_check_finite() -> None:
    env = decode(NAN_V1)  # rules 1-10 hold
    with pytest.raises(Exception) as caught:
        check_finite(env)
    assert type(caught.value).__name__ == "FormatError"
    assert "(rule 11, its own, `check_finite`, `FormatError`)" in " ".join(DOC.split())
