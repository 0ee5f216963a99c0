"""kvstore.codec.assembly: the one envelope builder, checked against encode/join and the spec."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import SMALL, make_envelope

from kvstore import Geometry, decode, join, split
from kvstore.codec.assembly import (
    EnvelopeStream,
    assemble,
    crc_matches,
    envelope_version,
    holds_record,
    pack_header,
    record_of,
    single_block,
    stored_crc,
)
from kvstore.codec.checksum import crc32c, join_crc_into

SPEC_HEADER = bytes.fromhex("544c4b5601000100010000000200000001000000010000000200000000")[:28]


def test_header_of_the_spec_example() -> None:
    assert pack_header(1, Geometry(2, 1, 1, 2), 1) == SPEC_HEADER


@pytest.mark.parametrize("version", [1, 2])
def test_stream_equals_join(version: int) -> None:
    singles = split(make_envelope(SMALL, 18, version))
    out = EnvelopeStream(version, SMALL, len(singles))
    parts: list[Any] = [out.header]
    for i, s in enumerate(singles):  # both ways of accounting for a record
        parts.append(out.add(record_of(s)) if i % 2 else out.add_checked_single(s))
    parts.append(out.trailer())
    assert b"".join(bytes(p) for p in parts) == join(singles)


@pytest.mark.parametrize("version", [1, 2])
def test_single_block_builds_what_split_gives(version: int) -> None:
    c = single_block(SMALL, version)
    for s in split(make_envelope(SMALL, 10, version)):
        assert c.envelope(record_of(s)) == s
        buf = bytearray(c.single_len)  # how the store stages a block it writes
        assert join_crc_into((c.header1, record_of(s)), buf) == len(s) and bytes(buf) == s
        assert c.record_crc(buf) == crc32c(record_of(s))
        assert envelope_version(s) == version and stored_crc(s) == decode(s).data[-4:].cast("I")[0]


def test_assemble_and_crc_matches() -> None:
    env = make_envelope(SMALL, 9, 1)
    d = decode(env)
    parts = [pack_header(1, SMALL, len(d)), *(d.record(i) for i in range(len(d)))]
    assert assemble(parts) == env and crc_matches(env)
    damaged = bytearray(env)
    damaged[40] ^= 1
    assert not crc_matches(damaged) and not crc_matches(env[:31])


def test_holds_record() -> None:
    v1 = split(make_envelope(SMALL, 4, 1, seed=1))[0]
    v2 = split(make_envelope(SMALL, 4, 2, seed=1))[0]
    other = split(make_envelope(SMALL, 4, 1, seed=2))[0]
    assert holds_record(v1, 1, record_of(v1))
    assert not holds_record(v1, 2, record_of(v1))  # another version
    assert not holds_record(other, 1, record_of(v1))  # other bytes
    assert not holds_record(v2, 1, record_of(v1))  # another length
