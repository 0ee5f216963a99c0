"""SGLang <-> tlkv: ``TlkvHiCacheStorage``, an L3 storage backend of SGLang's HiCache.

tlkv as the persistent, shared, checked third tier of SGLang's hierarchical cache (GPU,
host memory, then storage)::

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "tlkv", "module_path": "kvstore.engines.sglang",
        "class_name": "TlkvHiCacheStorage", "interface_v1": 1, "target": "./tlkv-data"}'

SGLang's ``StorageBackendFactory`` imports this module and takes the class from it.
Importing the module imports no SGLang: the class is built on first access (PEP 562
``__getattr__``), which imports SGLang's ``HiCacheStorage`` (``_sglang_backend``).

Extra config (SGLang's ``--hicache-storage-backend-extra-config``; ``backend_name``,
``module_path``, ``class_name`` and ``interface_v1`` are SGLang's own): ``target`` (a store
directory, ``http://host:port`` or ``grpc://host:port``; default ``./tlkv-data``),
``model`` (the namespace's model part; default SGLang's ``model_name``), ``format`` (1,
default, or 2), ``token`` (else ``TLKV_TOKEN``), ``timeout`` (seconds per call to a
server, default 5). ``"interface_v1": 1`` makes SGLang call the zero-copy
``batch_get_v1``/``batch_set_v1`` (pages read and written straight in the host pool);
without it SGLang calls the generic ``batch_get``/``batch_set`` with flat page copies.
Both work.

Choices:

- Block name: SGLang's page key is its chained SHA-256 of the page's tokens, as 64
  lowercase hex digits (the first page's chain seeded by the request's ``extra_key`` and
  ``cache_salt``, SGLang's ``storage_namespace_seed``). Its block name is the key's first
  16 hex digits as a u64 (the 64 bits SGLang's KV events publish as a signed int64),
  1 in place of 0 (0 means "no hash" in the format). Any other key is refused
  (``PageKeyError``). Two keys share a name with probability 2^-64, tlkv's own hash's.
- Namespace: ``<model>@sglang-tp<r>of<s>[-pp<r>of<s>][-cp<r>of<s>]/<kv dtype>``
  (``namespace_for``): a tensor, pipeline or context parallel rank holds a shard of each
  page, kept apart from the other ranks'. SGLang's ``model_name`` already names the host
  pool's page format when it has one of its own. A request's ``cache_salt`` reaches the
  backend inside the key (the seeded chain): a salted page has keys no other salt and no
  unsalted request computes. When SGLang passes ``cache_salt`` in
  ``HiCacheStorageExtraInfo.extra_info``, the page also goes to a namespace of its own
  (``+salt:<16 hex digits of its SHA-256>``, the vLLM connector's rule).
- Pages: a page is one block, ``B`` = the pool's ``page_size``, ``L`` its layers,
  ``Hkv`` its heads, ``D`` its head dim, stored as format v1 (f16; bf16 and f32 pools are
  converted, exactly for f16 and for bf16 values within f16's normal range) or v2 on
  request. Read from and written to the host pool's own memory in its layout
  (``_sglang_pages``): ``layer_first`` and ``page_first`` of ``MHATokenToKVPoolHost``.
  Every other pool class (MLA, asymmetric K/V, MXFP8, hybrid), layout (``page_first_direct``,
  ``page_head``, ``page_unified``), KV dtype (fp8) and decode-context-parallel shard is
  refused at registration by name (``CacheLayoutError``: SGLang does not start the backend).
- Checked loads: every page read back passes the reader rules and its CRC-32C before
  it enters the host pool (a store's corrupt page is quarantined), and is the block asked
  for (its name, geometry and a full fill); a page that fails is a miss (``False``) and ends
  the pages read, as a missing page does.
- Failure never reaches SGLang: a target down, a refused key or a failed put is a miss
  (``0``, ``False``, ``None`` in its list) or a dropped write (``False``), counted
  (``stats()``, and ``get_stats()`` for SGLang's storage metrics) and logged once per kind.
  Lists are always lists of the keys' length.
- Tested with SGLang 0.5.23 (``TESTED_SGLANG``).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PageKeyError

if TYPE_CHECKING:
    from ._sglang_backend import TlkvHiCacheStorage

__all__ = [
    "TESTED_SGLANG",
    "TlkvHiCacheStorage",
    "block_name",
    "block_names",
    "namespace_for",
]

TESTED_SGLANG = "0.5.23"
_KEY_DIGITS = 64
_KEY = re.compile(f"[0-9a-f]{{{_KEY_DIGITS}}}")
_HEX_DIGITS = b"0123456789abcdef"
_NAME_DIGITS = 16  # the u64's hex digits; a 0 becomes 1 (FORMAT.md section 1: 0 names no block)
SMALL_BATCH = 4  # up to this many keys are parsed one by one, which costs less than the
# joined parse's fixed cost (BENCHMARKS.md, sglang)


def block_name(key: str) -> int:
    """The tlkv block name of SGLang's page key ``key`` (see the module docstring).

    Raises:
        PageKeyError: ``key`` is not 64 lowercase hex digits.
    """
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        shown = key[:80] if isinstance(key, str) else type(key).__name__
        raise PageKeyError(
            f"page key {shown!r} is not an SGLang page hash (64 lowercase hex digits)"
        )
    return int(key[:_NAME_DIGITS], 16) or 1


def block_names(keys: Sequence[str]) -> list[int]:
    """``block_name`` of each key, in order (all keys checked and converted at once).

    Raises:
        PageKeyError: naming the first key that is not an SGLang page hash.
    """
    n = len(keys)
    if n <= SMALL_BATCH:  # a first page asked alone, a short chain: no batch arrays
        return [block_name(k) for k in keys]
    try:
        raw = "".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        raw = b"?"
    if len(raw) != _KEY_DIGITS * n or raw.translate(None, _HEX_DIGITS):
        for k in keys:
            block_name(k)  # raises for the first key that is not a page hash
    firsts = np.frombuffer(raw, np.uint8).reshape(n, _KEY_DIGITS)[:, :_NAME_DIGITS]
    names = struct.unpack(f">{n}Q", bytes.fromhex(firsts.tobytes().decode()))
    return [h or 1 for h in names]


def namespace_for(
    model: str,
    kv_dtype: str,
    *,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    cp: tuple[int, int] = (0, 1),
    salt: str | None = None,
) -> str:
    """The namespace (model id) of one rank's pages of ``model`` in ``kv_dtype``.

    ``tp``, ``pp`` and ``cp`` are (rank, size) of tensor, pipeline and attention context
    parallelism; pipeline and context parts appear only when their size is above 1.
    ``salt``: a ``cache_salt`` SGLang passed beside the keys.
    """
    from ._vllm_names import namespace, salted

    shard = "sglang-tp{}of{}".format(*tp)
    for kind, (rank, size) in (("pp", pp), ("cp", cp)):
        if size > 1:
            shard += f"-{kind}{rank}of{size}"
    return salted(namespace(model, shard, kv_dtype), salt)


def salt_of(extra: Any) -> str | None:
    """The ``cache_salt`` of a call's ``HiCacheStorageExtraInfo`` (None when it has none;
    SGLang 0.5.23 folds the salt into the keys and passes none here)."""
    info = getattr(extra, "extra_info", None)
    if info is not None and isinstance(info, Mapping):  # None: no ABC check (every call)
        salt = info.get("cache_salt")
        if isinstance(salt, str) and salt:
            return salt
    return None


def __getattr__(name: str) -> Any:
    """``TlkvHiCacheStorage``, built (importing SGLang) on first access."""
    if name == "TlkvHiCacheStorage":
        from ._sglang_backend import TlkvHiCacheStorage

        globals()[name] = TlkvHiCacheStorage
        return TlkvHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
