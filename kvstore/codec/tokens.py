"""Token ids kept per block (tlkv's extension, FORMAT.md 6): the ``BlockTokens`` of an
envelope's full blocks, their check against the blocks' names, and their wire record.

A full block's name is ``H(parent, tokens)`` (FORMAT.md 1), so a writer that sends a
block's token ids and its parent's hash lets the reader prove the name: tlkv refuses a
block whose tokens do not hash to it (``TokenMismatchError`` naming the block) before
anything is stored. The tokens then travel with the block (routers recompute their own
keys from them, ``docs/events.md``).

Token record (the wire and the archive, FORMAT.md 6): ``u64 parent ‖ B × u32 token ids``,
little-endian, ``8 + 4*B`` bytes per full block, in the envelope's order of its full
blocks. Sans-IO: numpy and the hash only.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import TokenMismatchError
from .hashing import TokenInput, _as_u32_tokens, chain_hashes_array
from .layout import HEADER, HEADER_SIZE, NO_HASH, U64_MAX

__all__ = [
    "BlockTokens",
    "chain_tokens",
    "pack_records",
    "record_bytes",
    "split_records",
    "tokens_for",
    "unpack_records",
    "verify_tokens",
]

# FORMAT.md 6: a token record is the parent's u64 hash, then the block's B u32 token ids.
TOKEN_PARENT = struct.Struct("<Q")
TOKEN_ID_DTYPE = np.dtype("<u4")
PARENT_DTYPE = np.dtype("<u8")


def record_dtype(block_tokens: int) -> np.dtype:
    """The numpy dtype of one token record (packed: no padding)."""
    return np.dtype([("parent", PARENT_DTYPE), ("ids", TOKEN_ID_DTYPE, (block_tokens,))])


def record_bytes(block_tokens: int) -> int:
    """The size of one token record: ``8 + 4 * block_tokens``."""
    return TOKEN_PARENT.size + TOKEN_ID_DTYPE.itemsize * block_tokens


class BlockTokens(NamedTuple):
    """The token ids of ``n`` full blocks, one row each, and each block's parent hash.

    ``parents``: ``<u8`` of shape ``(n,)`` (0: the block starts a sequence);
    ``ids``: ``<u4`` of shape ``(n, B)``.
    """

    parents: np.ndarray
    ids: np.ndarray

    @property
    def n_blocks(self) -> int:
        """How many blocks."""
        return int(self.parents.shape[0])

    @property
    def block_tokens(self) -> int:
        """B, the token ids per block."""
        return int(self.ids.shape[1])

    def take(self, rows: Any) -> BlockTokens:
        """The blocks at ``rows`` (indices or a boolean mask), in that order."""
        return BlockTokens(self.parents[rows], self.ids[rows])


def chain_tokens(
    token_ids: TokenInput, hashes: Any, block_tokens: int, parent: int = NO_HASH
) -> BlockTokens:
    """``BlockTokens`` of blocks that form one chain: block 0's parent is ``parent``,
    block i's the block before it (``hashes[i-1]``); row i holds ``token_ids[i*B:(i+1)*B]``.

    Args:
        token_ids: the blocks' token ids in order, ``len(hashes) * B`` of them; up to
            ``B - 1`` more may follow (a prompt's partial tail: they name no block and are
            not kept).
        hashes: the blocks' hashes (the envelope's full blocks).
        block_tokens: B.
        parent: the hash of the block before the first (0: the start of a sequence).

    Raises:
        TokenMismatchError: the number of ids does not fit the blocks.
        ValueError: an id does not fit u32, or ``parent`` does not fit u64.
    """
    if not 0 <= parent <= U64_MAX:
        raise ValueError(f"a parent hash must fit u64, found {parent}")
    ids = _as_u32_tokens(token_ids)
    full = np.asarray(hashes, dtype=PARENT_DTYPE).reshape(-1)
    n = int(full.size)
    need = n * block_tokens
    if not need <= len(ids) < need + block_tokens:
        raise TokenMismatchError(
            f"rule 'token ids cover the envelope's full blocks' failed: {n} full blocks of "
            f"{block_tokens} tokens take {need} token ids (and at most {block_tokens - 1} "
            f"of a partial tail), found {len(ids)}"
        )
    parents = np.empty(n, dtype=PARENT_DTYPE)
    if n:
        parents[0] = parent
        parents[1:] = full[:-1]
    return BlockTokens(parents, ids[:need].reshape(n, block_tokens))


def verify_tokens(hashes: Any, tokens: BlockTokens) -> None:
    """Check every block's name: ``hashes[i] == H(tokens.parents[i], tokens.ids[i])``.

    Runs of blocks chained to the one before are hashed in one pass each (the compiled
    chain kernel), so a whole prompt costs one pass over its token ids.

    Raises:
        TokenMismatchError: a block's tokens and parent do not hash to its hash (the first
            such block, by position and hash), or the counts differ.
    """
    full = np.asarray(hashes, dtype=PARENT_DTYPE).reshape(-1)
    n = int(full.size)
    if tokens.n_blocks != n:
        raise TokenMismatchError(
            f"rule 'token ids cover the envelope's full blocks' failed: {n} full blocks, "
            f"token ids for {tokens.n_blocks}"
        )
    if not n:
        return
    b = tokens.block_tokens
    starts = [0, *(np.flatnonzero(tokens.parents[1:] != full[:-1]) + 1).tolist(), n]
    for s, e in itertools.pairwise(starts):
        parent = int(tokens.parents[s])
        got = chain_hashes_array(tokens.ids[s:e].reshape(-1), b, parent)
        bad = np.flatnonzero(got != full[s:e])
        if bad.size:
            i = s + int(bad[0])
            raise TokenMismatchError(
                f"rule 'a block's hash is H(parent, tokens)' failed at full block {i} "
                f"({int(full[i]):016x}): its token ids and parent {int(tokens.parents[i]):016x} "
                f"hash to {int(got[bad[0]]):016x}",
                block_hash=int(full[i]),
            )


def tokens_for(
    env_hashes: np.ndarray,
    block_tokens: int,
    token_ids: TokenInput | BlockTokens,
    parent: int = NO_HASH,
) -> BlockTokens:
    """The verified ``BlockTokens`` of an envelope's full blocks (``env_hashes != 0``).

    ``token_ids``: a ``BlockTokens`` (one row per full block), or the 1-D token ids of the
    full blocks read as one chain from ``parent`` (``chain_tokens``).

    Raises:
        TokenMismatchError: the ids do not cover the full blocks, or a name does not match.
    """
    full_mask = env_hashes != NO_HASH
    full = env_hashes[full_mask]
    if isinstance(token_ids, BlockTokens):
        tokens = token_ids
        if tokens.n_blocks and tokens.block_tokens != block_tokens:
            raise TokenMismatchError(
                f"rule 'a token record holds block_tokens ids' failed: expected "
                f"{block_tokens}, found {tokens.block_tokens}"
            )
    else:
        tokens = chain_tokens(token_ids, full, block_tokens, parent)
    verify_tokens(full, tokens)
    return tokens


def pack_records(tokens: BlockTokens) -> bytes:
    """The token records of ``tokens``, in order (FORMAT.md 6)."""
    out = np.empty(tokens.n_blocks, dtype=record_dtype(tokens.block_tokens))
    out["parent"] = tokens.parents
    out["ids"] = tokens.ids
    return out.tobytes()


def unpack_records(data: Any, block_tokens: int) -> BlockTokens:
    """``BlockTokens`` from token records (views into ``data``, no copy).

    Raises:
        TokenMismatchError: the length is not a whole number of records.
    """
    size = record_bytes(block_tokens)
    mv = memoryview(data).cast("B")
    if len(mv) % size:
        raise TokenMismatchError(
            f"rule 'token records are 8 + 4*B bytes each' failed: {len(mv)} bytes is not a "
            f"multiple of {size} (B = {block_tokens})"
        )
    rec = np.frombuffer(mv, dtype=record_dtype(block_tokens))
    return BlockTokens(rec["parent"], rec["ids"])


def split_records(body: Any, records: int) -> tuple[Any, BlockTokens | None]:
    """A body of an envelope followed by ``records`` token records: the envelope's part
    and the records (None when there are none; a body shorter than a header is left to
    the envelope's rules). B is read from the envelope's header."""
    if not records or len(body) < HEADER_SIZE:
        return body, None
    b = HEADER.unpack_from(body)[4]
    mv = memoryview(body).cast("B")
    size = records * record_bytes(b)
    return mv[: len(mv) - size], unpack_records(mv[len(mv) - size :], b)


def concat(parts: Sequence[BlockTokens], block_tokens: int) -> BlockTokens:
    """The blocks of ``parts``, in order, as one ``BlockTokens``."""
    if not parts:
        return BlockTokens(np.zeros(0, PARENT_DTYPE), np.zeros((0, block_tokens), TOKEN_ID_DTYPE))
    return BlockTokens(
        np.concatenate([p.parents for p in parts]), np.concatenate([p.ids for p in parts])
    )
