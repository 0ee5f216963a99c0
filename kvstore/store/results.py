"""What a put reports: ``PutResult`` (counts) and ``PutReport`` (hashes), defined in
:mod:`kvstore.results` with the clients' answers."""

from __future__ import annotations

from ..results import PutReport, PutResult

__all__ = ["PutReport", "PutResult"]
