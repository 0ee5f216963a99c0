"""The ``hf`` tests' tiny Llama, and how the installed transformers names a model's KV cache.

From 5.24 on, transformers calls it ``cache`` (the argument of ``model(...)`` and
``generate``, and ``out.cache``) and still takes ``past_key_values`` with a FutureWarning
until 5.40; before 5.24, ``past_key_values`` is the only name. The ``hf`` tests run on
5.4 (the ``hf`` extra's minimum), 5.19 (the release vLLM 0.32.0 pins) and 5.25 (the
newest the extra admits), so they ask the model class which name it has.
"""

from __future__ import annotations

import inspect
from typing import Any

import transformers

CACHE_KW = (
    "cache"
    if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    else "past_key_values"
)


def cache_of(output: Any) -> Any:
    """The KV cache of a model's output, under the installed transformers' name."""
    return getattr(output, CACHE_KW)


def tiny_llama_config() -> Any:
    """The config of the tiny random-weight Llama the bridge's tests run: 2 layers, 2 KV
    heads of 16, a 96-token vocabulary (its 45-token prompts hold two blocks of 16)."""
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
