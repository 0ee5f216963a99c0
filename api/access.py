"""Bearer tokens and the models each may read and write (``--token-file``).

A token file holds either one bare token (every model, read and write: the meaning a
token always had) or a table of tokens, as JSON or TOML::

    {"tokens": [{"token": "s3cret", "read": ["*"], "write": ["default"]}]}

    [[tokens]]
    token = "s3cret"
    read = ["*"]
    write = ["default"]

``"*"`` means every model. A token that may not read a model gets 404 for it, exactly as
for a model that does not exist (``api.models``); ``/v1/models`` lists only the models
it may read.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from kvstore.errors import ForbiddenError, NotFoundError
from kvstore.protocol import check_model_id

ALL = "*"
SCOPE_KEY = "tlkv.access"  # the ASGI scope key of the request's Access


@dataclass(frozen=True)
class Access:
    """The models one token may read and write (``"*"``: all); ``metrics``: it may read
    the store-wide series of ``/metrics`` though it reads no model (the metrics token)."""

    read: frozenset[str]
    write: frozenset[str]
    metrics: bool = False

    def sees_store_metrics(self) -> bool:
        """Whether ``/metrics`` shows this token the store-wide series (which move with
        every model's traffic): a token that may read every model, or the metrics token."""
        return self.metrics or ALL in self.read

    def can_read(self, model: str) -> bool:
        """Whether the token may read ``model``."""
        return ALL in self.read or model in self.read

    def can_write(self, model: str) -> bool:
        """Whether the token may write ``model``."""
        return ALL in self.write or model in self.write

    def readable(self, models: Iterable[str]) -> list[str]:
        """The models of ``models`` the token may read, in order."""
        return [m for m in models if self.can_read(m)]


EVERYTHING = Access(frozenset({ALL}), frozenset({ALL}))
METRICS_ONLY = Access(frozenset(), frozenset(), metrics=True)  # the metrics token


class TokenTable:
    """Tokens and their access; ``lookup`` compares in constant time per token."""

    def __init__(self, entries: dict[str, Access]) -> None:
        if not entries:
            raise ValueError("a token table holds at least one token")
        self._entries = [(token.encode(), access) for token, access in entries.items()]
        self.bare: str | None = None  # the token of a file holding one bare token

    @classmethod
    def single(cls, token: str) -> TokenTable:
        """One token that may read and write every model."""
        table = cls({token: EVERYTHING})
        table.bare = token
        return table

    def with_metrics_token(self, token: str) -> TokenTable:
        """This table plus ``token``, which reads every ``/metrics`` series and no model.

        Raises:
            ValueError: the token is one of the table's already.
        """
        if self.lookup(token.encode()) is not None:
            raise ValueError("the metrics token must differ from every other token")
        table = TokenTable({t.decode(): a for t, a in self._entries})
        table._entries.append((token.encode(), METRICS_ONLY))
        table.bare = self.bare
        return table

    def lookup(self, credentials: bytes) -> Access | None:
        """The access of the token ``credentials``, or None when no token matches."""
        found = None
        for token, access in self._entries:  # no early exit: no timing oracle on position
            if hmac.compare_digest(credentials, token):
                found = access
        return found


def check_access(access: Access, model: str, write: bool, exists: Callable[[str], bool]) -> None:
    """Refuse a request of ``access`` on ``model`` as the service answers it.

    Raises:
        NotFoundError: a read of a model the token may not read or that does not exist,
            or a write of a model it may neither write nor read (the same answer, so a
            token cannot probe for models).
        ForbiddenError: a write of a model the token may read but not write.
    """
    readable = access.can_read(model)
    if write:
        if not access.can_write(model):
            if readable and exists(model):
                raise ForbiddenError(f"this token may read model {model!r} but not write it")
            raise model_not_found(model)
    elif not readable or not exists(model):
        raise model_not_found(model)


def model_not_found(model: str) -> NotFoundError:
    """The one answer for a model that does not exist or that the token may not read."""
    return NotFoundError(f"model {model!r} not found")


def _models(value: Any, where: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list):
        raise ValueError(f'{where}: a list of model ids (or "*") expected, found {value!r}')
    return frozenset(m if m == ALL else check_model_id(m) for m in value)


def parse_tokens(text: str, source: str = "token file") -> TokenTable:
    """A token table from a token file's text: one bare token, or JSON / TOML tables.

    Raises:
        ValueError: the file is empty or malformed (the message says where).
    """
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"{source} is empty")
    if stripped.startswith("{"):
        try:
            doc = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON: {exc}") from None
    elif "[[tokens]]" in stripped:
        try:
            doc = tomllib.loads(stripped)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{source}: not valid TOML: {exc}") from None
    else:
        return TokenTable.single(stripped)
    items = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f'{source}: a non-empty list "tokens" expected')
    entries: dict[str, Access] = {}
    for i, item in enumerate(items):
        where = f"{source}: tokens[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            raise ValueError(f'{where}: an object with a string "token" expected')
        unknown = set(item) - {"token", "read", "write"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        token = item["token"].strip()
        if not token or token in entries:
            raise ValueError(f"{where}: the token is empty or repeated")
        entries[token] = Access(_models(item.get("read"), where), _models(item.get("write"), where))
    return TokenTable(entries)


def read_tokens(path: str | os.PathLike[str]) -> TokenTable:
    """``parse_tokens`` of the file at ``path``.

    Raises:
        ValueError: malformed.  OSError: it cannot be read.
    """
    return parse_tokens(Path(path).read_text(encoding="utf-8"), f"token file {os.fspath(path)!r}")
