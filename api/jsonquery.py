"""The JSON form of a has-blocks / prefix query, parsed without a Python object per item.

``{"hashes": ["<16 hex>", ...]}`` and ``{"tokens": [<int>, ...]}`` bodies reach 64 MiB
(``--max-body``): ``json.loads`` would build 3-8 million Python objects for one (about
500 MiB of RSS for a 64 MiB body, past the 2 x max-body + 150 MiB a worker is sized for).
This module checks the body against the plain grammar those bodies follow and parses the
items a chunk at a time with numpy into one array: its memory is the body, the array and a
chunk. A body outside that grammar (escapes in the key, exponents, other keys) is left to
``json.loads`` only up to ``JSON_FALLBACK_BYTES``; a larger one is refused, naming the
grammar (large queries can also go as ``application/octet-stream`` u64 hashes). Such a
body holds ``JSON_WEIGHT`` times its size of the in-flight budget (``--max-inflight``), so
what its parse and answer take is bounded like the body itself.
"""

from __future__ import annotations

import re

import numpy as np

from kvstore.codec.hashing import chain_hashes_array
from kvstore.codec.layout import NO_HASH
from kvstore.errors import InvalidRequestError

# A JSON query holds this many times its size of the worker's in-flight budget: the body,
# then its hashes (8 bytes per 19-byte item at most) and the has-blocks answer (6 bytes
# per item) while the body is gone.
JSON_WEIGHT = 2
# A body of at most this many bytes that is not in the plain grammar goes to json.loads.
JSON_FALLBACK_BYTES = 1 << 20
# Items are parsed this many bytes at a time (cut at a comma).
_CHUNK = 1 << 20
_WS = rb"[ \t\n\r]*"
_HEAD = re.compile(rb'%s\{%s"(hashes|tokens)"%s:%s\[' % (_WS, _WS, _WS, _WS))
_TAIL = re.compile(rb"\]%s\}%s" % (_WS, _WS))
_BLANK = re.compile(_WS)
_ITEM = {
    b"tokens": rb"%s(?:0|[1-9][0-9]{0,9})%s" % (_WS, _WS),  # at most 10 digits: < 2^34
    b"hashes": rb'%s"[0-9a-f]{16}"%s' % (_WS, _WS),
}
_ITEMS = {k: re.compile(rb"%s(?:,%s)*" % (v, v)) for k, v in _ITEM.items()}
_NOT_HEX = re.compile(rb"[^0-9a-f]")
_TOKEN_MAX = 0xFFFFFFFF
NO_GEOMETRY = "the store has no geometry yet (no block stored, no --geometry): send hashes"


class NotPlain(Exception):
    """The body is not in the plain grammar (it may still be valid JSON)."""


def parse_plain(body: bytes | bytearray, block_tokens: int | None) -> np.ndarray:
    """The ``<u8`` hashes of a plain JSON query: its ``hashes``, or the chained hashes of
    its ``tokens``' full blocks of ``block_tokens`` (hashed chunk by chunk, so no array of
    the tokens is ever whole).

    Raises:
        NotPlain: the body is not exactly one of the two objects with plain items.
        InvalidRequestError: a token id above 2^32-1, or tokens with no ``block_tokens``.
    """
    head = _HEAD.match(body)
    end = body.rfind(b"]")
    if head is None or end < head.end() or not _TAIL.fullmatch(body, end):
        raise NotPlain()
    key = head.group(1)
    start = head.end()
    n = 0 if _BLANK.fullmatch(body, start, end) else body.count(b",", start, end) + 1
    tokens = key == b"tokens"
    if tokens and block_tokens is None:
        raise InvalidRequestError(NO_GEOMETRY)
    out = np.empty(n // block_tokens if tokens and block_tokens else n, dtype="<u8")
    items, done, pos = _ITEMS[key], 0, start
    carry = np.empty(0, dtype=np.uint32)  # tokens of a block cut by a chunk boundary
    parent = NO_HASH
    while pos < end and n:
        cut = body.find(b",", min(pos + _CHUNK, end), end)
        cut = end if cut < 0 else cut
        chunk = bytes(body[pos:cut])
        pos = cut + 1
        if not items.fullmatch(chunk):
            raise NotPlain()
        if tokens:
            assert block_tokens is not None
            parsed = np.fromstring(chunk, dtype=np.int64, sep=",")  # type: ignore[call-overload]
            if len(parsed) and int(parsed.max()) > _TOKEN_MAX:
                raise InvalidRequestError("tokens: a token id is an integer in 0..2^32-1")
            ids = np.concatenate([carry, parsed.astype(np.uint32)])
            full = len(ids) - len(ids) % block_tokens
            values = chain_hashes_array(ids[:full], block_tokens, parent)
            carry = ids[full:]
            if len(values):
                parent = int(values[-1])
        else:
            values = np.frombuffer(bytes.fromhex(_NOT_HEX.sub(b"", chunk).decode()), ">u8")
        out[done : done + len(values)] = values
        done += len(values)
    return out
