"""Token ids inside a write transaction: kept with the blocks a put stores, and the
``BlockStored`` events that announce them.

A block is announced on the node's disk (``MEDIUM_STORAGE``) once its token ids are known
and its parent is announced there too (or it starts a sequence): a router then always
hears of a parent before its children. A block whose tokens are not known is never
announced (no event can carry its token ids); one whose parent is not announced waits
(``waiting``: parent -> child) and is announced in the transaction that announces its
parent, whichever order blocks arrive in (an archive restores them in hash order). The
flags of its ``tokens`` value say where it is announced (``diskformat``); ``WriteTxn``
announces removals.

Every removal of a block from the disk goes through ``forget_tokens`` (``WriteTxn``
calls it): a ``BlockRemoved`` when it was announced there, and, for a block evicted while
the object tier holds it, a ``BlockStored`` on the tier's medium (``MEDIUM_TIER``).

Functions over a ``writetxn.WriteTxn`` (which imports this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..codec.layout import NO_HASH
from ..codec.tokens import BlockTokens
from ..events.wire import MEDIUM_STORAGE
from .diskformat import (
    ANNOUNCED_STORAGE,
    ANNOUNCED_TIER,
    BLOCK_KEY,
    TOKENS_HEADER,
    Dbs,
    pack_tokens,
    tokens_dtype,
    tokens_flags,
    unpack_tokens,
)

if TYPE_CHECKING:
    from .writetxn import WriteTxn


def announced(txn: Any, dbs: Dbs, block_hash: int, flag: int) -> bool:
    """Whether ``block_hash`` (a parent) is announced with ``flag``; 0 (no parent) is."""
    if block_hash == NO_HASH:
        return True
    value = txn.get(BLOCK_KEY.pack(block_hash), None, dbs.tokens)
    return value is not None and bool(tokens_flags(value) & flag)


def forget_tokens(w: WriteTxn, dbs: Dbs, hk: bytes, h: int, to_tier: bool = False) -> None:
    """Block ``h`` (key ``hk``) of the model ``dbs`` left this node's disk: a
    ``BlockRemoved`` if it was announced there. ``to_tier``: it was evicted while the
    object tier holds it (a store with a tier evicts only uploaded blocks), so it is
    announced there when its parent is (or it starts a sequence), and its token ids stay
    (a read-through announces it on the disk again); otherwise they go."""
    txn = w.txn
    value = txn.pop(hk, db=dbs.tokens)  # one B-tree walk; put back below when kept
    if value is None:
        return
    parent, flags = TOKENS_HEADER.unpack_from(value, 0)
    if flags & ANNOUNCED_STORAGE:
        w.events.removed(dbs.number, h)
    elif parent != NO_HASH:  # it was waiting for its parent: no more
        txn.delete(BLOCK_KEY.pack(parent), hk, db=dbs.waiting)
    if to_tier and (flags & ANNOUNCED_TIER or announced(txn, dbs, parent, ANNOUNCED_TIER)):
        ids = unpack_tokens(value)[2]
        flags |= ANNOUNCED_TIER  # (again, after a read-through: it is only in the tier now)
        w.events.to_tier(dbs.number, h, parent, ids)
        txn.put(hk, pack_tokens(parent, flags & ~ANNOUNCED_STORAGE, ids), db=dbs.tokens)
    elif flags & ANNOUNCED_TIER:
        txn.put(
            hk,
            pack_tokens(parent, flags & ~ANNOUNCED_STORAGE, unpack_tokens(value)[2]),
            db=dbs.tokens,
        )
    else:
        txn.delete(hk, db=dbs.tokens)


def keep_tokens(
    w: WriteTxn, hashes: list[int], new: list[bool], tokens: BlockTokens | None
) -> None:
    """After a put stored the full blocks of ``hashes`` (an envelope's, 0 for a partial
    block): keep their token ids (``tokens``: one row per full block, verified against
    the hashes; None: only blocks with ids kept already are looked at, those ``new``
    here coming back from the object tier) and announce the blocks that now may be, and
    the stored children that were waiting for them, in chained runs, each run one
    ``BlockStored``."""
    txn, dbs = w.txn, w.dbs
    db = dbs.tokens
    records = None if tokens is None else _records(tokens)  # each row's value, flags 0
    done: set[int] = set()  # announced by this call
    run: list[int] = []
    rows: list[np.ndarray] = []
    run_parent = NO_HASH

    def flush() -> None:
        nonlocal run, rows
        if run:
            w.events.stored(dbs.number, run, run_parent, np.stack(rows), MEDIUM_STORAGE)
            run, rows = [], []

    def emit(h: int, parent: int, ids: np.ndarray) -> None:
        nonlocal run_parent
        done.add(h)
        if run and run[-1] != parent:
            flush()
        if not run:
            run_parent = parent
        run.append(h)
        rows.append(ids)

    row = -1
    for i, h in enumerate(hashes):
        if h == NO_HASH:
            continue
        row += 1
        if tokens is None and not (new[i] and w.keep_pending):
            continue
        hk = BLOCK_KEY.pack(h)
        # A block new here has ids kept only when it comes back from the tier.
        value = None if new[i] and not w.keep_pending else txn.get(hk, None, db)
        if value is not None:
            parent, flags, ids = unpack_tokens(value)
            record = None
        elif tokens is not None and records is not None:
            parent, flags, ids = int(tokens.parents[row]), 0, tokens.ids[row]
            record = records[row]
        else:
            continue
        if flags & ANNOUNCED_STORAGE or h in done:
            continue
        if not (parent in done or announced(txn, dbs, parent, ANNOUNCED_STORAGE)):
            if record is not None:  # kept; announced as soon as its parent is
                txn.put(hk, record.tobytes(), db=db)
                txn.put(BLOCK_KEY.pack(parent), hk, db=dbs.waiting)
            continue
        if record is not None:
            record["flags"] = ANNOUNCED_STORAGE
            txn.put(hk, record.tobytes(), db=db)
        else:
            txn.put(hk, pack_tokens(parent, flags | ANNOUNCED_STORAGE, ids), db=db)
        emit(h, parent, ids)
        _announce_waiting(txn, dbs, h, emit)
    flush()


def _announce_waiting(txn: Any, dbs: Dbs, h: int, emit: Any) -> None:
    """Announce the stored children waiting for ``h`` (just announced), and theirs, each
    after its parent; their waiting entries go."""
    stack = [h]
    while stack:
        parent = stack.pop()
        pk = BLOCK_KEY.pack(parent)
        cursor = txn.cursor(db=dbs.waiting)
        if not cursor.set_key(pk):
            continue
        children = [bytes(v) for v in cursor.iternext_dup(keys=False)]
        txn.delete(pk, db=dbs.waiting)  # every child's entry
        for ck in children:
            value = txn.get(ck, None, dbs.tokens)
            if value is None or txn.get(ck, None, dbs.blocks) is None:
                continue  # gone since
            p, flags, ids = unpack_tokens(value)
            if flags & ANNOUNCED_STORAGE or p != parent:
                continue
            txn.put(ck, pack_tokens(p, flags | ANNOUNCED_STORAGE, ids), db=dbs.tokens)
            child = BLOCK_KEY.unpack(ck)[0]
            emit(child, p, ids)
            stack.append(child)


def _records(tokens: BlockTokens) -> np.ndarray:
    """``tokens`` as ``tokens`` values, flags 0: one structured array for every row."""
    out = np.empty(tokens.n_blocks, dtype=tokens_dtype(tokens.block_tokens))
    out["parent"] = tokens.parents
    out["flags"] = 0
    out["ids"] = tokens.ids
    return out
