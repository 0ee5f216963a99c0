"""CRC-32C (Castagnoli) over any buffer, at hardware speed.

The kernel is chosen once, at import, from the CPU's features; ``KERNEL`` names it
(``tlkv --version`` and ``GET /v1/info`` report it):

- the compiled kernels of ``kvstore.codec._native``, best first: ``vpclmulqdq-avx512``
  (512-bit VPCLMULQDQ folding), ``vpclmulqdq-avx2`` (256-bit VPCLMULQDQ folding beside
  three CRC32-instruction streams), ``sse4.2-pclmul`` (the same with 128-bit PCLMULQDQ),
  all x86-64;
- where the build has only the portable ``slicing-by-8`` tables (another architecture, or
  an x86 CPU without PCLMULQDQ), the ``crc32c`` package when it runs on the CPU's own CRC
  instructions (e.g. ARMv8 CRC32): ``crc32c-package``;
- without the compiled module, the ``crc32c`` package (``crc32c-package`` or, when it has
  no hardware path either, ``crc32c-package-software``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .layout import TRAILER

try:
    from . import _native
except ImportError:  # pragma: no cover - only where the build had no compiler
    _native = None  # type: ignore[assignment]

PORTABLE_KERNEL = "slicing-by-8"


def _choose() -> tuple[Callable[..., int], str]:
    """The fastest CRC-32C available here and its name (see the module docstring)."""
    name = _native.crc32c_kernel() if _native is not None else None
    if name is not None and name != PORTABLE_KERNEL:
        return _native.crc32c, name
    import crc32c as package

    if package.hardware_based:
        return package.crc32c, "crc32c-package"
    if name is not None:
        return _native.crc32c, name
    return package.crc32c, "crc32c-package-software"  # pragma: no cover


_crc32c, KERNEL = _choose()


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes, bytearray, memoryview, mmap, numpy), continuing ``crc``.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``crc32c(b"123456789") == 0xE3069283``.

    Raises:
        BufferError: ``data`` is not C-contiguous.
    """
    return int(_crc32c(data, crc))


def join_crc(parts: Sequence[Any]) -> bytes:
    """``b"".join(parts)`` followed by its CRC-32C as the envelope's ``TRAILER``; parts are
    C-contiguous buffers or strided ones (numpy views, read in C order).

    The compiled kernel copies and checksums each part in one pass (fused with the copy
    where the kernel has a twin, else in cache-sized chunks); elsewhere a CRC pass, then
    one join.
    """
    if _native is not None and _crc32c is _native.crc32c:
        return _native.join_crc(parts)
    # strided parts (numpy views) are read in C order, as the compiled join does
    parts = [p if memoryview(p).c_contiguous else np.ascontiguousarray(p) for p in parts]
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    return b"".join([*parts, TRAILER.pack(crc)])


def join_crc_into(parts: Sequence[Any], out: Any) -> int:
    """``join_crc(parts)``'s bytes written into the writable C-contiguous buffer ``out``
    from its start; the number of bytes written (the parts' total + 4).

    The compiled kernel copies and checksums in one pass; elsewhere a copy of each part,
    then a CRC pass over what was written.

    Raises:
        ValueError: ``out`` is smaller than the result, or a part's memory overlaps it
            (nothing written).
        BufferError: ``out`` is read-only or not C-contiguous (numpy's arrays raise
            ValueError for the latter).
    """
    if _native is not None and _crc32c is _native.crc32c:
        return int(_native.join_crc_into(parts, out))
    arrays = [p if isinstance(p, np.ndarray) else np.asarray(memoryview(p)) for p in parts]
    total = sum(a.nbytes for a in arrays)
    room = memoryview(out)
    if room.readonly or not room.c_contiguous:
        raise BufferError("join_crc_into: out is not a writable C-contiguous buffer")
    room = room.cast("B")
    if len(room) < total + TRAILER.size:
        raise ValueError(
            f"join_crc_into: out holds {len(room)} bytes, the parts and their CRC "
            f"{total + TRAILER.size}"
        )
    dst = np.frombuffer(room, np.uint8, total + TRAILER.size)
    for i, a in enumerate(arrays):
        if a.nbytes and np.may_share_memory(dst, a):
            raise ValueError(f"join_crc_into: part {i} overlaps out")
    at = 0
    for a in arrays:  # strided parts are read in C order, as the compiled join does
        np.copyto(dst[at : at + a.nbytes].view(a.dtype).reshape(a.shape), a)
        at += a.nbytes
    TRAILER.pack_into(room, at, crc32c(room[:at]))
    return at + TRAILER.size


def _envelope_blocks(
    name: str, mvs: Sequence[memoryview], offset: int, payload: int, record_bytes: int | None
) -> list[int]:
    """Each envelope's block count: one (``record_bytes`` None) or ``k >= 1`` payloads of
    ``payload`` bytes ``record_bytes`` apart from ``offset``, then the trailer (the compiled
    ``envelope_blocks``'s rules and words).

    Raises:
        ValueError: an envelope shorter than one payload, or not a whole number of blocks.
    """
    counts = []
    for i, mv in enumerate(mvs):
        if not payload or len(mv) < offset + payload + TRAILER.size:
            raise ValueError(
                f"{name}: envelope {i} has {len(mv)} bytes, fewer than its payload needs"
            )
        if record_bytes is None:
            counts.append(1)
            continue
        k, extra = divmod(len(mv) - offset - TRAILER.size + record_bytes, payload + record_bytes)
        if extra:
            raise ValueError(
                f"{name}: envelope {i} has {len(mv)} bytes, not a whole number of blocks"
            )
        counts.append(k)
    return counts


def _checked_payloads(
    name: str,
    envelopes: Sequence[Any],
    offset: int,
    payload: int,
    record_bytes: int | None,
    blocks: int,
    what: str,
) -> Iterator[tuple[memoryview, int]]:
    """Each block's envelope and payload offset, in order, envelope by envelope while each
    envelope's CRC-32C matches (the fallbacks' check-then-copy); stops before the first
    that does not.

    Raises:
        ValueError: an envelope shorter than one payload or not a whole number of blocks,
            or the envelopes holding other than ``blocks`` blocks (``what``: what the
            caller gave, for the message).
    """
    mvs = [memoryview(env).cast("B") for env in envelopes]
    counts = _envelope_blocks(name, mvs, offset, payload, record_bytes)
    if sum(counts) != blocks:
        raise ValueError(f"{name}: the envelopes hold {sum(counts)} blocks, {blocks} {what}")
    stride = payload + (record_bytes or 0)
    for mv, k in zip(mvs, counts, strict=True):
        (stored,) = TRAILER.unpack_from(mv, len(mv) - TRAILER.size)
        if crc32c(mv[: len(mv) - TRAILER.size]) != stored:
            return
        for j in range(k):
            yield mv, offset + j * stride


def scatter_crc(
    envelopes: Sequence[Any],
    payload_offset: int,
    layers: Sequence[np.ndarray],
    block_ids: Sequence[int],
    n_heads: int,
    run_bytes: int,
    record_bytes: int | None = None,
    key_tokens: int = 0,
) -> int:
    """Copy envelopes' block payloads, run by run, to their slots in per-layer arrays (a
    paged KV cache's layout), each envelope's CRC-32C checked in the same pass; returns how
    many leading blocks are in envelopes that matched their CRC.

    A block's payload is ``[L][2][n_heads][run_bytes]``; an envelope's first payload is at
    ``payload_offset`` and its CRC (the trailer) covers every byte before the trailer.
    ``record_bytes`` None: each envelope holds one block. ``record_bytes >= 0``: an
    envelope holds ``k >= 1`` blocks whose payloads are ``record_bytes`` apart (a joined
    envelope: the next block's record sits between them), its length exactly
    ``payload_offset + k * payload + (k - 1) * record_bytes + 4``. ``layers`` are the
    ``L`` writable C-contiguous per-layer caches ``[num_blocks][n_heads][2][run_bytes]``
    (any dtype); the ``i``-th block of the envelopes, in order, goes to block
    ``block_ids[i]`` of each. The copy stops at the first envelope whose CRC does not
    match, whose blocks may then be partly written: the caller must treat them and the
    blocks after them as not loaded. ``key_tokens`` ``B > 0``: each K run is ``B`` rows
    of 2-byte elements and is written as its transpose, ``D`` rows of ``B`` (vLLM's CPU
    "vec" layout keeps a block's keys so); the CRC covers the run as the envelope holds
    it.

    The compiled kernel copies each 2-D run and checksums it in one pass; elsewhere the CRC
    of each envelope is checked before its copy.

    Raises:
        ValueError: ids outside the layers' blocks, layers of unequal block counts, an
            envelope shorter than its payload or not a whole number of blocks, or a block
            id count other than the envelopes' blocks.
    """
    if _native is not None and _crc32c is _native.crc32c:
        return int(
            _native.scatter_crc(
                envelopes,
                payload_offset,
                layers,
                block_ids,
                n_heads,
                run_bytes,
                record_bytes,
                key_tokens,
            )
        )
    n_layers = len(layers)
    if (record_bytes is None and len(block_ids) != len(envelopes)) or n_layers < 1:
        raise ValueError("scatter_crc: one block id per envelope and at least one layer")
    if record_bytes is not None and record_bytes < 0:
        raise ValueError("scatter_crc: record_bytes None or >= 0")
    if key_tokens < 0 or (key_tokens and run_bytes % (2 * key_tokens)):
        raise ValueError(
            "scatter_crc: key_tokens >= 0, and run_bytes a whole number of rows of "
            "key_tokens 2-byte elements"
        )
    views = [np.asarray(layer).reshape(-1).view(np.uint8) for layer in layers]
    per_block = n_heads * 2 * run_bytes
    if any(v.size % per_block or v.size != views[0].size for v in views):
        raise ValueError("scatter_crc: every layer must hold the same whole number of blocks")
    n_blocks = views[0].size // per_block
    shaped = [v.reshape(n_blocks, n_heads, 2, run_bytes) for v in views]
    payload = n_layers * per_block
    for block in block_ids:
        if not 0 <= block < n_blocks:
            raise ValueError(f"scatter_crc: block id {block} is not in 0..{n_blocks - 1}")
    done = 0
    for mv, at in _checked_payloads(
        "scatter_crc", envelopes, payload_offset, payload, record_bytes,
        len(block_ids), "block ids given",
    ):  # fmt: skip
        src = np.frombuffer(mv, np.uint8, payload, at).reshape(n_layers, 2, n_heads, run_bytes)
        for layer, part in zip(shaped, src, strict=True):
            slot = layer[block_ids[done]]  # [n_heads][2][run_bytes]
            slot[:, 1] = part[1]
            if key_tokens:
                keys = part[0].view(np.uint16).reshape(n_heads, key_tokens, -1)
                slot[:, 0].view(np.uint16)[:] = keys.transpose(0, 2, 1).reshape(n_heads, -1)
            else:
                slot[:, 0] = part[0]
        done += 1
    return done


def scatter_crc_views(
    envelopes: Sequence[Any],
    payload_offset: int,
    blocks: Sequence[np.ndarray],
    record_bytes: int | None = None,
) -> int:
    """Copy envelopes' block payloads into ``blocks``, one writable array per block of the
    envelopes, in order, each envelope's CRC-32C checked in the same pass; returns how many
    leading blocks are in envelopes that matched their CRC.

    A block's payload is ``[L][2][H][B][D]`` of 2-byte elements, copied as they are (f16
    into f16: no conversion); each of ``blocks`` has that shape, itemsize 2 and any strides
    whose last axis is contiguous (an engine's page seen through a transposed view, as
    SGLang's host pool pages are). ``payload_offset`` and ``record_bytes`` are as for
    ``scatter_crc``. The copy stops at the first envelope whose CRC does not match, whose
    blocks may then be partly written: the caller treats them and the blocks after them
    as not loaded.

    The compiled kernel checksums each ``[B][D]`` run of the envelope and copies its rows
    while they are in L1; elsewhere the CRC of each envelope is checked before its copy.

    Raises:
        ValueError: a block of another shape, itemsize or layout, an envelope shorter than
            its payload or not a whole number of blocks, or a block count other than the
            envelopes'.
    """
    if _native is not None and _crc32c is _native.crc32c:
        return int(_native.scatter_crc_views(envelopes, payload_offset, blocks, record_bytes))
    if record_bytes is None and len(blocks) != len(envelopes):
        raise ValueError("scatter_crc_views: one block per envelope")
    if payload_offset < 0 or (record_bytes is not None and record_bytes < 0):
        raise ValueError("scatter_crc_views: payload_offset >= 0, record_bytes None or >= 0")
    arrays = [np.asarray(b) for b in blocks]
    for i, a in enumerate(arrays):
        if a.ndim != 5 or a.itemsize != 2 or a.strides[4] != 2 or not a.flags.writeable:
            raise ValueError(
                f"scatter_crc_views: block {i} is not a writable 5-D array of 2-byte "
                f"elements whose last axis is contiguous"
            )
        if a.shape != arrays[0].shape:
            raise ValueError(f"scatter_crc_views: block {i}'s shape differs from block 0's")
        if a.shape[1] != 2:
            raise ValueError("scatter_crc_views: blocks are [L][2][H][B][D]")
    payload = arrays[0].size * 2 if arrays else 0
    if arrays and payload == 0:
        raise ValueError("scatter_crc_views: blocks of no elements")
    done = 0
    for mv, at in _checked_payloads(
        "scatter_crc_views", envelopes, payload_offset, payload, record_bytes,
        len(arrays), "blocks given",
    ):  # fmt: skip
        dst = arrays[done]
        np.copyto(dst, np.frombuffer(mv, dst.dtype, dst.size, at).reshape(dst.shape))
        done += 1
    return done
