"""What a put reports: ``PutResult`` (counts) and ``PutReport`` (hashes)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PutReport", "PutResult"]


class PutResult(NamedTuple):
    """Outcome of a put: blocks newly stored, already present, and partial (not stored)."""

    stored: int
    duplicate: int
    partial: int


class PutReport(NamedTuple):
    """Outcome of a put, by hash: which blocks this put stored and which were present.

    ``stored`` and ``duplicate`` are in envelope order; a hash repeated within one
    envelope is stored once and then counted as a duplicate. Both lists come from the
    write transaction itself, so they are exact even under concurrent writers.
    """

    stored: list[int]
    duplicate: list[int]
    partial: int

    def counts(self) -> PutResult:
        """The same outcome as counts."""
        return PutResult(len(self.stored), len(self.duplicate), self.partial)
