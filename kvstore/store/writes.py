"""The write side of a model handle: ``put_report``, ``put_sequence``, ``import_batch``
(the archive restore path), ``delete`` and ``delete_sequence``.

Functions over a ``state.Handle`` (``Store`` delegates to them). Each validates its
envelopes by every reader rule but the CRC before the transaction opens (an envelope
``codec.envelope.decode`` returned already is only fitted to the model: its geometry, the
finite rule), then runs one write transaction (``Handle.write``) over ``writetxn``, which
checks the CRC while it copies; a mismatch there stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..codec.decoding import check_crc
from ..codec.envelope import Envelope, check_finite, decode
from ..codec.geometry import Geometry
from ..codec.hashing import TokenInput
from ..codec.layout import NO_HASH
from ..codec.tokens import BlockTokens, tokens_for
from ..errors import ChecksumError, PinnedError
from .checks import check_hash, check_sequence_blocks, seq_key
from .diskformat import ANNOUNCED_STORAGE, BLOCK_KEY
from .journal import RestoreJournal
from .results import PutReport, PutResult
from .seqtxn import drop_sequence, put_sequence
from .state import Handle
from .tokentxn import announced
from .writetxn import CrcMismatch, WriteTxn

T = TypeVar("T")


def validate(h: Handle, data: Any, geometry: Geometry | None = None) -> Envelope:
    """Every reader rule but the CRC (checked while writing); a rule that fails is named
    in the codec's order (the codec checks the CRC before it names a later rule).

    ``data``: envelope bytes (any buffer), or an ``Envelope`` that ``decode`` returned
    (not decoded again: its geometry must be the model's, and the finite rule holds)."""
    if geometry is None and h.geometry is None and h.tier is not None:
        geometry = h.tier.learned_geometry()  # the namespace's in the tier, if any
    geometry = geometry or h.geometry
    if isinstance(data, Envelope) and (geometry is None or data.geometry == geometry):
        env = data  # decoded already, and it fits the model
    else:  # another geometry's Envelope: the codec names the rule
        raw = data.data if isinstance(data, Envelope) else data
        env = decode(raw, geometry, verify_crc=False)
    if not h.env.allow_nonfinite:
        check_finite(env)
    return env


def check_tokens(
    env: Envelope, tokens: TokenInput | BlockTokens | None, parent: int
) -> BlockTokens | None:
    """The verified token ids of ``env``'s full blocks (None without ``tokens``).

    Raises:
        TokenMismatchError: they do not cover the full blocks, or a block's do not hash
            to its name (nothing is stored).
    """
    if tokens is None:
        return None
    return tokens_for(env.hashes, env.geometry.block_tokens, tokens, parent)


def _run(h: Handle, body: Callable[[WriteTxn], T], need: int) -> T:
    """Run a put-like transaction; a CRC mismatch found while writing raises the codec's
    ``ChecksumError``."""
    try:
        result = h.write(body, need, create=True)
    except CrcMismatch as exc:
        check_crc(exc.envelope.data)  # raises ChecksumError with the codec's message
        raise ChecksumError("rule 'the CRC matches' failed") from None
    if h.tier is not None:
        h.tier.uploader.wake()
    return result


def put_report(
    h: Handle, envelope: Any, tokens: TokenInput | BlockTokens | None = None, parent: int = 0
) -> PutReport:
    """``Store.put_report``: store every full block of ``envelope``, by hash."""
    env = validate(h, envelope)
    kept = check_tokens(env, tokens, parent)
    if (report := _held_already(h, env, kept is not None)) is not None:
        return report
    h.resolve(create=True)

    def body(w: WriteTxn) -> PutReport:
        h.adopt_geometry(w, env.geometry)
        return PutReport(*w.put_blocks(env, kept))

    return _run(h, body, len(env.data))


def _held_already(h: Handle, env: Envelope, with_tokens: bool = False) -> PutReport | None:
    """The report of a re-put: every full block of ``env`` is stored already, in the
    geometry ``env`` has, and, for a put carrying token ids (``with_tokens``, verified
    against the hashes by then), each has its ids kept and is announced already, so the
    write path would keep the stored ids and announce nothing (None otherwise: the write
    transaction decides).

    Nothing is written: the CRC is checked (a mismatch raises as the write path does),
    and each block's use goes to the recency buffer, as a read hit does (persisted with
    the next write or flush). So a re-put takes no write lock and waits for no fsync.
    """
    full = [x for x in env.hashes.tolist() if x != NO_HASH]
    if not full:
        return None  # nothing to store: the write path records the geometry
    txn = h.begin_read(True)  # buffers: a lookup does not copy the block
    try:
        if h.dbs.number < 0 or h.pending is not None or h.geometry_in(txn) != env.geometry:
            return None
        get, blocks = txn.get, h.dbs.blocks
        unique = set(full)
        if any(get(BLOCK_KEY.pack(x), None, blocks) is None for x in unique):
            return None
        if with_tokens and not all(announced(txn, h.dbs, x, ANNOUNCED_STORAGE) for x in unique):
            return None  # ids to keep or a block to announce: the write path does it
    finally:
        h.end_read(txn)
    check_crc(env.data)  # ChecksumError with the codec's message, as ``_run`` raises
    touch = h.recency.touch
    for x in full:
        touch(x)
    h.flush_soon()
    return PutReport([], full, len(env) - len(full))


def put_named_sequence(
    h: Handle,
    name: str,
    envelope: Any,
    tokens: TokenInput | BlockTokens | None = None,
    parent: int = 0,
) -> PutResult:
    """``Store.put_sequence``: store a named KV state, replacing any of that name."""
    key = seq_key(name)
    env = validate(h, envelope)
    check_sequence_blocks(env)
    kept = check_tokens(env, tokens, parent)
    h.resolve(create=True)

    def body(w: WriteTxn) -> PutResult:
        h.adopt_geometry(w, env.geometry)
        return PutResult(*put_sequence(w, key, env, kept))

    return _run(h, body, len(env.data))


def import_batch(
    h: Handle,
    blocks: Iterable[Any],
    sequences: Iterable[tuple[str, Any]],
    journal: RestoreJournal | None,
    tokens: Iterable[BlockTokens | None] | None = None,
) -> PutResult:
    """``Store.import_batch``: many blocks, then sequences, in ONE write transaction."""
    geometry = h.geometry
    envs: list[Envelope] = []
    for data in blocks:
        envs.append(validate(h, data, geometry))
        geometry = geometry or envs[-1].geometry
    kept: list[BlockTokens | None] = [None] * len(envs)
    if tokens is not None:
        given = list(tokens)
        if len(given) != len(envs):
            raise ValueError(f"tokens: one entry per envelope, {len(envs)}, found {len(given)}")
        kept = [check_tokens(e, t, 0) for e, t in zip(envs, given)]
    seqs: list[tuple[bytes, Envelope]] = []
    for name, data in sequences:
        key = seq_key(name)
        env = validate(h, data, geometry)
        geometry = geometry or env.geometry
        check_sequence_blocks(env)
        seqs.append((key, env))
    if envs or seqs:
        h.resolve(create=True)

    def body(w: WriteTxn) -> PutResult:
        if geometry is not None:
            h.adopt_geometry(w, geometry)
        reports = [PutReport(*w.put_blocks(e, t)) for e, t in zip(envs, kept)]
        results = [r.counts() for r in reports]
        added = [x for r in reports for x in r.stored]
        for k, e in seqs:
            if journal is not None:
                journal.note_sequence(w.txn, w.dbs, k)
                added += [x for x in e.hashes.tolist() if x != NO_HASH and not _stored(w, x)]
            results.append(PutResult(*put_sequence(w, k, e)))
        if journal is not None:
            journal.note_blocks(w.txn, w.dbs.meta, added)
        return PutResult(
            sum(r.stored for r in results),
            sum(r.duplicate for r in results),
            sum(r.partial for r in results),
        )

    need = sum(len(e.data) for e in envs) + sum(len(e.data) for _, e in seqs)
    return _run(h, body, need)


def _stored(w: WriteTxn, block_hash: int) -> bool:
    return w.txn.get(BLOCK_KEY.pack(block_hash), None, w.dbs.blocks) is not None


def delete(h: Handle, block_hash: int) -> bool:
    """``Store.delete``: remove an unpinned block; False when absent."""
    x = check_hash(block_hash)
    hk = BLOCK_KEY.pack(x)
    if not h.created():
        return False

    def body(w: WriteTxn) -> bool:
        value = w.txn.get(hk, None, w.dbs.blocks)
        if value is None:
            return False
        refs = w.txn.get(hk, None, w.dbs.refs)
        if refs is not None:
            raise PinnedError(
                f"block {x:016x} is pinned by a sequence; delete the sequences using it first"
            )
        w.remove_block(hk, x, len(value))
        return True

    removed = h.write(body)
    if removed:
        h.recency.discard(x)
    return removed


def delete_sequence(h: Handle, name: str) -> bool:
    """``Store.delete_sequence``: drop a sequence and its pins; False when absent."""
    key = seq_key(name)
    if not h.created():
        return False
    return h.write(lambda w: drop_sequence(w, key, h.geometry_in(w.txn)))
