"""What a person with a CUDA machine and vLLM runs to check tlkv's connector on a GPU
attention backend (FlashAttention, FlashInfer, Triton): CI has no GPU.

    pip install -e . vllm==0.32.0
    python tools/gpu_check.py [--backend FLASH_ATTN] [--tp 1]

builds a small random-weight Llama (``save_pretrained``, nothing downloaded), runs a
cold engine that saves a prompt's blocks into a temporary tlkv store and a fresh warm
engine (its own process) that loads them, and checks that:

- the connector proved each layer's layout at registration through the backend's own
  cache-write op (``proven through <backend>'s cache-write op`` in the log; a refusal is
  printed with its reason);
- the warm engine loaded the prompt's full blocks;
- its greedy tokens and logprobs are identical to the cold engine's.

Exit status 0 when all hold. ``--backend`` sets ``VLLM_ATTENTION_BACKEND``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_demo import make_model, prompt, run_engine, tlkv_config

BLOCK = 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="VLLM_ATTENTION_BACKEND (default: vLLM's choice)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length")
    opts = parser.parse_args(argv)
    llm = {"tensor_parallel_size": opts.tp}  # one GPU a rank, vLLM's own executor
    env: dict[str, str] = {}
    if opts.backend:
        env["VLLM_ATTENTION_BACKEND"] = opts.backend
    tokens = prompt(opts.tokens)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(
            Path(tmp) / "model", layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64
        )
        spec = {
            "model": model,
            "connector": tlkv_config(str(Path(tmp) / "tlkv-data")),
            "prompts": [{"tokens": tokens}],
            "llm": llm,
        }
        runs = []
        for name in ("cold", "warm"):
            out = run_engine(spec, env, timeout=900)
            result = out["results"][0]
            proven = re.findall(r"tlkv connector: layout of .* cache-write op", out["log"])
            refused = re.findall(r"tlkv connector is off: .*", out["log"])
            print(f"{name}: {result['cached']} cached tokens; " + (proven or refused or ["?"])[0])
            ok = ok and bool(proven) and not refused
            runs.append(result)
    cold, warm = runs
    expected = (opts.tokens - 1) // BLOCK * BLOCK
    same = cold["tokens"] == warm["tokens"] and cold["logprobs"] == warm["logprobs"]
    print(f"warm engine loaded {warm['cached']} of {expected} tokens; identical output: {same}")
    ok = ok and warm["cached"] == expected and same
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
