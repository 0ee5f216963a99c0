"""SGLang's HiCache host pool <-> tlkv blocks: which pools and layouts are read, where a
page lies in the pool's memory, and the copies between a page and a block.

A page is one block ``[L][2][Hkv][B][D]`` (``B`` = the pool's ``page_size``). The two
layouts of ``MHATokenToKVPoolHost`` (SGLang 0.5.23, ``pool_host/mha.py``) that a dense
MHA model uses keep the pool as one tensor ``kv_buffer``:

- ``layer_first``: ``[2][L][size][Hkv][D]``; a page at token index ``t`` is
  ``kv_buffer[:, :, t:t+B]``, and its flat copy (``get_data_page``) ``[2][L][B][Hkv][D]``;
- ``page_first``: ``[2][size][L][Hkv][D]``; a page is ``kv_buffer[:, t:t+B]``, its flat
  copy ``[2][B][L][Hkv][D]``.

A block is a transposed numpy view of either (no copy); a save copies f16 pages straight
into an envelope buffer used again. A load copies stored v1 envelopes into f16 pages with
each CRC checked in the same pass (``PageSlots.scatter_envelopes``); other blocks are
checked first, then written into their pages with one strided copy each. Every fact
relied on is checked against the registered pool (class, layout, dtype, the buffer's
shape, where ``get_data_page`` points) or refused with ``CacheLayoutError``. torch is
imported only when a pool is registered.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ..codec.assembly import pack_header
from ..codec.checksum import join_crc_into, scatter_crc_views
from ..codec.envelope import Block, BlockView, encode
from ..codec.geometry import Geometry
from ..codec.layout import (
    HEADER_SIZE,
    RECORD,
    RECORD_SIZE,
    VERSION_V1,
)
from ..errors import CacheLayoutError

__all__ = ["KNOWN_LAYOUTS", "KNOWN_POOLS", "HostPages", "PageSlots"]

# exactly these classes: a subclass (asymmetric K/V, MXFP8...) lays its pages out otherwise
KNOWN_POOLS = ("MHATokenToKVPoolHost",)
KNOWN_LAYOUTS = ("layer_first", "page_first")
_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
           "float32": np.dtype(np.float32)}  # fmt: skip
# block axes [L][2][Hkv][B][D] from a page's axes, per layout: layer_first pages are
# [2][L][B][Hkv][D], page_first pages [2][B][L][Hkv][D]
_TO_BLOCK = {"layer_first": (1, 0, 3, 2, 4), "page_first": (2, 0, 3, 1, 4)}
_CHUNK_BYTES = 64 << 20  # one envelope (one put, one commit) of a save holds at most this


class HostPages:
    """The pages of one registered ``MHATokenToKVPoolHost`` as block views.

    Raises:
        CacheLayoutError: the pool is not one whose pages this reads exactly (naming why).
    """

    def __init__(self, pool: Any) -> None:
        kind = type(pool).__name__
        if kind not in KNOWN_POOLS:
            raise CacheLayoutError(
                f"host pool {kind} is not read (known: {', '.join(KNOWN_POOLS)}): MLA, "
                f"asymmetric K/V, MXFP8 and hybrid pools lay pages out otherwise"
            )
        layout = str(pool.layout)
        if layout not in KNOWN_LAYOUTS:
            raise CacheLayoutError(
                f"host pool layout {layout!r} is not read (known: {', '.join(KNOWN_LAYOUTS)})"
            )
        if getattr(pool, "dcp_size", 1) != 1:
            raise CacheLayoutError(
                f"decode-context-parallel shards (dcp_size={pool.dcp_size}) are not read"
            )
        if pool.head_dim != pool.v_head_dim:
            raise CacheLayoutError(
                f"K head dim {pool.head_dim} != V head dim {pool.v_head_dim} is not read"
            )
        dtype = str(pool.dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            raise CacheLayoutError(
                f"KV dtype {dtype} is not read (known: {', '.join(_DTYPES)}; a quantized "
                f"cache is refused)"
            )
        g = Geometry(int(pool.page_size), int(pool.layer_num), int(pool.head_num),
                     int(pool.head_dim))  # fmt: skip
        self.pool = pool
        self.layout = layout
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]
        self.geometry = g
        self._buffer = self._numpy(pool.kv_buffer, "kv_buffer", self._buffer_shape(pool))
        self._local = threading.local()
        self._check_data_page()

    # --- what the pool is --------------------------------------------------------------

    def _buffer_shape(self, pool: Any) -> tuple[int, ...]:
        g = self.geometry
        size = int(pool.size)
        if self.layout == "layer_first":
            return (2, g.n_layers, size, g.n_kv_heads, g.head_dim)
        return (2, size, g.n_layers, g.n_kv_heads, g.head_dim)

    def _page_shape(self) -> tuple[int, ...]:
        g = self.geometry
        if self.layout == "layer_first":
            return (2, g.n_layers, g.block_tokens, g.n_kv_heads, g.head_dim)
        return (2, g.block_tokens, g.n_layers, g.n_kv_heads, g.head_dim)

    def _numpy(self, t: Any, what: str, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy view sharing ``t``'s memory, after checking its shape, dtype, device
        and contiguity (bf16 through int16)."""
        import torch

        if not isinstance(t, torch.Tensor):
            raise CacheLayoutError(f"{what} is a {type(t).__name__}, not a torch tensor")
        found = (tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type)
        if found != (shape, self.dtype_name, "cpu") or not t.is_contiguous():
            raise CacheLayoutError(
                f"{what} of shape {found[0]}, {found[1]} on {found[2]} (contiguous="
                f"{t.is_contiguous()}), expected {shape}, {self.dtype_name} on cpu, contiguous"
            )
        if t.dtype == torch.bfloat16:
            return np.asarray(t.view(torch.int16).numpy()).view(ml_dtypes.bfloat16)
        return np.asarray(t.numpy())

    def _check_data_page(self) -> None:
        """``get_data_page`` of the second page is the part of ``kv_buffer`` this reads."""
        b = self.geometry.block_tokens
        if self._buffer.shape[1 if self.layout == "page_first" else 2] < 2 * b:
            raise CacheLayoutError(f"host pool holds fewer than two pages of {b} tokens")
        page = self.pool.get_data_page(b, flat=False)
        mine = self.page(b)
        if tuple(page.shape) != self._page_shape() or page.data_ptr() != mine.ctypes.data:
            raise CacheLayoutError(
                f"get_data_page({b}) is {tuple(page.shape)} at another place than the "
                f"{self.layout} page {self._page_shape()} this reads"
            )

    # --- pages -------------------------------------------------------------------------

    def page(self, start: int) -> np.ndarray:
        """The page at token index ``start`` as a writable ``[L][2][Hkv][B][D]`` view."""
        b = self.geometry.block_tokens
        if self.layout == "layer_first":
            window = self._buffer[:, :, start : start + b]
        else:
            window = self._buffer[:, start : start + b]
        return window.transpose(_TO_BLOCK[self.layout])

    def page_starts(self, host_indices: Any, n_pages: int) -> list[int]:
        """The token index of each of ``n_pages`` pages in SGLang's ``host_indices`` (one
        index per token, page ``i`` at ``[i*B, (i+1)*B)``).

        Raises:
            CacheLayoutError: the indices are not ``n_pages`` whole pages of the pool, each
                ``B`` consecutive tokens from a multiple of ``B``.
        """
        b = self.geometry.block_tokens
        idx = np.asarray(host_indices.cpu().numpy() if hasattr(host_indices, "cpu")
                         else host_indices, dtype=np.int64)  # fmt: skip
        if idx.shape != (n_pages * b,):
            raise CacheLayoutError(
                f"host_indices of shape {idx.shape} for {n_pages} pages of {b} tokens"
            )
        pages = idx.reshape(n_pages, b)
        starts = pages[:, 0]
        size = self._buffer.shape[1 if self.layout == "page_first" else 2]
        if n_pages and (
            (starts % b).any()
            or (pages != starts[:, None] + np.arange(b)).any()
            or starts.min() < 0
            or starts.max() + b > size
        ):
            raise CacheLayoutError("host_indices are not whole pages of the host pool")
        return [int(s) for s in starts]

    def flat(self, tensor: Any) -> np.ndarray:
        """A flat page copy SGLang hands over or asks to fill (``get_data_page(flat=True)``,
        ``get_dummy_flat_data_page``), as a ``[L][2][Hkv][B][D]`` view of its memory.

        Raises:
            CacheLayoutError: its size, dtype or place is not a page of this pool.
        """
        arr = self._numpy(tensor, "flat page", (self.geometry.elements,))
        return arr.reshape(self._page_shape()).transpose(_TO_BLOCK[self.layout])

    # --- copies ------------------------------------------------------------------------

    def envelopes(
        self, names: Sequence[int], pages: Sequence[np.ndarray], version: int
    ) -> Iterator[Any]:
        """Envelopes of ``pages`` (block views) named ``names``, at most ``_CHUNK_BYTES``
        each (one page at least): each is valid until the next is asked for.

        f16 pages in v1 are copied straight into a buffer of this thread that is used
        again (memory the process has touched already: a new 128 MiB ``bytes`` costs
        32,768 page faults) and checksummed in the same pass (``join_crc_into``: a page's
        rows, read through its transposed view, are checksummed while the copy is in
        cache); other dtypes and v2 are encoded by the codec (converted, quantized).
        Values are checked where the envelope is put.
        """
        g = self.geometry
        per = max(1, (_CHUNK_BYTES - g.envelope_bytes(0)) // g.record_bytes(version))
        for first in range(0, len(names), per):
            chunk = range(first, min(first + per, len(names)))
            if self.dtype != np.float16 or version != VERSION_V1:
                blocks = [Block(int(names[i]), g.block_tokens, pages[i]) for i in chunk]
                yield encode(g, blocks, version)
                continue
            size = g.envelope_bytes(len(chunk))
            out = memoryview(self._scratch(size))[:size]
            parts: list[Any] = [pack_header(VERSION_V1, g, len(chunk))]
            for i in chunk:
                if pages[i].shape != g.kv_shape:
                    raise CacheLayoutError(
                        f"page {i} has shape {pages[i].shape}, a block of this pool {g.kv_shape}"
                    )
                parts += [RECORD.pack(int(names[i]), g.block_tokens), pages[i]]
            join_crc_into(parts, out)
            yield out

    def _scratch(self, size: int) -> bytearray:
        """This thread's envelope buffer, at least ``size`` bytes (grown, never shrunk)."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = bytearray(size)
        return buf

    def fill(self, dst: np.ndarray, bv: BlockView) -> None:
        """Copy a checked block into the page view ``dst`` (converted to the pool's dtype;
        v2 dequantized)."""
        if bv.version == VERSION_V1:
            np.copyto(dst, bv.kv, casting="unsafe")
        else:
            np.copyto(dst, bv.to_float32(), casting="unsafe")


class PageSlots:
    """Pages of a host pool, or SGLang's flat page copies, as the numbered slots a
    target's ``load`` copies blocks into (``targets.BlockSlots``): slot ``i`` is
    ``pages[i]``, a ``[L][2][Hkv][B][D]`` view from ``HostPages.page`` or ``.flat``."""

    def __init__(self, host: HostPages, pages: Sequence[np.ndarray]) -> None:
        self.host = host
        self.geometry = host.geometry
        self.pages = pages

    def scatter(self, views: Sequence[BlockView], slot_ids: Sequence[int]) -> int:
        """Copy checked views into their pages (converted to the pool's dtype, v2
        dequantized); returns the payload bytes read.

        Raises:
            CacheLayoutError: a view is not a full block of the pool's geometry (checked for
                all before any is copied).
        """
        g = self.geometry
        for i, bv in enumerate(views):
            if bv.geometry != g or bv.n_tokens != g.block_tokens:
                raise CacheLayoutError(
                    f"block {i} has geometry {bv.geometry.as_tuple()} and {bv.n_tokens} "
                    f"tokens, the pool's pages are {g.as_tuple()} (full pages)"
                )
        for bv, slot in zip(views, slot_ids):
            self.host.fill(self.pages[slot], bv)
        return sum(len(bv.raw) for bv in views)

    def scatter_envelopes(
        self, envelopes: Sequence[Any], slot_ids: Sequence[int], *, joined: bool = False
    ) -> int | None:
        """Copy v1 envelopes of full blocks of the pool's geometry (every reader rule but
        the CRC checked by the caller) into their pages, each CRC checked in the same pass
        (``scatter_crc_views``); returns how many leading blocks are in place (the blocks of
        an envelope whose CRC fails may be partly written: they and the ones after them are
        not loaded). None for a pool that is not f16 on a little-endian CPU: checked views
        and ``scatter`` then convert."""
        if self.host.dtype != np.float16 or sys.byteorder != "little":
            return None
        return scatter_crc_views(
            envelopes,
            HEADER_SIZE + RECORD_SIZE,
            [self.pages[slot] for slot in slot_ids],
            RECORD_SIZE if joined else None,
        )
