"""The export envelope's API in one import: its objects, reader rules and writers.

``views`` (``Block``, ``BlockView``, ``Envelope``), ``decoding`` (``decode``,
``check_header``, ``check_finite``: FORMAT.md section 3) and ``encoding`` (``encode``,
``encode_into``, ``split``, ``join``, ``transcode``) own the code; the library, the
service and the tests import them from here.
"""

from __future__ import annotations

from .decoding import check_finite, check_header, decode
from .encoding import encode, encode_into, join, split, transcode
from .views import Block, BlockView, Envelope

__all__ = [
    "Block",
    "BlockView",
    "Envelope",
    "check_finite",
    "check_header",
    "decode",
    "encode",
    "encode_into",
    "join",
    "split",
    "transcode",
]
