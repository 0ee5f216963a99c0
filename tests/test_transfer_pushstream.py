"""kvstore.transfer.pushstream: one PushKv stream's rules, as a table of chunk sequences
the receiver accepts or refuses (with the error it names), and the sender's plan checked
by the same rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conftest import SMALL, make_envelope

from kvstore import Geometry, crc32c, decode, split
from kvstore.errors import (
    FormatError,
    InvalidRequestError,
    ShapeError,
    TooLargeError,
    UnsupportedVersionError,
)
from kvstore.transfer import PushStream, WireChunk, plan_push

V1 = split(make_envelope(SMALL, 10, version=1, seed=1))  # two full blocks and a tail
V2 = split(make_envelope(SMALL, 10, version=2, seed=2))
OTHER = split(make_envelope(Geometry(4, 1, 2, 8), 8, seed=3))  # another geometry


def sent(payload: bytes, **override: Any) -> WireChunk:
    """The chunk carrying ``payload``, its fields the payload's own."""
    env = decode(payload)
    fields = {
        "block_hash": env[0].hash,
        "n_tokens": env[0].n_tokens,
        "kv_format": env.version,
        "payload": payload,
        "crc32c": crc32c(payload),
    }
    return WireChunk(**{**fields, **override})


def ref(payload: bytes, **override: Any) -> WireChunk:
    """The chunk referencing the full block of ``payload`` (an empty payload)."""
    env = decode(payload)
    fields = {"block_hash": env[0].hash, "n_tokens": env[0].n_tokens, "kv_format": env.version}
    return WireChunk(**{**fields, **override})


def run(
    chunks: Sequence[WireChunk],
    *,
    formats: Sequence[int] = (1, 2),
    geometry: Geometry | None = SMALL,
    max_bytes: int | None = None,
) -> PushStream:
    """Every rule of the stream, as the server applies them: note and check per chunk,
    then take."""
    stream = PushStream(formats, geometry=geometry, max_bytes=max_bytes)
    checked = [stream.check(stream.note(c), c) for c in chunks]
    stream.take(checked, chunks)
    return stream


# (id, chunks, run's keywords) -> (references, sequence name, sequence format)
ACCEPTED: list[tuple[str, list[WireChunk], dict[str, Any], tuple[int, str | None, int | None]]] = [
    ("one block", [sent(V1[0])], {}, (0, None, None)),
    ("blocks and the tail", [sent(p) for p in V1], {}, (0, None, None)),
    ("a reference", [ref(V1[0])], {}, (1, None, None)),
    ("references, then payloads", [ref(V1[0]), ref(V1[1]), sent(V1[2])], {}, (2, None, None)),
    ("blocks in both formats", [sent(V1[0]), sent(V2[1])], {}, (0, None, None)),
    ("a named sequence", [sent(V1[0], sequence="s-1.x"), sent(V1[1])], {}, (0, "s-1.x", 1)),
    (
        "the name repeated",
        [sent(V1[0], sequence="s"), sent(V1[1], sequence="s")],
        {},
        (0, "s", 1),
    ),
    ("a sequence of references", [ref(V2[0], sequence="s"), ref(V2[1])], {}, (2, "s", 2)),
    (
        "a sequence referencing the other format",
        [sent(V1[0], sequence="s"), ref(V2[1]), sent(V1[2])],
        {},
        (1, "s", 1),
    ),
    (
        "no geometry yet: the first payload's",
        [sent(OTHER[0]), ref(OTHER[1])],
        {"geometry": None},
        (1, None, None),
    ),
    ("exactly the byte limit", [sent(V1[0])], {"max_bytes": len(V1[0])}, (0, None, None)),
    ("the empty stream", [], {}, (0, None, None)),
]


@pytest.mark.parametrize(
    ("chunks", "kwargs", "expected"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
def test_accepted_streams(
    chunks: list[WireChunk], kwargs: dict[str, Any], expected: tuple[int, str | None, int | None]
) -> None:
    stream = run(chunks, **kwargs)
    assert (stream.referenced, stream.name, stream.version) == expected
    assert [(h, p is None, v) for h, p, v in stream.entries] == [
        (c.block_hash, not len(c.payload), c.kv_format) for c in chunks
    ]
    assert stream.payload_bytes == sum(len(c.payload) for c in chunks)


# (id, chunks, run's keywords, error, words of its message)
REFUSED: list[tuple[str, list[WireChunk], dict[str, Any], type[Exception], str]] = [
    (
        "a name after the first chunk",
        [sent(V1[0]), sent(V1[1], sequence="s")],
        {},
        InvalidRequestError,
        "chunk 1: the sequence name is given on the first chunk only",
    ),
    (
        "another name on a later chunk",
        [sent(V1[0], sequence="s"), sent(V1[1], sequence="t")],
        {},
        InvalidRequestError,
        "first chunk only",
    ),
    ("a bad name", [sent(V1[0], sequence="no/slash")], {}, InvalidRequestError, "sequence name"),
    (
        "over the byte limit",
        [sent(V1[0]), sent(V1[1])],
        {"max_bytes": len(V1[0])},
        TooLargeError,
        "limit",
    ),
    (
        "a reference without a format",
        [ref(V1[0], kv_format=0)],
        {},
        InvalidRequestError,
        "kv_format is one of",
    ),
    (
        "a reference in an unread format",
        [ref(V2[0])],
        {"formats": (1,)},
        UnsupportedVersionError,
        "kv_format 2",
    ),
    (
        "a reference with a CRC",
        [ref(V1[0], crc32c=1)],
        {},
        FormatError,
        "of an empty payload must be 0",
    ),
    ("a reference to the tail", [ref(V1[2])], {}, InvalidRequestError, "block_hash 0"),
    (
        "a reference not full",
        [ref(V1[0], n_tokens=3)],
        {},
        InvalidRequestError,
        "referenced block is full",
    ),
    (
        "a payload's CRC",
        [sent(V1[0]), sent(V1[1], crc32c=1)],
        {},
        FormatError,
        "chunk 1 (block",
    ),
    (
        "a payload in an unread format",
        [sent(V2[0])],
        {"formats": (1,)},
        UnsupportedVersionError,
        "chunk 0",
    ),
    ("another geometry than the receiver's", [sent(OTHER[0])], {}, ShapeError, "chunk 0"),
    (
        "two geometries in one stream",
        [sent(V1[0]), sent(OTHER[1])],
        {"geometry": None},
        ShapeError,
        "differs from the stream's",
    ),
    (
        "a sequence in two formats",
        [sent(V1[0], sequence="s"), sent(V2[1])],
        {},
        InvalidRequestError,
        "chunk 1: a sequence is one envelope of one format",
    ),
]


@pytest.mark.parametrize(
    ("chunks", "kwargs", "error", "words"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refused_streams(
    chunks: list[WireChunk], kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as raised:
        run(chunks, **kwargs)
    assert type(raised.value) is error
    assert words in str(raised.value)


# --- the sender's plan: the same rules, before anything travels ----------------------


def fill(env_bytes: bytes, plan: list[tuple[WireChunk, bool]]) -> list[WireChunk]:
    """The plan's chunks as a sender sends them: payloads and their CRCs filled in."""
    parts = split(env_bytes)
    out = []
    for (chunk, reference), part in zip(plan, parts):
        if reference:
            out.append(chunk)
        else:
            out.append(sent(part, sequence=chunk.sequence))
    return out


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("sequence", [None, "seq-1"])
@pytest.mark.parametrize("held_blocks", [(), (0,), (0, 1), (1,)])
def test_a_plan_is_a_stream_the_receiver_accepts(
    version: int, sequence: str | None, held_blocks: tuple[int, ...]
) -> None:
    data = make_envelope(SMALL, 10, version=version, seed=4)
    env = decode(data)
    held = {int(env.hashes[i]) for i in held_blocks} | {0}  # the tail is never referenced
    plan = plan_push(env, held, sequence)
    assert [reference for _, reference in plan] == [i in held_blocks for i in range(3)]
    assert [c.sequence for c, _ in plan] == [sequence or "", "", ""]
    assert all(not len(c.payload) and not c.crc32c for c, _ in plan)
    stream = run(fill(data, plan))
    assert (stream.referenced, stream.name) == (len(held_blocks), sequence)


def test_a_plan_refuses_a_bad_sequence_name_before_sending() -> None:
    env = decode(make_envelope(SMALL, 10))
    with pytest.raises(InvalidRequestError, match="sequence name"):
        plan_push(env, set(), "no/slash")
