"""kvstore.engines._vllm_names without vLLM: the namespace and salt rules."""

from __future__ import annotations

from kvstore.engines._vllm_names import namespace, salted


def test_namespaces() -> None:
    assert namespace("meta-llama/Llama-3.1-8B", "5206a32", "bfloat16") == (
        "meta-llama/Llama-3.1-8B@5206a32/bfloat16"
    )
    assert namespace("/models/my model", None, "float16") == "/models/my_model@main/float16"
    long = namespace("x" * 400, None, "float16")
    assert len(long) <= 200 - len("+salt:") - 16 and long != namespace("x" * 399, None, "float16")
    a, b = salted("m@main/float16", "tenant-a"), salted("m@main/float16", "tenant-b")
    assert a.startswith("m@main/float16+salt:") and a != b and "tenant" not in a
    assert salted("m", None) == "m" and len(salted(long, "s")) <= 200
