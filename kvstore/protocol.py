"""The service protocol's shared facts: media types, headers, name rules and error kinds.

Every rule here is spelled once and used by the HTTP service (``api``), the clients and the
command line, so they cannot disagree: a block hash on the wire is exactly 16 lowercase hex
digits (``0x12``, ``12`` and upper case are refused everywhere), a sequence name is 1-128
characters of ``[A-Za-z0-9._-]``, an error's ``kind`` names its class in
:mod:`kvstore.errors`, and a token file holds the bearer token (whitespace around it
ignored).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from . import errors
from .codec.layout import SUPPORTED_VERSIONS, U64_MAX

ENVELOPE_MEDIA_TYPE = "application/vnd.tlkv"
HASHES_MEDIA_TYPE = "application/octet-stream"  # a has-blocks/prefix body of raw u64 LE hashes
JSON_MEDIA_TYPE = "application/json"  # request bodies of tokens, every error, listings
# /metrics: the Prometheus text exposition format, version 0.0.4.
PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_MEDIA_TYPE = "text/plain"  # the OpenAPI content key of /metrics
PREFIX_HEADER = "x-tlkv-prefix-blocks"  # number of blocks in a /v1/prefix answer
# Token records (``kvstore.codec.tokens``, FORMAT.md 6) after the envelope in a body: a put
# of blocks or of a sequence may send one per full block, in order (the server checks each
# block's hash against them); a block read with ``?tokens=1`` answers its one (or none).
TOKEN_RECORDS_HEADER = "x-tlkv-token-records"
# A block read or a prefix whose client checks the envelope's CRC-32C itself as it arrives
# (end to end: the server's memory, the wire and its own) sends this header with the value
# READER_CHECKS_CRC; the server may then send the stored blocks without checking them first.
READER_CHECKS_HEADER = "x-tlkv-reader-checks"
READER_CHECKS_CRC = "crc32c"

HASH_HEX_DIGITS = 16
HASH_HEX_REGEX = "[0-9a-f]{16}"
HASH_HEX_PATTERN = f"^{HASH_HEX_REGEX}$"
_HASH_HEX = re.compile(HASH_HEX_REGEX)

SEQUENCE_NAME_MAX = 128
SEQUENCE_NAME_REGEX = "[A-Za-z0-9._-]{1,128}"
SEQUENCE_NAME_PATTERN = f"^{SEQUENCE_NAME_REGEX}$"
_SEQUENCE_NAME = re.compile(SEQUENCE_NAME_REGEX)

# A model id names a namespace of the store (its own geometry, blocks and sequences); not
# "." or "..", which as a path segment (the tier's namespace, a URL) would name another.
MODEL_ID_MAX = 200
MODEL_ID_REGEX = r"(?!\.\.?$)[A-Za-z0-9._:@/+-]{1,200}"
MODEL_ID_PATTERN = f"^{MODEL_ID_REGEX}$"
_MODEL_ID = re.compile(MODEL_ID_REGEX)
DEFAULT_MODEL = "default"  # the namespace of every unscoped call (stores before namespaces)
# Models besides the default one a store admits by default (``Store(max_models=)``,
# ``tlkv serve --max-models``), and the most that setting may say.
MAX_MODELS = 200
MAX_MODELS_LIMIT = 1000  # an archive of every model (manifest.MAX_MODELS, 1024) stays possible
MODEL_HEADER = "x-tlkv-model"  # tl.kv.v1 metadata selecting the model


def parse_versions(text: str) -> tuple[int, ...]:
    """Envelope format versions from ``"1"`` or ``"1,2"``: a comma-separated, non-empty
    subset of the versions tlkv reads, returned sorted, each once (``tlkv serve --formats``,
    ``TLKV_FORMATS``, ``tlkv verify --versions``).

    Raises:
        ValueError: an item is not a supported version, or none is given.
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) in SUPPORTED_VERSIONS for t in items):
        raise ValueError(
            "versions are a comma-separated subset of "
            f"{','.join(map(str, SUPPORTED_VERSIONS))}, found {text!r}"
        )
    return tuple(sorted({int(t) for t in items}))


def is_hash_hex(text: Any) -> bool:
    """Whether ``text`` is a block hash in its wire spelling (16 lowercase hex digits)."""
    return isinstance(text, str) and _HASH_HEX.fullmatch(text) is not None


def parse_hash_hex(text: Any) -> int:
    """The block hash spelled by ``text``.

    Raises:
        ValueError: ``text`` is not 16 lowercase hex digits.
    """
    if not is_hash_hex(text):
        raise ValueError(f"a block hash is {HASH_HEX_DIGITS} lowercase hex digits, found {text!r}")
    return int(text, 16)


def hash_hex(block_hash: Any) -> str:
    """The wire spelling of a hash given as an int, a numpy integer or already as hex.

    Raises:
        ValueError: the value is not a u64, or a string is not the wire spelling.
    """
    if isinstance(block_hash, str):
        parse_hash_hex(block_hash)
        return block_hash
    if isinstance(block_hash, bool) or not isinstance(block_hash, (int, np.integer)):
        raise ValueError(f"a block hash is an integer, found {block_hash!r}")
    value = int(block_hash)
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"a block hash must fit u64, found {value}")
    return f"{value:016x}"


def is_sequence_name(name: Any) -> bool:
    """Whether ``name`` is a valid sequence name."""
    return isinstance(name, str) and _SEQUENCE_NAME.fullmatch(name) is not None


def check_sequence_name(name: Any) -> str:
    """``name`` itself, once checked against the sequence-name rule.

    Raises:
        ValueError: it is not 1-128 characters of ``[A-Za-z0-9._-]``.
    """
    if not is_sequence_name(name):
        raise ValueError(
            f"a sequence name is 1-{SEQUENCE_NAME_MAX} characters of [A-Za-z0-9._-], found {name!r}"
        )
    return str(name)


def is_model_id(model: Any) -> bool:
    """Whether ``model`` is a valid model id."""
    return isinstance(model, str) and _MODEL_ID.fullmatch(model) is not None


def check_model_id(model: Any) -> str:
    """``model`` itself, once checked against the model-id rule.

    Raises:
        ValueError: it is not 1-200 characters of ``[A-Za-z0-9._:@/+-]``, or is ``.`` or
            ``..``.
    """
    if not is_model_id(model):
        raise ValueError(
            f"a model id is 1-{MODEL_ID_MAX} characters of [A-Za-z0-9._:@/+-], not '.' or "
            f"'..', found {model!r}"
        )
    return str(model)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped).

    Raises:
        ValueError: the file holds no token.  OSError: it cannot be read.
    """
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"token file {os.fspath(path)!r} is empty")
    return token


def _declared_kinds() -> dict[str, type[errors.TlkvError]]:
    """Every error kind, and the class of ``kvstore.errors`` that declares it in its own
    body (its subclasses answer with it too; a test checks that no two classes declare
    the same kind)."""
    return {
        cls.__dict__["kind"]: cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.TlkvError) and "kind" in cls.__dict__
    }


# The error classes by the ``kind`` of the JSON error shape (and of tl.kv.v1's trailing
# metadata): what a server answers with, what a client raises.
ERROR_KINDS: dict[str, type[errors.TlkvError]] = _declared_kinds()


def error_for_kind(kind: str, message: str) -> errors.TlkvError:
    """The typed exception a client raises for a server error of ``kind``."""
    return ERROR_KINDS.get(kind, errors.ServiceError)(message)
