"""One PushKv stream on the server: the stream rules as chunks arrive, then one commit.

The rules are :class:`kvstore.transfer.PushStream`'s (the client plans its chunks by the
same ones); what is left here is what only the store can answer -- a referenced block is
held -- and the commit: everything in one store transaction (``Store.import_batch``, or
``Store.put_sequence`` when the stream names a sequence), so a failed or cancelled stream
stores nothing. A payload is decoded once, by its check: the store takes the decoded
envelopes (a named sequence of several blocks is joined from their bytes) and checks each
CRC again as it copies them.

- A referenced block (empty payload) must be held when the stream commits: sent earlier
  in the same stream, or in the store (FAILED_PRECONDITION naming the hash otherwise).
  Without a sequence a reference writes nothing; with one, the stored copy is read
  (transcoded to the pushed format if it is stored in the other) and pinned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore import Store, decode
from kvstore.codec.envelope import Envelope
from kvstore.codec.layout import NO_HASH
from kvstore.codec.tokens import BlockTokens
from kvstore.errors import InvalidRequestError, NotFoundError
from kvstore.store import transcode_stored
from kvstore.transfer import Checked, PushStream, join_checked
from kvstore.transfer._tlkv_v1 import kv_pb2

__all__ = ["PushCommit"]


class PushCommit:
    """One PushKv stream: its chunks checked as they arrive and kept until it commits.

    ``note`` runs on the event loop, in stream order (the rules that depend on order and
    the stream's byte limit); ``check`` runs in the thread pool (the payload's CRC and
    reader rules, the CRC with the GIL released); ``take`` takes the checked chunks in
    stream order; ``commit`` (thread pool) stores them.
    """

    def __init__(self, store: Store, formats: Sequence[int], max_stream: int) -> None:
        self.store = store
        self.stream = PushStream(formats, geometry=store.geometry, max_bytes=max_stream)
        # per entry: (parent hash, token ids) of a full block's chunk that carried them
        self.tokens: list[tuple[int, list[int]] | None] = []

    def note(self, chunk: Any) -> int:
        """The order-dependent rules of the next chunk; returns its index."""
        return self.stream.note(chunk)

    def check(self, index: int, chunk: Any) -> Checked:
        """Every rule of one chunk but "the referenced block is held" (thread pool)."""
        return self.stream.check(index, chunk)

    def take(self, checked: Sequence[Checked], chunks: Sequence[Any]) -> None:
        """The rules across the stream's checked chunks (one geometry, full references,
        one format per sequence); keeps each chunk's token ids."""
        self.stream.take(checked, chunks)
        self.tokens = [(c.parent_hash, c.token_ids) if len(c.token_ids) else None for c in chunks]

    def commit(self) -> kv_pb2.PushKvResponse:
        """Store the stream in one transaction (all or nothing)."""
        stream = self.stream
        if not stream.entries:
            return kv_pb2.PushKvResponse()
        if stream.name is None:
            stored, duplicate = self._commit_blocks()
        else:
            stored, duplicate = self._commit_sequence(stream.name)
        return kv_pb2.PushKvResponse(
            blocks=len(stream.entries),
            referenced=stream.referenced,
            stored=stored,
            duplicate=duplicate,
            payload_bytes=stream.payload_bytes,
        )

    def _commit_blocks(self) -> tuple[int, int]:
        entries = self.stream.entries
        sent = {h for h, env, _ in entries if env is not None and h != NO_HASH}
        refs = [h for h, env, _ in entries if env is None and h not in sent]
        if refs:
            for h, here in zip(refs, self.store.has(refs)):
                if not here:
                    raise _missing(h)
        # The envelopes check_chunk decoded: the store fits them to the model without
        # decoding them again, and checks each CRC again as it copies the bytes.
        sent_at = [i for i, (h, env, _) in enumerate(entries) if env is not None and h != NO_HASH]
        if not sent_at:
            return 0, 0
        blocks = [entries[i][1] for i in sent_at]
        tokens = [_one_block(self.tokens[i]) for i in sent_at]
        result = self.store.import_batch(blocks=blocks, tokens=tokens)  # one transaction
        return result.stored, result.duplicate

    def _commit_sequence(self, name: str) -> tuple[int, int]:
        entries, version = self.stream.entries, self.stream.version
        assert version is not None  # take() sets it for a named stream with entries
        sent = {h: env for h, env, _ in entries if env is not None and h != NO_HASH}
        refs = [h for h, env, _ in entries if env is None and h not in sent]
        held: dict[int, bytes] = {}
        if refs:
            for h, data in zip(refs, self.store.get_many(refs)):
                if data is None:
                    raise _missing(h)
                if decode(data, verify_crc=False).version != version:
                    data = transcode_stored(h, data, version)
                held[h] = data
        # The envelopes check_chunk decoded (sent in this stream) and the stored bytes (held).
        parts: list[Envelope | bytes] = [
            env if env is not None else held.get(h) or sent[h] for h, env, _ in entries
        ]
        if len(parts) == 1:
            envelope = parts[0]  # the store takes either without decoding an Envelope again
        else:
            # every part's CRC was checked: on arrival, by Store.get_many, or made by
            # transcode (the store checks the joined envelope's as it copies it)
            envelope = join_checked([p.data if isinstance(p, Envelope) else p for p in parts])
        tokens = _sequence_tokens(entries, self.tokens)
        result = self.store.put_sequence(name, envelope, tokens=tokens)  # one transaction
        # put_sequence counts the referenced blocks as duplicates (they were held).
        full_refs = sum(1 for h, env, _ in entries if env is None)
        return result.stored, max(0, result.duplicate - full_refs)


def _one_block(found: tuple[int, list[int]] | None) -> BlockTokens | None:
    """The ``BlockTokens`` of one chunk's block (None when it carried no token ids)."""
    if found is None:
        return None
    parent, ids = found
    return BlockTokens(np.array([parent], "<u8"), np.array([ids], "<u4"))


def _sequence_tokens(
    entries: Sequence[tuple[int, Any, int]], found: Sequence[tuple[int, list[int]] | None]
) -> BlockTokens | None:
    """The token ids of a named sequence's full blocks: every full chunk's, or none.

    Raises:
        InvalidRequestError: some full chunks carry token ids and others do not.
    """
    full = [f for (h, _, _), f in zip(entries, found) if h != NO_HASH]
    if all(f is None for f in full):
        return None
    if any(f is None for f in full):
        raise InvalidRequestError(
            "rule 'a sequence's full chunks carry token ids all or none' failed: "
            f"{sum(f is None for f in full)} of {len(full)} carry none"
        )
    parents = np.array([f[0] for f in full if f is not None], "<u8")
    return BlockTokens(parents, np.array([f[1] for f in full if f is not None], "<u4"))


def _missing(h: int) -> NotFoundError:
    exc = NotFoundError(
        f"block {h:016x} is not held by this server (evicted since HasBlocks?): "
        "resend it with its payload"
    )
    exc.missing_hash = h  # type: ignore[attr-defined]
    return exc
