"""``save_prefix`` sends its blocks' token ids (the real transformers model code): a store
keeps them, checked, and announces the blocks in its KV event log; a duck-typed target
whose ``put_envelope`` takes no ``tokens`` keeps working (tests/test_engine_transformers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prompts import log_events

pytestmark = [pytest.mark.hf, pytest.mark.slow]
torch = pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from test_engine_transformers import _model, _prefill, _prompt  # noqa: E402

from kvstore import Store, chain_hashes  # noqa: E402
from kvstore.engines.transformers import save_prefix  # noqa: E402


@torch.no_grad()
def test_save_prefix_keeps_and_announces_the_prompts_token_ids(tmp_path: Path) -> None:
    model = _model(torch.float16)
    ids = _prompt()  # 45 tokens: two full blocks of 16
    cache = _prefill(model, ids)
    prompt = ids[0].tolist()
    hashes = chain_hashes(prompt, 16)
    with Store(tmp_path / "s", events=100) as store:
        assert save_prefix(store, ids, cache=cache, config=model) == 2
        kept = store.block_tokens(hashes)
        assert [p for p, _ in kept] == [0, hashes[0]]  # type: ignore[misc]
        assert [t.tolist() for _, t in kept] == [prompt[:16], prompt[16:32]]  # type: ignore[misc]
        [(_, _, events)] = log_events(store)
        assert events[0]["block_hashes"] == hashes and events[0]["token_ids"] == prompt[:32]
