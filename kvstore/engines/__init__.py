"""Bridges between inference engines and tlkv, and the targets they save to and load from.

One module per engine, each importing its framework lazily: ``transformers`` (Hugging
Face transformers, the ``tlkv[hf]`` extra) and ``vllm`` (vLLM's KV connector). Every
bridge reaches blocks through one ``Target`` (``targets``): a store directory, a
``tlkv serve`` over HTTP or over tl.kv.v1, opened with ``open_target(spec)`` or wrapped
from an open ``Store``/``Client``/``TransferClient`` with ``as_target(obj)``.
"""

from __future__ import annotations

from .targets import BlockSlots, Target, as_target, open_target

__all__ = ["BlockSlots", "Target", "as_target", "open_target"]
