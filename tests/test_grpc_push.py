"""api.grpc_push: one PushKv stream's commit over a real store. The store takes the
envelopes the chunks' checks decoded (not decoding them again) and still applies the rules
decoding would not: the CRC as it copies the bytes, and the finite rule."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import SMALL, make_envelope

from api.grpc_push import PushCommit
from kvstore import Envelope, Store, crc32c, decode, join, split
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE, TRAILER
from kvstore.errors import ChecksumError, FormatError
from kvstore.transfer import WireChunk


def chunk(payload: bytes | bytearray, sequence: str = "", *, empty: bool = False) -> WireChunk:
    """The chunk carrying ``payload`` (or referencing its block, ``empty``)."""
    env = decode(payload)
    fields = (env[0].hash, env[0].n_tokens, env.version)
    if empty:
        return WireChunk(*fields, sequence=sequence)
    crc = crc32c(payload)  # a bytearray's later changes show through the view
    return WireChunk(*fields, payload=memoryview(payload), crc32c=crc, sequence=sequence)


def checked(store: Store, chunks: Sequence[WireChunk]) -> PushCommit:
    """A stream whose chunks passed every rule, ready to commit (as the servicer runs it)."""
    push = PushCommit(store, (1, 2), max_stream=1 << 30)
    results = [push.check(push.note(c), c) for c in chunks]
    push.take(results, chunks)
    return push


def test_blocks_and_sequences_commit_the_checked_envelopes(tmp_path: Path) -> None:
    parts = split(make_envelope(SMALL, 3 * SMALL.block_tokens + 2, seed=50))
    with Store(tmp_path / "s") as s:
        push = checked(s, [chunk(p) for p in parts])
        assert all(isinstance(e, Envelope) and len(e) == 1 for _, e, _ in push.stream.entries)
        reply = push.commit()
        assert (reply.blocks, reply.stored, reply.duplicate) == (4, 3, 0)
        assert [s.get(decode(p)[0].hash) for p in parts[:3]] == parts[:3]
        # one block sent with its payload: its envelope is the sequence
        checked(s, [chunk(parts[3], "tail")]).commit()
        assert s.get_sequence("tail") == parts[3]
        # sent, referenced (stored) and the tail: joined into one envelope
        chunks = [chunk(parts[0], "s"), chunk(parts[1], empty=True), chunk(parts[3])]
        reply = checked(s, chunks).commit()
        assert s.get_sequence("s") == join([parts[0], parts[1], parts[3]])
        assert (reply.referenced, reply.stored, reply.duplicate) == (1, 0, 1)


@pytest.mark.parametrize("sequence", ["", "s"])
def test_a_payload_altered_after_its_check_stores_nothing(tmp_path: Path, sequence: str) -> None:
    """The store's CRC check while copying is what refuses bytes that changed between the
    chunk's check and the commit."""
    parts = [bytearray(p) for p in split(make_envelope(SMALL, 2 * SMALL.block_tokens, seed=51))]
    with Store(tmp_path / "s") as s:
        push = checked(s, [chunk(parts[0], sequence), chunk(parts[1])])
        parts[1][HEADER_SIZE + RECORD_SIZE + 5] ^= 0x10
        with pytest.raises(ChecksumError):
            push.commit()
        assert s.stats()["blocks"] == 0 and s.sequences() == []


@pytest.mark.parametrize("sequence", ["", "s"])
def test_a_nonfinite_block_is_refused_at_commit(tmp_path: Path, sequence: str) -> None:
    """A chunk's check is the codec's reader rules; the finite rule is the store's, applied
    to the decoded envelope it is handed."""
    good, bad = split(make_envelope(SMALL, 2 * SMALL.block_tokens, version=1, seed=52))
    body = bytearray(bad[:-4])
    body[HEADER_SIZE + RECORD_SIZE : HEADER_SIZE + RECORD_SIZE + 2] = struct.pack("<H", 0x7C00)
    bad = bytes(body) + TRAILER.pack(crc32c(bytes(body)))  # +Inf, a valid CRC
    with Store(tmp_path / "s") as s:
        push = checked(s, [chunk(good, sequence), chunk(bad)])
        with pytest.raises(FormatError, match="finite"):
            push.commit()
        assert s.stats()["blocks"] == 0 and s.sequences() == []
    with Store(tmp_path / "t", allow_nonfinite=True) as s:
        checked(s, [chunk(good, sequence), chunk(bad)]).commit()
        assert s.get(decode(bad)[0].hash) == bad
