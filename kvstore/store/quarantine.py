"""What a model has quarantined and not stored again: the blocks and sequence records that
failed their CRC-32C.

The write that removes one also records it in ``meta`` (``WriteTxn.note_quarantined``;
the layout is ``diskformat``'s ``QUARANTINE_PREFIX``), whichever read, scrub or process
found it, so that a later scrub still reports it and repairs it from a tier
(``scrub.py``). A record goes once the block or sequence is stored again, once the scrub
repairs it, or when the operator accepts the loss (``tlkv scrub --forget-unrepaired``).

Functions over a ``state.Handle``.
"""

from __future__ import annotations

from collections.abc import Collection

from .diskformat import (
    BLOCK_KEY,
    MODEL_NUMBER,
    QUARANTINE_BLOCK,
    QUARANTINE_PREFIX,
    QUARANTINE_SEQUENCE,
    quarantine_key,
)
from .state import Handle
from .writetxn import WriteTxn


def listed(h: Handle) -> tuple[list[int], list[str]]:
    """The hashes of the blocks and the names of the sequences ``h``'s model quarantined
    and has not stored again since (as far as the records say: see :func:`settle`)."""
    if not h.created():
        return [], []
    hashes: list[int] = []
    names: list[str] = []
    number = MODEL_NUMBER.pack(h.dbs.number)
    txn = h.begin_read(False)
    try:
        cursor = txn.cursor(db=h.dbs.meta)
        found = cursor.set_range(QUARANTINE_PREFIX)
        while found:
            key = bytes(cursor.key())
            if not key.startswith(QUARANTINE_PREFIX):
                break
            kind = key[len(QUARANTINE_PREFIX) : len(QUARANTINE_PREFIX) + 1]
            rest = key[len(QUARANTINE_PREFIX) + 1 :]
            if rest.startswith(number):
                what = rest[len(number) :]
                if kind == QUARANTINE_BLOCK and len(what) == BLOCK_KEY.size:
                    hashes.append(int(BLOCK_KEY.unpack(what)[0]))
                elif kind == QUARANTINE_SEQUENCE:
                    names.append(what.decode("ascii", "replace"))
            found = cursor.next()
    finally:
        h.end_read(txn)
    return hashes, names


def forget(h: Handle, hashes: Collection[int] = (), names: Collection[str] = ()) -> None:
    """Drop the records of ``hashes`` and ``names`` (repaired, stored again, or given up)."""
    if not hashes and not names:
        return
    number = h.dbs.number
    keys = [quarantine_key(QUARANTINE_BLOCK, number, BLOCK_KEY.pack(x)) for x in hashes]
    keys += [quarantine_key(QUARANTINE_SEQUENCE, number, n.encode()) for n in names]

    def body(w: WriteTxn) -> None:
        for key in keys:
            w.txn.delete(key, db=w.dbs.meta)

    h.write(body)


def settle(h: Handle, hashes: list[int], names: list[str]) -> tuple[list[int], list[str]]:
    """Of the recorded ``hashes`` and ``names``, forget those stored again since (a put, a
    read-through, a restore); the ones still missing."""
    if not hashes and not names:
        return [], []
    txn = h.begin_read(False)
    try:
        back = [x for x in hashes if txn.get(BLOCK_KEY.pack(x), None, h.dbs.blocks) is not None]
        again = [n for n in names if txn.get(n.encode(), None, h.dbs.seqs) is not None]
    finally:
        h.end_read(txn)
    forget(h, back, again)
    gone, made = set(back), set(again)
    return [x for x in hashes if x not in gone], [n for n in names if n not in made]
