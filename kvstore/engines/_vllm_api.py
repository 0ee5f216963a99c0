"""The vLLM version and KV connector API ``kvstore.engines.vllm`` implements, checked when
vLLM loads the connector: another API fails at import naming the version; another
version with the same API is named in a warning the connector logs."""

from __future__ import annotations

import inspect

import vllm

__all__ = ["TESTED_VLLM", "check_api"]

TESTED_VLLM = "0.32.0"

# The parts of KVConnectorBase_V1 the connector implements, with their parameters.
_API = {
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["self", "scheduler_output"],
    "request_finished": ["self", "request", "block_ids"],
    "register_kv_caches": ["self", "kv_caches"],
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "wait_for_layer_load": ["self", "layer_name"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": ["self"],
    "get_block_ids_with_load_errors": ["self"],
    "get_kv_connector_stats": ["self"],
    "get_handshake_metadata": ["self"],
    "set_xfer_handshake_metadata": ["self", "metadata"],
    "build_kv_connector_stats": ["cls", "data"],
}


def check_api(base: type) -> str | None:
    """Raise ImportError naming the vLLM version when the connector API of ``base``
    (vLLM's ``KVConnectorBase_V1``) is not the one ``kvstore.engines.vllm`` implements;
    returns a warning when the API is but the version is not the one tested (else None)."""
    found = []
    for name, params in _API.items():
        fn = getattr(base, name, None)
        got = None if fn is None else list(inspect.signature(fn).parameters)
        if name == "build_kv_connector_stats" and got is not None:
            got = ["cls", *got]
        if got != params:
            found.append(f"{name}{tuple(got) if got else ' missing'}")
    if found:
        raise ImportError(
            f"kvstore.engines.vllm implements vLLM {TESTED_VLLM}'s KV connector API; vLLM "
            f"{vllm.__version__} differs: {', '.join(found)}"
        )
    if vllm.__version__ != TESTED_VLLM:
        return f"tlkv's connector is tested with vLLM {TESTED_VLLM}, found {vllm.__version__}"
    return None
