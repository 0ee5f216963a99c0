"""``TlkvHiCacheStorage``: the class SGLang's ``StorageBackendFactory`` loads (see
``kvstore.engines.sglang`` for the configuration and the choices). This module imports
SGLang; ``kvstore.engines.sglang`` imports it on first access to the class.

SGLang 0.5.23's HiCache controller (``managers/cache_controller.py``) calls, from its
prefetch and backup threads: ``batch_exists(keys, extra_info) -> int`` (the leading run
held), then ``batch_get_v1(keys, host_indices, extra_info) -> list[bool]`` (with
``"interface_v1": 1``) or ``batch_get(keys, flat_pages) -> list[tensor | None]``, and
``batch_set_v1(keys, host_indices, extra_info) -> list[bool]`` or ``batch_set(keys,
flat_pages) -> bool``. Keys come in batches of at most 128 pages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..codec.layout import SUPPORTED_VERSIONS
from ..errors import CacheLayoutError, ShapeError
from ..store.memory import KEPT_BYTES, keep_freed_memory
from ._sglang_pages import HostPages, PageSlots
from ._sglang_target import PageTarget, open_page_target
from .sglang import TESTED_SGLANG, block_name, block_names, namespace_for, salt_of
from .targets import store_options

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvstore.engines.sglang.TlkvHiCacheStorage needs SGLang (tested with "
        f"sglang=={TESTED_SGLANG}): {exc}"
    ) from exc

__all__ = ["TlkvHiCacheStorage"]

log = logging.getLogger("sglang.tlkv")

_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_OWN_KEYS = frozenset(
    {"target", "model", "format", "token", "timeout", "sync", "keep_freed_memory", "preallocate"}
)
COUNTERS = (
    "pages_loaded",  # pages copied into the host pool, checked
    "pages_missed",  # pages asked for and not loaded: absent, evicted or failing a check
    "pages_saved",  # pages stored
    "pages_present",  # pages a save found stored already
    "pages_dropped",  # pages a save could not store (a target down, a value refused)
    "lookup_errors",  # batch_exists/exists calls that failed (answered 0 / False)
    "load_errors",  # get calls that failed (answered with misses)
    "save_errors",  # set calls that failed (answered False)
    "keys_refused",  # calls whose keys are not SGLang page hashes
)


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # an SGLang run from a source tree has no distribution
        return "unknown"


class TlkvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """tlkv as SGLang's HiCache storage backend (see ``kvstore.engines.sglang``).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, ``model_name``, the
            extra config).
        kwargs: the factory's extra arguments (a dict; none is read).

    Raises:
        CacheLayoutError: an MLA model, split heads, or no model name to key pages on.
        ValueError: a ``format`` other than 1 or 2, a ``sync`` other than 1 or 0, a
            ``preallocate`` other than an int of bytes >= 0 (``targets.store_options``).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OWN_KEYS)
        if unknown:
            log.warning("tlkv HiCache storage: extra config keys not read: %s", unknown)
        if storage_config.is_mla_model:
            raise CacheLayoutError("MLA (latent KV) pages are not read")
        if storage_config.should_split_heads:
            raise CacheLayoutError("pages split by heads (tp_lcm_size) are not read")
        model = extra.get("model") or storage_config.model_name
        if not model:
            raise CacheLayoutError(
                "no model name to keep pages apart by: SGLang passed none; set the extra "
                "config's 'model'"
            )
        self.version = int(extra.get("format", 1))
        if self.version not in SUPPORTED_VERSIONS:
            raise ValueError(f"tlkv 'format' must be 1 or 2, found {self.version}")
        self.target_spec = str(extra.get("target", "./tlkv-data"))
        self.token = extra.get("token") or os.environ.get("TLKV_TOKEN")
        self.timeout = float(extra.get("timeout", 5.0))
        self.sync, self.preallocate = store_options(extra)
        keep = extra.get("keep_freed_memory", 1)
        if keep not in (0, 1):
            raise ValueError(f"tlkv 'keep_freed_memory' must be 1 or 0, found {keep!r}")
        self.keep_freed_memory = bool(keep)
        self.model = str(model)
        self.config = storage_config
        self.pages: HostPages | None = None
        self.namespace: str | None = None
        self._targets: dict[str, PageTarget] = {}
        self._targets_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }  # fmt: skip
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        if _sglang_version() != TESTED_SGLANG:
            log.warning(
                "tlkv's HiCache storage is tested with SGLang %s, found %s",
                TESTED_SGLANG,
                _sglang_version(),
            )

    # --- registration ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's pages; refuse (raise) a pool they cannot be read from
        exactly, and a target namespace that holds another geometry."""
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        cfg = self.config
        self.namespace = namespace_for(
            self.model,
            pages.dtype_name,
            tp=(cfg.tp_rank, cfg.tp_size),
            pp=(cfg.pp_rank, cfg.pp_size),
            cp=(cfg.attn_cp_rank, cfg.attn_cp_size),
        )
        self.pages = pages
        try:
            held = self._target(self.namespace).geometry()
        except Exception as exc:  # a server down at start-up: the calls retry
            self._failed("geometry check", exc)
            held = None
        if held is not None and held != pages.geometry:
            raise ShapeError(
                f"target {self.target_spec} namespace {self.namespace!r} holds geometry "
                f"(B, L, Hkv, D) = {held.as_tuple()}, this host pool's is "
                f"{pages.geometry.as_tuple()}"
            )
        log.info(
            "tlkv HiCache storage: namespace %s, target %s, %s pages %s, format v%d",
            self.namespace,
            self.target_spec,
            pages.layout,
            pages.geometry.as_tuple(),
            self.version,
        )

    # --- shared ----------------------------------------------------------------------

    def _target(self, namespace: str) -> PageTarget:
        t = self._targets.get(namespace)  # opened already (every call after the first)
        if t is not None:
            return t
        with self._targets_lock:
            t = self._targets.get(namespace)
            if t is None:
                t = self._targets[namespace] = open_page_target(
                    self.target_spec,
                    namespace,
                    self.token,
                    self.timeout,
                    self.sync,
                    self.preallocate,
                )
                if t.local and self.keep_freed_memory:
                    self._keep_freed_memory()
            return t

    @staticmethod
    def _keep_freed_memory() -> None:
        """Make this process keep the memory of a large save for the next one
        (``kvstore.store.memory``): LMDB ``malloc``s each save's dirty pages in this
        process, and SGLang's generic path its flat page copies; by default glibc returns
        them to the kernel after every save, which then faults them in again. Config key
        ``keep_freed_memory`` (1, the default; 0 leaves the allocator alone)."""
        if keep_freed_memory():
            log.info(
                "tlkv HiCache storage: this process keeps up to %d MiB of freed heap",
                KEPT_BYTES >> 20,
            )

    def _where(self, extra_info: Any) -> tuple[HostPages, PageTarget]:
        """The pool's pages and the target of a call (its salt's namespace)."""
        if self.pages is None or self.namespace is None:
            raise CacheLayoutError("no host pool registered yet")
        salt = salt_of(extra_info)
        ns = self.namespace if salt is None else namespace_for(
            self.model, self.pages.dtype_name,
            tp=(self.config.tp_rank, self.config.tp_size),
            pp=(self.config.pp_rank, self.config.pp_size),
            cp=(self.config.attn_cp_rank, self.config.attn_cp_size), salt=salt,
        )  # fmt: skip
        return self.pages, self._target(ns)

    def _failed(self, kind: str, exc: BaseException) -> None:
        """Log the first failure of each kind at WARNING, the rest at DEBUG."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "tlkv %s failed (SGLang computes instead): %s: %s",
            kind,
            type(exc).__name__,
            exc,
        )

    def _count(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def _metric(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self.config.enable_storage_metrics or not pages:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def _names(self, keys: Sequence[str], first: bool = False) -> list[int]:
        """The keys' block names (``first``: the first key's alone); a refused key is
        counted."""
        try:
            return [block_name(keys[0])] if first else block_names(keys)
        except ValueError:
            self._count(keys_refused=1)
            raise

    # --- lookups ---------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` the target holds (one round trip); 0 when
        it cannot tell.

        A store directory is asked for the first page alone first: a new prompt's chain
        (its first page not held, the common miss) is answered by one lookup, without
        parsing the other keys; a held first page costs that one lookup more (a server is
        asked once: a round trip costs more than the keys). One key is looked up once."""
        if not keys:
            return 0
        try:
            _, target = self._where(extra_info)
            first_alone = target.local and len(keys) > 1
            if first_alone and not target.holds(self._names(keys, first=True)[0]):
                return 0
            return target.longest_prefix(self._names(keys))
        except Exception as exc:
            self._count(lookup_errors=1)
            self._failed("lookup", exc)
            return 0

    def exists(self, key: str) -> bool:
        """Whether the target holds the page ``key``."""
        return self.batch_exists([key]) == 1

    # --- loads -----------------------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Read the leading held pages of ``keys`` into the host pool pages at
        ``host_indices`` (checked first); True for each page in place."""
        done = 0
        start_time = time.perf_counter()
        try:
            pages, target = self._where(extra_info)
            names = self._names(keys)
            starts = pages.page_starts(host_indices, len(keys))
            slots = PageSlots(pages, [pages.page(start) for start in starts])
            done = target.load(names, slots)
        except Exception as exc:
            self._count(load_errors=1)
            self._failed("load", exc)
        self._loaded(len(keys), done, start_time)
        return [True] * done + [False] * (len(keys) - done)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Fill the flat pages ``target_locations`` (SGLang's ``get_dummy_flat_data_page``
        copies) with the leading held pages of ``keys``; each filled page, else None."""
        out: list[Any] = [None] * len(keys)
        done = 0
        start_time = time.perf_counter()
        try:
            pages, target = self._where(None)
            names = self._names(keys)
            if target_locations is None or len(target_locations) != len(keys):
                raise CacheLayoutError("batch_get needs one flat page to fill per key")
            slots = PageSlots(pages, [pages.flat(loc) for loc in target_locations])
            done = target.load(names, slots)
            out[:done] = target_locations[:done]
        except Exception as exc:
            self._count(load_errors=1)
            self._failed("load", exc)
        self._loaded(len(keys), done, start_time)
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The flat page ``target_location`` filled with page ``key``; None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def _loaded(self, asked: int, done: int, start_time: float) -> None:
        self._count(pages_loaded=done, pages_missed=asked - done)
        if self.pages is not None:
            nbytes = done * self.pages.geometry.elements * self.pages.dtype.itemsize
            self._metric("prefetch", done, nbytes, time.perf_counter() - start_time)

    # --- saves -----------------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool pages at ``host_indices`` under ``keys`` (those the target
        lacks); True for each page stored or held."""
        if not keys:
            return []
        try:
            pages, target = self._where(extra_info)
            names = self._names(keys)
            starts = pages.page_starts(host_indices, len(keys))
        except Exception as exc:
            self._save_failed(len(keys), exc)
            return [False] * len(keys)
        ok = self._save(pages, target, names, [pages.page(s) for s in starts])
        return [ok] * len(keys)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store the flat pages ``values`` (SGLang's ``get_data_page`` copies) under
        ``keys``; True when every page is stored or held."""
        if not keys:
            return True
        try:
            pages, target = self._where(None)
            names = self._names(keys)
            if values is None or len(values) != len(keys):
                raise CacheLayoutError("batch_set needs one flat page per key")
            views = [pages.flat(v) for v in values]
        except Exception as exc:
            self._save_failed(len(keys), exc)
            return False
        return self._save(pages, target, names, views)

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store the flat page ``value`` under ``key``."""
        return self.batch_set([key], [value])

    def _save(
        self, pages: HostPages, target: PageTarget, names: list[int], views: list[Any]
    ) -> bool:
        """Ask which pages the target lacks, encode those, put them (one round trip each;
        a batch beyond 64 MiB in several puts)."""
        start_time = time.perf_counter()
        try:
            missing = [i for i, held in enumerate(target.has(names)) if not held]
            for env in pages.envelopes(
                [names[i] for i in missing], [views[i] for i in missing], self.version
            ):
                target.put(env)
        except Exception as exc:
            self._save_failed(len(names), exc)
            return False
        self._count(pages_saved=len(missing), pages_present=len(names) - len(missing))
        nbytes = len(missing) * pages.geometry.elements * pages.dtype.itemsize
        self._metric("backup", len(missing), nbytes, time.perf_counter() - start_time)
        return True

    def _save_failed(self, n: int, exc: BaseException) -> None:
        self._count(save_errors=1, pages_dropped=n)
        self._failed("save", exc)

    # --- the rest ----------------------------------------------------------------------

    def clear(self) -> bool:
        """Delete this rank's pages from a store directory (every namespace this backend
        used); a server's pages are left (the service has no bulk delete): False."""
        try:
            done = all([t.clear() for t in list(self._targets.values())])
        except Exception as exc:
            self._failed("clear", exc)
            return False
        if not done:
            log.warning("tlkv: a server's pages are not cleared from SGLang; use tlkv's tools")
        return done

    def stats(self) -> dict[str, int]:
        """This backend's counters since it started (``COUNTERS``)."""
        with self._lock:
            return {k: int(self._counts[k]) for k in COUNTERS}

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per prefetch and
        backup call, with ``enable_storage_metrics``), with ``tlkv``: ``stats()``."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._lock:
            for key, values in self._metrics.items():
                getattr(out, key).extend(values)
                values.clear()
        out.tlkv = self.stats()
        return out

    def close(self) -> None:
        """Close connections to servers (a shared store stays open for the process)."""
        with self._targets_lock:
            targets, self._targets = list(self._targets.values()), {}
        for t in targets:
            t.close()
