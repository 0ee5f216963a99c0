"""The persistent block store: single-block envelopes by chained hash in one LMDB environment.

``Store`` is the whole public surface; its modules: ``store`` (opening, handles, closing),
over ``core`` (a handle's state and transactions) and the API's mixins ``reads`` (gets,
membership, zero-copy readers, sequences), ``writes`` (puts, imports, restores, deletes),
``models`` and ``stats``; ``results`` (what a put reports), ``checks`` (argument checks),
``reader`` (zero-copy views), ``writetxn`` (validated writes), ``lmdbenv`` (environment,
map size, transactions), ``diskformat`` (sub-databases, keys and records), ``registry``
(models on disk), ``keyset`` (bulk membership), ``eviction`` (LRU policy), ``mapguard``
(remap safety), ``writebehind`` (overlapping commit and disk), ``journal`` (restores undone
after a crash), ``tiered`` (the link to a tier) and ``debug`` (raw state, for invariant
checks in tests).
"""

from .store import PutReport, PutResult, Store, transcode_stored

__all__ = ["PutReport", "PutResult", "Store", "transcode_stored"]
