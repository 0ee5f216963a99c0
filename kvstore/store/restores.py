"""Restores of a store: a journal per restore (``begin_restore``), keeping or undoing it
(``end_restore``, ``keep_restores``), and undoing at open the restores a killed process
left unfinished.

Functions over a ``state.Handle`` (``Store`` delegates to them); ``journal`` owns the
notes and the lock files.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import StoreError
from .journal import RestoreJournal, commit, journal_model, pending, remove_orphan_locks, rollback
from .models import model_handle
from .state import Handle, log
from .writetxn import WriteTxn


def begin_restore(h: Handle) -> RestoreJournal:
    """``Store.begin_restore``: a journal for one restore's ``import_batch`` calls."""
    h.check_usable()
    return RestoreJournal(h.env.path, model=h.model)


def end_restore(h: Handle, journal: RestoreJournal, keep: bool) -> None:
    """``Store.end_restore``: keep what the restore imported (one commit), or undo it."""
    try:
        if not h.created():
            return  # nothing was imported: the model's first write would have made it
        if keep:
            h.write(lambda w: commit(w.txn, w.dbs.meta, journal.token))
        else:
            h.write(lambda w: rollback(w, journal.token, h.geometry_in(w.txn)))
    finally:
        journal.release()


def keep_restores(h: Handle, journals: Iterable[RestoreJournal]) -> None:
    """``Store.keep_restores``: keep several restores in one commit."""
    kept = list(journals)

    def keep_all(w: WriteTxn) -> None:
        for journal in kept:  # the journals live in ``meta``, which every model shares
            commit(w.txn, w.dbs.meta, journal.token)

    root = h.env.root
    assert root is not None
    root.write(keep_all)
    for journal in kept:
        journal.release()


def roll_back_killed_restores(h: Handle) -> None:
    """Undo the restores whose process died before they finished (``journal``)."""
    path = h.env.path
    txn = h.begin_read(False)
    try:
        meta = h.dbs.meta
        tokens = [(t, journal_model(txn, meta, t)) for t in pending(txn, meta)]
    finally:
        h.end_read(txn)
    if remove_orphan_locks(path, {t for t, _ in tokens}):
        log.warning("%s: removed the lock files of restores killed before writing", path)
    for token, model in tokens:
        claimed = RestoreJournal.claim(path, token)
        if claimed is None:
            continue  # its restore still runs
        handle = model_handle(h, model, None, None)

        def undo(w: WriteTxn, token: bytes = token, handle: Handle = handle) -> tuple[int, int]:
            return rollback(w, token, handle.geometry_in(w.txn))

        try:
            removed, seqs = handle.write(undo)
        except StoreError as exc:  # the next open tries again
            log.warning("%s: could not undo an unfinished restore: %s", path, exc)
            continue
        finally:
            claimed.release()
        if removed or seqs:
            log.warning(
                "%s: undid a restore that did not finish: %d blocks removed, %d sequences "
                "dropped or put back",
                path,
                removed,
                seqs,
            )
