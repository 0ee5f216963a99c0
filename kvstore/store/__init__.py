"""The persistent block store: single-block envelopes by chained hash in one LMDB environment.

``Store`` is the whole public surface; its modules: ``store`` (the API), ``reader`` (zero-copy
views), ``writetxn`` (validated writes), ``lmdbenv`` (environment, map size, transactions),
``diskformat`` (sub-databases, keys and records), ``keyset`` (bulk membership), ``eviction``
(LRU policy), ``mapguard`` (remap safety) and ``writebehind`` (overlapping commit and disk).
"""

from .store import PutReport, PutResult, Store, transcode_stored

__all__ = ["PutReport", "PutResult", "Store", "transcode_stored"]
