"""How the installed transformers names a model's KV cache, for the ``hf`` tests.

From 5.24 on, transformers calls it ``cache`` (the argument of ``model(...)`` and
``generate``, and ``out.cache``) and still takes ``past_key_values`` with a FutureWarning
until 5.40; before 5.24, ``past_key_values`` is the only name. The ``hf`` tests run on
4.56 (the ``hf`` extra's minimum), 5.19 (the release vLLM 0.32.0 pins) and 5.25 (the
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
