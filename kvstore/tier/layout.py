"""The tier's object layout and URLs: where each block object lives, once.

A block object is the block's verbatim single-block envelope (spec: "Export envelope",
n_blocks = 1), the bytes ``Store.get`` returns, under

    PREFIX/<namespace>/blocks/<16 lowercase hex>.tlkv

``<namespace>`` is the store namespace (model id) the block belongs to, percent-encoded
into one path segment (:func:`namespace_of`): ``default`` for a store's own blocks. Beside
its blocks, each namespace has one geometry object,

    PREFIX/<namespace>/geometry.json

``{"block_tokens": B, "n_layers": L, "n_kv_heads": H, "head_dim": D}`` (the JSON form of
``Geometry.as_dict``), created before the namespace's first block is uploaded, so that a
node holding nothing of a namespace yet learns its geometry from the tier.

``PREFIX`` is the path of the tier URL inside its bucket (``s3://bucket/PREFIX``) or
directory (``file:///PREFIX``). Objects never change once written: content addressing
makes the first writer's bytes the only ones (a conditional put where the server has
one). This layout is stable: nodes of different versions share one bucket.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import quote, unquote, urlsplit

from ..protocol import hash_hex

DEFAULT_NAMESPACE = "default"
BLOCKS_DIR = "blocks"
BLOCK_SUFFIX = ".tlkv"
GEOMETRY_OBJECT = "geometry.json"
SCHEMES = ("s3", "file")
# One path segment: unreserved characters, and %XX for the others of a model id.
_NAMESPACE = re.compile(r"(?:[A-Za-z0-9._-]|%[0-9A-F]{2}){1,600}")


class ObjectUrl(NamedTuple):
    """A parsed object URL: ``scheme`` (s3 or file), ``bucket`` (s3 only, else ""),
    ``path`` (the key or file path inside it, no leading or trailing slash for s3)."""

    scheme: str
    bucket: str
    path: str


def parse_url(url: str) -> ObjectUrl:
    """``s3://bucket/path`` or ``file:///abs/path`` as an :class:`ObjectUrl`.

    Raises:
        ValueError: another scheme, no bucket, or a relative file path.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"an object URL is s3://bucket/prefix or file:///path, found {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"an object URL has no query or fragment, found {url!r}")
    path = unquote(parts.path)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"an s3 URL names a bucket (s3://bucket/prefix), found {url!r}")
        return ObjectUrl("s3", parts.netloc, path.strip("/"))
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise ValueError(f"a file URL holds an absolute local path (file:///path), found {url!r}")
    return ObjectUrl("file", "", path.rstrip("/") or "/")


def is_object_url(target: str) -> bool:
    """Whether ``target`` is an object URL (s3:// or file://) rather than a local path."""
    return urlsplit(target).scheme in SCHEMES


def check_namespace(namespace: str) -> str:
    """A namespace is one path segment of ``[A-Za-z0-9._-]`` and ``%XX`` escapes (what
    :func:`namespace_of` makes of a model id), not ``.`` or ``..``."""
    if not _NAMESPACE.fullmatch(namespace) or namespace in (".", ".."):
        raise ValueError(
            f"a namespace is one path segment of [A-Za-z0-9._-] and %XX escapes, found "
            f"{namespace!r}"
        )
    return namespace


def namespace_of(model_id: str) -> str:
    """The namespace segment of a model (store namespace): its id with every character
    outside ``[A-Za-z0-9._-]`` percent-encoded (``/`` -> ``%2F``, ``@`` -> ``%40``, ``:`` ->
    ``%3A``, ``+`` -> ``%2B``), so ``default`` stays ``default`` and every model is one
    segment."""
    return check_namespace(quote(model_id, safe="._-"))


def block_key(namespace: str, block_hash: int) -> str:
    """The object key of a block, relative to the tier's prefix."""
    return f"{namespace}/{BLOCKS_DIR}/{hash_hex(block_hash)}{BLOCK_SUFFIX}"


def geometry_key(namespace: str) -> str:
    """The object key of a namespace's geometry, relative to the tier's prefix."""
    return f"{namespace}/{GEOMETRY_OBJECT}"
