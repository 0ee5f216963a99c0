"""A router's question in one call: the longest stored prefix of a prompt, per model.

``POST /v1/lookup`` and tl.kv.v1's ``Lookup`` (tlkv's extension) both answer here, without
a transport. The prompt comes as token ids (hashed per model with that model's
``block_tokens``: the chained FNV-1a of FORMAT.md 1) or as block hashes (used as they
are); the models asked about default to every model the caller may read. Per model the
answer is the prefix this node holds on its disk (``local_blocks``, ``local_tokens``) and
how far the object-store tier continues it beyond that (``tier_blocks``,
``tier_tokens``: blocks only in the tier, which a read of the prefix brings in). A model
that does not exist, or that the caller may not read, answers zeros and a null
``block_tokens`` alike (the 404-not-403 rule: existence is not disclosed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvstore.codec.hashing import chain_hashes_array
from kvstore.errors import InvalidRequestError
from kvstore.protocol import check_model_id
from kvstore.store import Store

from .access import Access

__all__ = ["LookupQuery", "lookup"]

MAX_MODELS_ASKED = 256  # models one lookup may name


class LookupQuery:
    """What a lookup asks: ``tokens`` or ``hashes`` (one of them, ``<u4``/``<u8``
    arrays), and the model ids (None: every readable model)."""

    __slots__ = ("hashes", "models", "tokens")

    def __init__(
        self,
        tokens: np.ndarray | None = None,
        hashes: np.ndarray | None = None,
        models: Sequence[str] | None = None,
    ) -> None:
        if (tokens is None) == (hashes is None):
            raise InvalidRequestError("a lookup takes 'tokens' or 'hashes', exactly one of them")
        if models is not None:
            if len(models) > MAX_MODELS_ASKED:
                raise InvalidRequestError(
                    f"a lookup names at most {MAX_MODELS_ASKED} models, found {len(models)}"
                )
            try:
                models = [check_model_id(m) for m in models]
            except ValueError as exc:
                raise InvalidRequestError(f"models: {exc}") from None
        self.tokens = tokens
        self.hashes = hashes
        self.models = None if models is None else list(dict.fromkeys(models))


def _answer(model: str, block_tokens: int | None, local: int, tier: int) -> dict[str, Any]:
    b = block_tokens or 0
    return {
        "model": model,
        "block_tokens": block_tokens,
        "local_blocks": local,
        "local_tokens": local * b,
        "tier_blocks": tier,
        "tier_tokens": tier * b,
    }


def lookup(store: Store, access: Access, query: LookupQuery) -> list[dict[str, Any]]:
    """The answer per model, in the order asked (or of the model ids): see the module
    docstring. Runs store reads (and, with a tier, HEADs): call it off the event loop."""
    existing = store.models()
    asked: Iterable[str] = existing if query.models is None else query.models
    known = set(access.readable(existing))
    for model in query.models or ():  # a namespace other nodes put into the shared tier
        if model not in known and access.can_read(model) and store.has_model(model):
            known.add(model)
    chains: dict[int, np.ndarray] = {}  # block_tokens -> the prompt's hashes
    out = []
    for model in asked:
        handle = store.model(model) if model in known else None
        geometry = None if handle is None else handle.geometry
        if handle is None or geometry is None:
            out.append(_answer(model, None, 0, 0))
            continue
        b = geometry.block_tokens
        hashes = query.hashes if query.hashes is not None else chains.get(b)
        if hashes is None:
            assert query.tokens is not None
            hashes = chains[b] = chain_hashes_array(query.tokens, b)
        local = handle.longest_prefix(hashes) if len(hashes) else 0
        tier = 0
        if handle.tier is not None and local < len(hashes):
            tier = handle.longest_prefix(hashes, tier=True) - local
        out.append(_answer(model, b, local, max(0, tier)))
    return out
