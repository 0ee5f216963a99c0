"""The vLLM connector's namespaces: which model id a request's blocks live under.

``<served model name or path>@<revision>/<kv dtype>``, characters outside the model-id rule
replaced by ``_``, a digest in place of the end when it is longer than the room left; a
request's ``cache_salt`` adds ``+salt:<first 16 hex digits of its SHA-256>`` (the salt
itself is never stored, sent or logged).
"""

from __future__ import annotations

import hashlib
import re

from ..protocol import MODEL_ID_MAX

__all__ = ["namespace", "salted"]

_ID_CHARS = re.compile(r"[^A-Za-z0-9._:@/+-]")
_SALT_DIGITS = 16
_DIGEST_DIGITS = 16
_SALT_ROOM = len("+salt:") + _SALT_DIGITS


def _fit(text: str, room: int) -> str:
    """``text`` in the model-id alphabet, at most ``room`` characters (a digest of the
    whole at the end when it had to be cut)."""
    clean = _ID_CHARS.sub("_", text) or "_"
    if len(clean) <= room:
        return clean
    digest = hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_DIGITS]
    return f"{clean[: room - _DIGEST_DIGITS - 1]}+{digest}"


def namespace(name: str, revision: str | None, kv_dtype: str) -> str:
    """The default namespace of a model: ``name@revision/kv_dtype`` as a model id, with
    room left for a salt suffix."""
    return _fit(f"{name}@{revision or 'main'}/{kv_dtype}", MODEL_ID_MAX - _SALT_ROOM)


def salted(base: str, salt: str | None) -> str:
    """The namespace of a request with ``cache_salt`` ``salt`` (``base`` without one)."""
    if not salt:
        return base
    digest = hashlib.sha256(salt.encode()).hexdigest()[:_SALT_DIGITS]
    return f"{base[: MODEL_ID_MAX - _SALT_ROOM]}+salt:{digest}"
