"""The transformers bridge on the cache layouts beyond a plain ``DynamicCache``, with real
(tiny, random-weight) model code: sliding-window layers (Mistral, Gemma2, Qwen2 with some
sliding layers), ``StaticCache``, one row of a batch, both names of the cache argument,
and the layouts it refuses by name (quantized, offloaded, encoder-decoder, MLA).

Needs the ``hf`` extra (torch, transformers); without it every test here is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.hf, pytest.mark.slow]
torch = pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from hf_names import CACHE_KW, cache_of  # noqa: E402
from transformers import cache_utils  # noqa: E402

from kvstore import Store  # noqa: E402
from kvstore.engines.transformers import load_prefix, save_prefix  # noqa: E402
from kvstore.errors import CacheLayoutError, SlidingWindowError  # noqa: E402

WINDOW = 64  # sliding_window of the tiny models: dynamic layers keep the last 63 positions
TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
FAMILIES = {
    # family: (model class, config class, extra config, index of the first sliding layer)
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": WINDOW}, 0),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"sliding_window": WINDOW}, 0),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2},
        2,
    ),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, None),
}
_MODELS: dict[str, Any] = {}


def _model(family: str) -> Any:
    if family not in _MODELS:
        model_cls, config_cls, extra, _ = FAMILIES[family]
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**TINY, **extra)
        _MODELS[family] = getattr(transformers, model_cls)(config).to(torch.float16).eval()
    return _MODELS[family]


def _prompt(n: int, seed: int = 1, batch: int = 1) -> Any:
    return torch.randint(0, 96, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _prefill(model: Any, ids: Any, cache: Any = None) -> Any:
    extra = {} if cache is None else {CACHE_KW: cache}
    return cache_of(model(ids, use_cache=True, **extra))


@torch.no_grad()
def _logits(model: Any, ids: Any, cache: Any, kw: str = CACHE_KW) -> Any:
    return model(ids, use_cache=True, **{kw: cache}).logits[0, -1]


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen2"])
def test_a_prefix_inside_every_window_round_trips_exactly(tmp_path: Path, family: str) -> None:
    model, ids = _model(family), _prompt(60)  # 60 <= 63: every layer holds every position
    cache = _prefill(model, ids)
    assert any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)
    with Store(tmp_path / "s") as store:
        assert save_prefix(store, ids, cache=cache, config=model) == 3
        n, loaded = load_prefix(store, ids, config=model)
    assert n == 48
    for got, orig in zip(loaded.layers, cache.layers):
        assert type(got) is type(orig)  # the model's own layer kinds
        assert torch.equal(got.keys, orig.keys[..., :48, :])
        assert torch.equal(got.values, orig.values[..., :48, :])
    want = _logits(model, ids[:, 48:], _prefill(model, ids[:, :48]))
    assert torch.equal(_logits(model, ids[:, 48:], loaded), want)
    # Generating past the window from a loaded cache gives the tokens that the model's own
    # cache of the same 48 positions gives. That cache, prefilled by hand without tlkv, is
    # the reference: a cold generate prefills all 60 positions in one pass, whose f16 sums
    # run in another order, and on random weights (near-tied logits) a newer transformers
    # or another CPU's kernels may turn one greedy token (seen with Gemma2 on 5.25).
    with Store(tmp_path / "s") as store:
        _, fresh = load_prefix(store, ids, config=model)
    with torch.no_grad():
        by_hand = _prefill(model, ids[:, :48])
        want_tokens = model.generate(ids, max_new_tokens=12, do_sample=False, **{CACHE_KW: by_hand})
        warm = model.generate(ids, max_new_tokens=12, do_sample=False, **{CACHE_KW: fresh})
    assert warm.shape[1] == 60 + 12 > WINDOW  # the sliding layers drop positions meanwhile
    assert torch.equal(warm, want_tokens)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen2"])
def test_a_prefix_longer_than_a_window_is_refused_and_nothing_is_stored(
    tmp_path: Path, family: str
) -> None:
    model, ids = _model(family), _prompt(200)
    cache = _prefill(model, ids)
    layer = FAMILIES[family][3]
    with Store(tmp_path / "s") as store:
        with pytest.raises(SlidingWindowError, match=rf"layer {layer} .*sliding_window=64") as e:
            save_prefix(store, ids, cache, config=model)
        assert e.value.layer == layer and e.value.window == WINDOW
        assert "Nothing was stored" in str(e.value)
        assert store.stats()["blocks"] == 0
        assert store.geometry is None


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen2"])
def test_loading_a_prefix_longer_than_a_window_is_refused(tmp_path: Path, family: str) -> None:
    # Blocks of the same geometry from a full-attention model, 192 tokens long.
    ids = _prompt(200)
    with Store(tmp_path / "s") as store:
        assert save_prefix(store, ids, _prefill(_model("llama"), ids)) == 12
        layer = FAMILIES[family][3]
        with pytest.raises(SlidingWindowError, match=rf"layer {layer} .*sliding_window=64"):
            load_prefix(store, ids, config=_model(family))
        static = transformers.StaticCache(config=_model(family).config, max_cache_len=256)
        with pytest.raises(SlidingWindowError, match=rf"layer {layer} .*sliding_window=64"):
            load_prefix(store, ids, cache=static)
        assert static.get_seq_length() == 0
        n, dynamic = load_prefix(store, ids[:, :49], config=_model(family))
        assert n == 48  # fits
        assert load_prefix(store, ids[:, :49], cache=static)[0] == 48  # in place
        for i, (got, want) in enumerate(zip(static.layers, dynamic.layers)):
            assert got.get_seq_length() == 48, i
            assert torch.equal(got.keys[..., :48, :], want.keys)
            assert torch.equal(got.values[..., :48, :], want.values)


def test_cache_keyword_and_past_key_values_both_work(tmp_path: Path) -> None:
    model, ids = _model("llama"), _prompt(45)
    cache = _prefill(model, ids)
    with Store(tmp_path / "s") as store:
        assert save_prefix(store, ids, cache=cache) == 2
        assert save_prefix(store, ids, past_key_values=cache) == 0
        assert save_prefix(store, ids, cache) == 0
        with pytest.raises(TypeError, match="not both"):
            save_prefix(store, ids, cache, cache=cache)
        n, a = load_prefix(store, ids, config=model)
        _, b = load_prefix(store, ids, config=model)
    want = _logits(model, ids[:, n:], _prefill(model, ids[:, :n]))
    assert torch.equal(_logits(model, ids[:, n:], a, CACHE_KW), want)
    assert torch.equal(_logits(model, ids[:, n:], b, "past_key_values"), want)


def test_static_cache_is_filled_in_place(tmp_path: Path) -> None:
    model, ids = _model("llama"), _prompt(45)
    with Store(tmp_path / "s") as store:
        static_src = transformers.StaticCache(config=model.config, max_cache_len=64)
        _prefill(model, ids, static_src)
        assert save_prefix(store, ids, static_src) == 2  # saved from a static cache
        with Store(tmp_path / "d") as other:
            assert save_prefix(other, ids, _prefill(model, ids)) == 2
            hashes = [int(h) for h in __import__("kvstore").chain_hashes(ids[0], 16)]
            assert [store.get(h) for h in hashes] == [other.get(h) for h in hashes]
        static = transformers.StaticCache(config=model.config, max_cache_len=64)
        static.early_initialization(1, 2, 16, torch.float16, torch.device("cpu"))
        ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in static.layers]
        n, got = load_prefix(store, ids, cache=static, config=model)
        assert got is static and n == 32 and static.get_seq_length() == 32
        assert ptrs == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in static.layers]
        lazy = transformers.StaticCache(config=model.config, max_cache_len=64)
        assert load_prefix(store, ids, cache=lazy)[0] == 32  # allocated by transformers
        small = transformers.StaticCache(config=model.config, max_cache_len=16)
        with pytest.raises(CacheLayoutError, match="max_cache_len=16"):
            load_prefix(store, ids, cache=small)
        with pytest.raises(CacheLayoutError, match="must be empty"):
            load_prefix(store, ids, cache=static)
    want = _logits(model, ids[:, 32:], _prefill(model, ids[:, :32]))
    fresh = transformers.StaticCache(config=model.config, max_cache_len=64)
    want_static = _logits(model, ids[:, 32:], _prefill(model, ids[:, :32], fresh))
    got_logits = _logits(model, ids[:, 32:], static)
    assert torch.equal(got_logits, want_static)
    assert torch.equal(_logits(model, ids[:, 32:], lazy), want_static)
    assert torch.allclose(got_logits.float(), want.float(), atol=1e-2)


def test_one_row_of_a_batch_is_saved_with_row(tmp_path: Path) -> None:
    model = _model("llama")
    ids = _prompt(40, seed=3, batch=2)
    cache = _prefill(model, ids)
    with Store(tmp_path / "s") as store:
        with pytest.raises(CacheLayoutError, match=r"batch size must be 1.*row=i"):
            save_prefix(store, ids, cache)
        with pytest.raises(CacheLayoutError, match="row=2 is outside"):
            save_prefix(store, ids, cache, row=2)
        assert store.stats()["blocks"] == 0
        assert save_prefix(store, ids, cache, row=1) == 2
        n, loaded = load_prefix(store, ids[1:], config=model)
        assert load_prefix(store, ids[:1], config=model) == (0, None)  # row 0 was not saved
    assert n == 32
    for got, orig in zip(loaded.layers, cache.layers):
        assert torch.equal(got.keys[0], orig.keys[1, :, :32])
        assert torch.equal(got.values[0], orig.values[1, :, :32])


def _quantized_cache(model: Any, ids: Any) -> Any:
    """transformers' ``QuantizedCache`` after a prefill, with its ``fp8`` backend (5.21 on).
    Before 5.21 its backends are quanto and hqq, packages the hf extra does not install:
    the cache is then made of the base ``QuantizedLayer`` and left empty (the bridge refuses
    the cache by its kind, before reading a layer)."""
    try:
        quantized = cache_utils.QuantizedCache("fp8", model.config)
    except ValueError:  # "Unknown quantization backend `fp8`"

        class Layer(cache_utils.QuantizedLayer):  # a backend's shape, without its package
            # (tensor, axis) before 5.21, (tensor) after: the signature takes either
            def _quantize(self, tensor: Any, *_axis: Any) -> Any:
                return tensor

            def _dequantize(self, qtensor: Any) -> Any:
                return qtensor

        quantized = cache_utils.QuantizedCache.__new__(cache_utils.QuantizedCache)
        layers: list[Any] = [Layer() for _ in range(model.config.num_hidden_layers)]
        cache_utils.Cache.__init__(quantized, layers=layers)
        return quantized
    _prefill(model, ids, quantized)
    return quantized


def test_refused_layouts_are_named(tmp_path: Path) -> None:
    model, ids = _model("llama"), _prompt(40)
    config = model.config
    quantized = _quantized_cache(model, ids)
    offloaded = transformers.DynamicCache(config=config, offloading=True)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=96,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
    ).eval()
    with torch.no_grad():
        encdec = cache_of(t5(input_ids=ids, decoder_input_ids=ids[:, :20], use_cache=True))
    mla_model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            max_position_embeddings=128,
        )
    ).eval()
    mla = _prefill(mla_model, ids)
    with Store(tmp_path / "s") as store:
        with pytest.raises(CacheLayoutError, match="quantized cache"):
            save_prefix(store, ids, quantized)
        with pytest.raises(CacheLayoutError, match="offloaded cache"):
            save_prefix(store, ids, offloaded)
        with pytest.raises(CacheLayoutError, match="encoder-decoder cache"):
            save_prefix(store, ids[:, :20], encdec)
        with pytest.raises(CacheLayoutError, match="MLA"):
            save_prefix(store, ids, mla, config=mla_model)
        with pytest.raises(CacheLayoutError, match="MLA"):
            save_prefix(store, ids, mla)  # keys and values of different head dims
        with pytest.raises(CacheLayoutError, match="MLA"):
            load_prefix(store, ids, config=mla_model)
        with pytest.raises(CacheLayoutError, match="offloaded cache"):
            load_prefix(store, ids, cache=offloaded)
        assert store.stats()["blocks"] == 0


def test_tuples_of_a_sliding_cache_are_refused_and_plain_pairs_are_read(tmp_path: Path) -> None:
    mistral, ids = _model("mistral"), _prompt(40)
    cache = _prefill(mistral, ids)
    with Store(tmp_path / "s") as store:
        with pytest.raises(CacheLayoutError, match="layer 0 of the tuple is a sliding-window"):
            save_prefix(store, ids, tuple(cache))  # (keys, values, sliding window) per layer
        assert store.stats()["blocks"] == 0
        pairs = tuple((layer.keys, layer.values) for layer in cache.layers)
        assert save_prefix(store, ids, pairs) == 2  # all 40 positions held: exact


def test_a_source_without_geometry_or_token_lookups_is_told_what_is_missing() -> None:
    import contextlib

    from kvstore.engines.targets import Target
    from kvstore.errors import InvalidRequestError

    class Blind(Target):
        knows_geometry = False

        def geometry(self) -> None:
            return None

        def has(self, hashes: Any) -> list[bool]:
            return [False] * len(hashes)

        def put(self, envelope: Any, tokens: Any = None) -> int:
            return 0

        @contextlib.contextmanager
        def held_views(self, hashes: Any) -> Any:
            yield []

    with pytest.raises(InvalidRequestError, match="pass config= and block_tokens="):
        load_prefix(Blind(), _prompt(40))
    assert load_prefix(Blind(), _prompt(40), config=_model("llama"), block_tokens=16) == (0, None)
