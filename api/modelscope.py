"""Which model a request addresses, and whether its token may: pure ASGI, inside the guard.

Every ``/v1/...`` route is also served under ``/v1/models/{model}/...``, the model id
percent-encoded in one path segment (``meta-llama%2FLlama-3.1-8B``); the unprefixed routes
address the model ``default``. The prefix is stripped here (the routes never see it) and
the model left in the scope (``MODEL_KEY``) for ``store_of``.

Access (``api.access``): reading a model the token may not read answers 404 "model not
found", exactly as for a model that does not exist, so a token cannot probe for models or
their blocks; writing one it may read but not write answers 403; writing one it may not
see answers 404 too. A write creates a model; a read of a model not created yet is 404.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any
from urllib.parse import unquote

from kvstore.errors import InvalidRequestError, TlkvError
from kvstore.protocol import DEFAULT_MODEL, check_model_id
from kvstore.store import Store

from .access import EVERYTHING, check_access
from .access import SCOPE_KEY as ACCESS_KEY
from .errors import send_error

MODEL_KEY = "tlkv.model"  # the ASGI scope key of the model a request addresses
MODELS_PREFIX = "/v1/models/"
MODELS_PATH = "/v1/models"
STATUS_PATH = "/v1/status"  # like the models list: about every model the token may read
LOOKUP_PATH = "/v1/lookup"  # unprefixed: about the models its body names (or every one)
UNSCOPED = frozenset({MODELS_PATH, STATUS_PATH, LOOKUP_PATH})  # served for no one model
# POST routes that only read.
READ_POSTS = frozenset({"/v1/has-blocks", "/v1/prefix", LOOKUP_PATH})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def handle_of(store: Store, model: str, quotas: tuple[tuple[str, int], ...]) -> Store:
    """The handle on ``model`` with its quota (``--quota``), if any."""
    for name, quota in quotas:
        if name == model:
            return store.model(model, quota_bytes=quota)
    return store if model == DEFAULT_MODEL else store.model(model)


def model_store(scope: MutableMapping[str, Any], store: Store) -> Store:
    """The handle on the model the request addresses (``store`` itself for ``default``)."""
    settings = getattr(scope["app"].state, "settings", None)
    quotas = () if settings is None else settings.quotas
    return handle_of(store, scope.get(MODEL_KEY, DEFAULT_MODEL), quotas)


class ModelScope:
    """Strip ``/v1/models/{model}``, check the token's access to the model."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def _exists(self, scope: dict[str, Any], model: str) -> bool:
        state = scope["app"].state
        # Models seen to exist, until this worker deletes one (another worker's delete
        # shows here as an empty model: its reads find nothing, a write creates it).
        known: set[str] = state.known_models
        if model in known:
            return True
        store = getattr(state, "store", None)
        if store is None or not store.has_model(model):
            return False
        known.add(model)
        return True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/") or path in UNSCOPED:
            await self.app(scope, receive, send)
            return
        model = DEFAULT_MODEL
        if path.startswith(MODELS_PREFIX):
            raw = scope.get("raw_path") or path.encode()
            parts = bytes(raw).split(b"/", 4)  # "", "v1", "models", model, rest
            if len(parts) < 5 or not parts[4]:
                await self.app(scope, receive, send)  # the router answers 404
                return
            model = unquote(parts[3].decode("latin-1"))
            try:
                check_model_id(model)
            except ValueError as exc:
                await send_error(send, InvalidRequestError(str(exc)))
                return
            rest = b"/v1/" + parts[4]
            # In place: the outer middlewares read what the routes leave in the scope.
            scope["path"], scope["raw_path"] = unquote(rest.decode("latin-1")), rest
        write = scope["method"] not in _READ_METHODS and scope["path"] not in READ_POSTS
        try:
            check_access(
                scope.get(ACCESS_KEY, EVERYTHING), model, write, lambda m: self._exists(scope, m)
            )
        except TlkvError as exc:
            await send_error(send, exc)
            return
        scope[MODEL_KEY] = model
        await self.app(scope, receive, send)
