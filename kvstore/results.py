"""What the store and both clients answer: ``HasResult``, ``PutResult``, ``PutReport`` and
``PushReport``, one type per shape.

Below the store and the clients (it imports nothing of tlkv), so ``Store``, the HTTP
``Client`` and the tl.kv.v1 ``TransferClient`` hand back the same types:

- ``HasResult``: ``Client.has_blocks`` and ``TransferClient.has_blocks``.
- ``PutResult`` (counts): ``Store.put``, ``Store.put_sequence``, ``Store.import_batch``.
- ``PutReport`` (hashes): ``Store.put_report`` and ``Client.put`` (the HTTP service answers
  a put by hash); ``counts()`` turns it into a ``PutResult``.
- ``PushReport``: ``TransferClient.push`` (PushKv answers counts, and what travelled).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HasResult", "PushReport", "PutReport", "PutResult"]


class HasResult(NamedTuple):
    """Answer of has-blocks: one bool per hash, and how many leading hashes are present."""

    present: list[bool]
    prefix: int


class PutResult(NamedTuple):
    """Outcome of a put: blocks newly stored, already present, and partial (not stored)."""

    stored: int
    duplicate: int
    partial: int


class PutReport(NamedTuple):
    """Outcome of a put, by hash: which blocks this put stored and which were present.

    ``stored`` and ``duplicate`` are in envelope order; a hash repeated within one
    envelope is stored once and then counted as a duplicate. Both lists come from one
    snapshot of the store (the write transaction, or for a put of blocks all held
    already, the read transaction that found them), so they are exact even under
    concurrent writers.
    """

    stored: list[int]
    duplicate: list[int]
    partial: int

    def counts(self) -> PutResult:
        """The same outcome as counts."""
        return PutResult(len(self.stored), len(self.duplicate), self.partial)


class PushReport(NamedTuple):
    """Answer of PushKv: chunks, empty-payload references, full blocks newly stored, full
    blocks sent that the server already held, and payload bytes that travelled."""

    blocks: int
    referenced: int
    stored: int
    duplicate: int
    payload_bytes: int
