"""``api.blockread``: which block reads a fast door takes, and what a block read answers,
over a real store (the doors' own tests check the bytes each one writes)."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL, make_envelope

from api.access import Access, TokenTable
from api.blockread import block_answer, block_etag, may_read_default, plain_block_read
from kvstore import Store, decode
from kvstore.codec.layout import SUPPORTED_VERSIONS, VERSION_V2

H = 0x1234ABCD5678EF01
PATH = f"/v1/blocks/{H:016x}"
STORE: Any = object()  # plain_block_read only asks whether a store is open


@pytest.mark.parametrize(
    ("path", "method", "query", "formats", "store"),
    [
        (PATH + "0", "GET", b"", SUPPORTED_VERSIONS, STORE),  # 17 digits
        (PATH[:-1], "GET", b"", SUPPORTED_VERSIONS, STORE),  # 15 digits
        (PATH.upper(), "GET", b"", SUPPORTED_VERSIONS, STORE),
        (f"/v1/blocks/{H:016X}", "GET", b"", SUPPORTED_VERSIONS, STORE),  # upper-case hex
        (f"/v1/blokks/{H:016x}", "GET", b"", SUPPORTED_VERSIONS, STORE),
        (PATH, "DELETE", b"", SUPPORTED_VERSIONS, STORE),
        (PATH, "GET", b"format=1", SUPPORTED_VERSIONS, STORE),
        (PATH, "GET", b"", (VERSION_V2,), STORE),  # a stored v1 block would be transcoded
        (PATH, "GET", b"", SUPPORTED_VERSIONS, None),  # no store open
    ],
)
def test_a_fast_door_declines_what_it_may_not_answer_as_stored(
    path: str, method: str, query: bytes, formats: tuple[int, ...], store: Any
) -> None:
    assert plain_block_read(path, method, query, formats, store) is None


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_plain_read_gives_its_hash(method: str) -> None:
    assert plain_block_read(PATH, method, b"", SUPPORTED_VERSIONS, STORE) == H
    assert plain_block_read(PATH, "HEAD", b"", SUPPORTED_VERSIONS, STORE, {"GET"}) is None


def test_the_access_rule_is_a_bearer_token_that_may_read_the_default_model() -> None:
    tokens = TokenTable(
        {
            "reader": Access(frozenset({"default"}), frozenset()),
            "other": Access(frozenset({"m1"}), frozenset({"m1"})),
        }
    )
    assert may_read_default(None, None)
    assert may_read_default(tokens, b"Bearer reader")
    for authorization in [None, b"Bearer other", b"Bearer wrong", b"Basic reader"]:
        assert not may_read_default(tokens, authorization), authorization


def test_a_found_block_is_answered_from_its_buffer(tmp_path: Path) -> None:
    data = make_envelope(SMALL, SMALL.block_tokens, seed=3)
    with Store(tmp_path / "s") as store:
        store.put(data)
        h = int(decode(data).hashes[0])
        found = store.get_buffers([h])
        answer = block_answer(h, found)
        assert found == []  # the answer holds the only reference
        assert answer.status == 200
        etag = block_etag(data).encode()
        assert answer.headers == [
            (b"content-type", b"application/vnd.tlkv"),
            (b"content-length", str(len(data)).encode()),
            (b"etag", etag),
        ]
        body = answer.take_body()
        assert answer.body == b"" and bytes(body) == data
        assert [ref() is not None for ref in answer.owners] == [True]
        del body
        gc.collect()
        assert [ref() for ref in answer.owners] == [None]  # released: the snapshot ends

        head = block_answer(h, store.get_buffers([h]), head=True)
        assert (head.status, head.headers, head.body, head.owners) == (
            200,
            answer.headers,
            b"",
            [],
        )
        conditional = [(b"host", b"t"), (b"if-none-match", etag)]
        same = block_answer(h, store.get_buffers([h]), conditional)
        assert (same.status, same.headers, same.body) == (304, [(b"etag", etag)], b"")
        other = [(b"if-none-match", b'"0-0"')]
        assert block_answer(h, store.get_buffers([h]), other).status == 200


def test_a_missing_block_is_the_one_404() -> None:
    answer = block_answer(H, [])
    assert answer.status == 404 and answer.owners == []
    assert json.loads(answer.body) == {
        "error": {"kind": "not_found", "message": f"block {H:016x} not found"}
    }
    assert dict(answer.headers)[b"content-length"] == str(len(answer.body)).encode()
