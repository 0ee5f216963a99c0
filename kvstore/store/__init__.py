"""The persistent block store: single-block envelopes by chained hash in one LMDB environment.

``Store`` is the whole public surface, the index of its API: a facade whose methods
delegate to code over a model handle. Its modules: ``store`` (the facade), ``state`` (the
``Environment`` an open store shares and the ``Handle`` of each model on it: sub-databases,
geometry, recency, counters, transactions), the API's code over a handle: ``reads`` (gets,
membership, zero-copy readers, sequences), ``writes`` (puts, imports, deletes),
``restores`` (restore journals), ``models`` and ``stats``; ``protocols`` (the typed
interfaces of the store that the layers above call), ``results`` (what a put reports),
``checks`` (argument checks), ``reader`` (zero-copy views), ``writetxn`` (a write
transaction's block space) and ``seqtxn`` (its sequence records), ``lmdbenv``
(environment, map size, transactions), ``diskformat`` (sub-databases, keys and records),
``registry`` (models on disk), ``keyset`` (bulk membership), ``eviction`` (LRU policy),
``mapguard`` (remap safety), ``writebehind`` (overlapping commit and disk), ``journal``
(restores undone after a crash), ``tiered`` (a model's link to a tier), ``scrub`` (the
CRC scrub) and ``debug`` (raw state, for invariant checks in tests).
"""

from .memory import keep_freed_memory
from .store import PutReport, PutResult, Store, transcode_stored

__all__ = ["PutReport", "PutResult", "Store", "keep_freed_memory", "transcode_stored"]
