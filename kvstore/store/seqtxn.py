"""Sequence records inside a write transaction: put one (its blocks deduplicated and
pinned), drop one (its pins released), and what a record failing its CRC costs (removed,
counted, every pin recounted from the records left).

Functions over a ``writetxn.WriteTxn``, which keeps the block space's invariants.
"""

from __future__ import annotations

from collections import Counter

from ..codec.assembly import holds_record, same_bytes, single_block
from ..codec.envelope import Envelope
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH
from ..codec.tokens import BlockTokens
from .diskformat import (
    BLOCK_KEY,
    QUARANTINE_SEQUENCE,
    REFCOUNT,
    pack_sequence,
    parse_sequence,
)
from .tokentxn import keep_tokens
from .writetxn import WriteTxn, log


def put_sequence(
    w: WriteTxn, key: bytes, env: Envelope, tokens: BlockTokens | None = None
) -> tuple[int, int, int]:
    """Store a sequence (replacing ``key``): ``(stored, duplicate, partial)``.

    Full blocks go to the block space (deduplicated) and are pinned; a block whose
    stored copy has another version or other bytes, and the partial tail, are kept
    inside the record so ``get_sequence`` is byte-identical to ``env``.
    """
    drop_sequence(w, key, env.geometry)
    txn = w.txn
    c = single_block(env.geometry, env.version)
    hashes = env.hashes.tolist()
    new = [False] * len(hashes)
    own: list[int] = []
    pins: Counter[int] = Counter()
    first: dict[int, int] = {}  # hash -> its first position in this envelope
    stored = duplicate = partial = 0
    for i, h in enumerate(hashes):
        if h == NO_HASH:
            partial += 1
            own.append(i)
            continue
        record = env.record(i)
        j = first.get(h)
        if j is not None:  # the same hash again in this envelope
            duplicate += 1
            if j not in own and same_bytes(env.record(j), record):
                pins[h] += 1
            else:
                own.append(i)
            continue
        first[h] = i
        value = txn.get(BLOCK_KEY.pack(h), None, w.dbs.blocks)
        if value is None:
            new[i] = True
            stored += 1
            pins[h] += 1
            continue
        duplicate += 1
        if holds_record(value, env.version, record):
            pins[h] += 1
        else:  # stored in another version or with other bytes: keep ours in the record
            own.append(i)
    for h, count in pins.items():
        w.pin(h, count)
    sequence = pack_sequence(env.version, hashes, own, [env.record(i) for i in own])
    w.protect.update(first)
    w.make_room(stored * c.single_len + len(sequence))
    w.write_records(env, hashes, new)
    keep_tokens(w, hashes, new, tokens)
    txn.put(key, sequence, db=w.dbs.seqs)
    w.bytes += len(sequence)
    w.count(w.dbs.number, 0, len(sequence))
    return stored, duplicate, partial


def drop_sequence(w: WriteTxn, key: bytes, geometry: Geometry | None) -> bool:
    """Delete a sequence record and release its pins; False when absent."""
    raw = w.txn.get(key, None, w.dbs.seqs)
    if raw is None:
        return False
    size = len(raw)
    seq = parse_sequence(raw, geometry)
    if seq is None:
        drop_corrupt_sequence(w, key, size)
        rebuild_refs(w, geometry)
        return True
    pins = Counter(seq.referenced())
    w.txn.delete(key, db=w.dbs.seqs)
    w.bytes -= size
    w.count(w.dbs.number, 0, -size)
    for h, count in pins.items():
        w.unpin(h, count)
    return True


def drop_corrupt_sequence(w: WriteTxn, key: bytes, size: int) -> None:
    w.txn.delete(key, db=w.dbs.seqs)
    w.note_quarantined(QUARANTINE_SEQUENCE, key)
    w.bytes -= size
    w.corrupt += 1
    w.count(w.dbs.number, 0, -size)
    w.count(w.dbs.number, 2, 1)
    log.warning(
        "%s: sequence record %r failed its CRC-32C; removed (counted in "
        "stats()['corrupt']) and every pin recounted",
        w.path,
        key.decode("ascii", "replace"),
    )


def rebuild_refs(w: WriteTxn, geometry: Geometry | None) -> None:
    """Recount every pin from the sequence records (after one was found corrupt)."""
    txn = w.txn
    counts: Counter[int] = Counter()
    bad: list[tuple[bytes, int]] = []
    for key, raw in txn.cursor(db=w.dbs.seqs):
        seq = parse_sequence(raw, geometry)
        if seq is None:
            bad.append((bytes(key), len(raw)))
        else:
            counts.update(seq.referenced())
    for key, size in bad:
        drop_corrupt_sequence(w, key, size)
    current = {BLOCK_KEY.unpack(k)[0]: REFCOUNT.unpack(v)[0] for k, v in txn.cursor(db=w.dbs.refs)}
    for h, have in current.items():
        want = counts.get(h, 0)
        if want == 0:
            w.unpin(h, have)
        elif want != have:
            txn.put(BLOCK_KEY.pack(h), REFCOUNT.pack(want), db=w.dbs.refs)
    for h, want in counts.items():
        if h not in current:
            w.pin(h, want)
