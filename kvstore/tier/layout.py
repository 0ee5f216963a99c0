"""The tier's object layout and URLs: where each block object lives, once.

A block object is the block's verbatim single-block envelope (spec: "Export envelope",
n_blocks = 1), the bytes ``Store.get`` returns, under

    PREFIX/<namespace>/blocks/<16 lowercase hex>.tlkv

``PREFIX`` is the path of the tier URL inside its bucket (``s3://bucket/PREFIX``) or
directory (``file:///PREFIX``). Objects never change once written: content addressing
makes the first writer's bytes the only ones (a conditional put where the server has
one). This layout is stable: nodes of different versions share one bucket.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from ..protocol import hash_hex

DEFAULT_NAMESPACE = "default"
BLOCKS_DIR = "blocks"
BLOCK_SUFFIX = ".tlkv"
SCHEMES = ("s3", "file")
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,128}")


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
    """A namespace is one path segment of ``[A-Za-z0-9._-]``, not ``.`` or ``..``."""
    if not _NAMESPACE.fullmatch(namespace) or namespace in (".", ".."):
        raise ValueError(f"a namespace is 1-128 characters of [A-Za-z0-9._-], found {namespace!r}")
    return namespace


def block_key(namespace: str, block_hash: int) -> str:
    """The object key of a block, relative to the tier's prefix."""
    return f"{namespace}/{BLOCKS_DIR}/{hash_hex(block_hash)}{BLOCK_SUFFIX}"
