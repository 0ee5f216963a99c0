"""tlkv as vLLM's prefix cache, end to end, on a random-weight Llama (nothing downloaded).

    python tools/vllm_demo.py [--data DIR] [--tokens 1024]

builds a small Llama with ``save_pretrained``, runs a prompt on a cold vLLM engine that
saves its KV blocks into a tlkv store, then on a fresh engine (its own process) that loads
them, and prints the cached tokens, the time to first token of each, and whether the
greedy tokens and logprobs are identical.

``python tools/vllm_demo.py engine SPEC.json`` runs one engine as SPEC says and prints
one ``RESULT {...}`` line: ``tools/bench.py vllm`` runs every engine this way, each in
its own process; the tests fork theirs from a process that imported vLLM once
(``engine_host``, ``tools/vllm_host.py``), each engine still in a process of its own.
SPEC: ``{"model": DIR, "dtype": "float16", "connector": {...} or null, "prompts":
[{"tokens": [...], "salt": null, "pause": null}], "max_tokens": 4,
"enable_prefix_caching": false, "llm": {more LLM(...) arguments}, "layouts": {backend:
layout name in ``_vllm_paged``, set before the engine starts}}`` (``pause``: a path;
the engine touches ``<path>.ready`` and waits for ``<path>.go`` before that prompt).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
KV_CACHE_BYTES = 256 << 20  # a small paged cache: vLLM would take most of the RAM


def make_model(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 512,
    seed: int = 0,
    dtype: str = "float16",
) -> str:
    """Save a random-weight ``LlamaForCausalLM`` (weights from ``seed``) to ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        torch_dtype=dtype,
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(path))
    return str(path)


def tlkv_config(target: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` of the tlkv connector on ``target`` (a block that cannot
    be loaded is recomputed: ``kv_load_failure_policy``)."""
    return {
        "kv_connector": "TlkvConnector",
        "kv_connector_module_path": "kvstore.engines.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": target, **extra},
    }


def tensor_parallel(size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``LLM(...)`` arguments and the environment of a ``size``-rank tensor-parallel
    engine on vLLM's CPU build: worker processes (``mp``), one core a rank (without
    ``VLLM_CPU_OMP_THREADS_BIND`` vLLM refuses: "Not enough allowed NUMA nodes")."""
    if size == 1:
        return {}, {}
    llm = {"tensor_parallel_size": size, "distributed_executor_backend": "mp"}
    return llm, {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(size))}


def prompt(n: int, seed: int = 1, vocab: int = 512) -> list[int]:
    """``n`` random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _engine(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("layouts"):  # a test's deliberately wrong layout: {"CPU_ATTN": "TOKEN_KV"}
        from kvstore.engines import _vllm_paged

        for backend, layout in spec["layouts"].items():  # null: the backend unknown
            if layout is None:
                _vllm_paged.BACKEND_LAYOUTS.pop(backend, None)
            else:
                _vllm_paged.BACKEND_LAYOUTS[backend] = getattr(_vllm_paged, layout)
    if spec.get("connector"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float16"),
        enforce_eager=spec.get("enforce_eager", True),
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        seed=0,
        **spec.get("llm", {}),
        **kw,
    )
    load_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, logprobs=1)
    results = []
    for p in spec["prompts"]:
        if p.get("pause"):  # a test acts between two prompts: "<pause>.ready", "<pause>.go"
            Path(p["pause"] + ".ready").touch()
            while not Path(p["pause"] + ".go").exists():
                time.sleep(0.05)
        item: dict[str, Any] = {"prompt_token_ids": p["tokens"]}
        if p.get("salt"):
            item["cache_salt"] = p["salt"]
        t0 = time.perf_counter()
        out = llm.generate([item], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        completion = out.outputs[0]
        results.append(
            {
                "cached": out.num_cached_tokens,
                "finish_reason": completion.finish_reason,
                "tokens": list(completion.token_ids),
                "logprobs": [
                    lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [])
                ],
                "seconds": elapsed,
            }
        )
    # An orderly stop, as a serving engine's own: the connector's shutdown finishes its
    # queued saves before the process ends (``vllm_host``'s child leaves by ``os._exit``,
    # which runs no finalizer and no exit hook, so without this a save still queued when
    # the last prompt returns is lost).
    llm.llm_engine.engine_core.shutdown()
    return {"engine_seconds": load_s, "results": results}


def _engine_env(env: dict[str, str] | None) -> dict[str, str]:
    """The full environment of an engine's process: this one's, the repository on the
    path, vLLM's INFO messages (the tests read them), then ``env``."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    full_env.update(env or {})
    return full_env


_HOST: Any = None  # a vllm_host.EngineHost while ``engine_host()`` is active


@contextlib.contextmanager
def engine_host() -> Iterator[None]:
    """While active, ``run_engine`` forks each engine from one process that has imported
    vLLM already (``tools/vllm_host.py``: no import per engine), when the run's
    environment allows it; other runs start a fresh interpreter as before."""
    global _HOST
    from vllm_host import EngineHost

    host = EngineHost(_engine_env(None))
    _HOST = host
    try:
        yield
    finally:
        _HOST = None
        host.close()


def run_engine(
    spec: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 300
) -> dict[str, Any]:
    """Run one engine as ``spec`` says in its own process; its ``RESULT`` (with ``log``:
    everything it wrote)."""
    full_env = _engine_env(env)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        if _HOST is not None and _HOST.accepts(full_env):
            rc, out, err = _HOST.run(f.name, full_env, timeout)
        else:
            proc = subprocess.run(
                [sys.executable, __file__, "engine", f.name],
                capture_output=True,
                text=True,
                env=full_env,
                timeout=timeout,
            )
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
    finally:
        os.unlink(f.name)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"engine failed ({rc}):\n{err[-6000:]}")
    result = json.loads(line[len("RESULT ") :])
    result["log"] = out + err
    return dict(result)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["engine"]:
        spec = json.loads(Path(args[1]).read_text())
        print("RESULT " + json.dumps(_engine(spec)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="the tlkv store directory (default: a temporary one)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length")
    opts = parser.parse_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(
            Path(tmp) / "model", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64
        )
        data = opts.data or str(Path(tmp) / "tlkv-data")
        # A short warm-up prompt first: an engine's first request pays one-off set-up.
        prompts = [{"tokens": prompt(64, seed=99)}, {"tokens": prompt(opts.tokens)}]
        spec = {"model": model, "connector": tlkv_config(data), "prompts": prompts}
        cold = run_engine(spec)["results"][1]
        warm = run_engine(spec)["results"][1]
    print(f"cold engine: {cold['cached']} cached tokens, {cold['seconds'] * 1e3:.0f} ms")
    print(f"warm engine: {warm['cached']} cached tokens, {warm['seconds'] * 1e3:.0f} ms")
    same = cold["tokens"] == warm["tokens"] and cold["logprobs"] == warm["logprobs"]
    print(f"greedy tokens and logprobs identical: {same}")
    return 0 if same and warm["cached"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
