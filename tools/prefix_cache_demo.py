"""Prefix cache demo: a transformers Llama's prompt KV saved to tlkv, loaded in a fresh process.

Usage: python tools/prefix_cache_demo.py [--tokens 2048] [--dtype float16] [--version 1]
       [--store DIR] [--layers 8 --hidden 512 --heads 8 --kv-heads 4 --head-dim 64]

Builds a small random-weight Llama from a config (seeded: every process builds the same
model, nothing is downloaded), runs the prompt cold and times the first token, saves the
prompt's KV into a tlkv store, then starts a fresh Python process that opens the store,
loads the cached prefix, computes only the rest of the prompt and times its first token.
The warm next-token logits are compared bit for bit with what the original in-memory
cache gives at the same length, and with the cold run's. Needs ``pip install 'tlkv[hf]'``.
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when not installed

import numpy as np
import torch
import transformers

from kvstore import Store
from kvstore.engines.transformers import load_prefix, model_geometry, save_prefix

# transformers 5.24 renamed the cache argument (and output field) `cache`; before it, the
# only name is `past_key_values`.
CACHE_KW = (
    "cache"
    if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    else "past_key_values"
)
F16_MIN_NORMAL = 2.0**-14


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The seeded random-weight model and prompt (identical in every process)."""
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(4096, args.tokens),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    ids = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    return model, ids


@torch.no_grad()
def forward(model: Any, ids: Any, cache: Any = None) -> Any:
    """One forward pass keeping the cache; only the last position's logits are computed."""
    return model(ids, use_cache=True, logits_to_keep=1, **{CACHE_KW: cache})


def cache_of(output: Any) -> Any:
    return getattr(output, CACHE_KW)


def cold(args: argparse.Namespace) -> None:
    model, ids = build(args)
    g = model_geometry(model)
    print(
        f"model: random-weight Llama, {g.n_layers} layers, {g.n_kv_heads} KV heads x "
        f"{g.head_dim}, {args.dtype}; prompt {args.tokens} tokens; torch threads "
        f"{torch.get_num_threads()}"
    )
    forward(model, ids[:, :1])  # warm-up, as in a serving process: kernels initialized
    t0 = time.perf_counter()
    out = forward(model, ids)
    t_cold = time.perf_counter() - t0
    cache = cache_of(out)
    print(f"cold:  prefill {args.tokens} tokens -> first token in {t_cold:.3f} s")

    store_dir = Path(args.store)
    t0 = time.perf_counter()
    with Store(store_dir) as store:
        stored = save_prefix(store, ids, cache, version=args.version, config=model)
        size = store.stats()["bytes"] or 0
    t_save = time.perf_counter() - t0
    print(f"saved: {stored} blocks (v{args.version}, {size / 2**20:.1f} MiB) in {t_save:.3f} s")
    if args.dtype == "bfloat16":
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        below = sum(
            int(((t != 0) & (t.abs() < F16_MIN_NORMAL)).sum()) for pair in layers for t in pair
        )
        total = sum(t.numel() for pair in layers for t in pair)
        print(f"       bf16 KV values below f16's normal range (rounded by v1): {below} of {total}")

    # What the engine's own in-memory cache gives at the length the store will give.
    n = (args.tokens - 1) // g.block_tokens * g.block_tokens
    pairs = [(la.keys[..., :n, :].clone(), la.values[..., :n, :].clone()) for la in cache.layers]
    ref = forward(model, ids[:, n:], transformers.DynamicCache(pairs)).logits[0, -1]
    np.save(store_dir / "ref_logits.npy", ref.float().numpy())
    np.save(store_dir / "cold_logits.npy", out.logits[0, -1].float().numpy())

    child = [sys.executable, __file__, "--warm", "--store", str(store_dir)]
    for name in ("tokens", "dtype", "version", "layers", "hidden", "heads", "kv_heads", "head_dim"):
        child += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    warm_out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
    print(warm_out, end="")
    t_warm = float(warm_out.rsplit("ttft=", 1)[1].split()[0])
    print(f"time to first token: cold {t_cold:.3f} s, warm {t_warm:.3f} s ({t_cold / t_warm:.1f}x)")


def warm(args: argparse.Namespace) -> None:
    model, ids = build(args)  # not timed: a serving process has its model loaded already
    forward(model, ids[:, :1])  # and has run it once
    store_dir = Path(args.store)
    t0 = time.perf_counter()
    with Store(store_dir) as store:
        n, cache = load_prefix(store, ids, config=model)
    t_load = time.perf_counter() - t0
    logits = forward(model, ids[:, n:], cache).logits[0, -1]
    t_warm = time.perf_counter() - t0
    got = logits.float().numpy()
    ref = np.load(store_dir / "ref_logits.npy")
    cold_logits = np.load(store_dir / "cold_logits.npy")
    print(
        f"warm (fresh process): loaded {n} cached tokens in {t_load:.3f} s, computed "
        f"{args.tokens - n} -> first token in {t_warm:.3f} s  ttft={t_warm:.6f}"
    )
    print(
        f"next-token logits identical to the original in-memory cache at {n} tokens: "
        f"{np.array_equal(got, ref)} (max |diff| {np.abs(got - ref).max():g}); "
        f"vs the cold full prefill: max |diff| {np.abs(got - cold_logits).max():g}, "
        f"same next token {int(got.argmax()) == int(cold_logits.argmax())}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--version", type=int, choices=[1, 2], default=1)
    parser.add_argument("--store", help="store directory (default: a new temporary one)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm:
        warm(args)
        return 0
    if args.store:
        cold(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="tlkv-demo-") as tmp:
        args.store = str(Path(tmp) / "store")
        cold(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
