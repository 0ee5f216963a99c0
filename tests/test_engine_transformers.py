"""The transformers bridge on a real (tiny, random-weight) Llama: save, reopen, load, and
the next-token logits compared with the run on the original in-memory cache.

Needs the ``hf`` extra (torch, transformers); without it every test here is skipped.
Figures that are reported rather than asserted (bf16 values below f16's normal range,
v2 logit differences) are printed with a ``REPORT`` prefix (``pytest -s`` shows them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_server import ServerProcess

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # real model runs: the hf step of .ci/run
torch = pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from hf_names import CACHE_KW, cache_of, tiny_llama_config  # noqa: E402

from kvstore import Geometry, ShapeError, Store, encode  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.engines.transformers import load_prefix, model_geometry, save_prefix  # noqa: E402
from kvstore.kvlayout import blocks_from_layers  # noqa: E402

PROMPT = 45  # two full blocks of 16 and a tail of 13
F16_MIN_NORMAL = 2.0**-14


def _config() -> Any:
    return tiny_llama_config()


_MODELS: dict[Any, Any] = {}


def _model(dtype: Any) -> Any:
    if dtype not in _MODELS:
        torch.manual_seed(0)
        _MODELS[dtype] = transformers.LlamaForCausalLM(_config()).to(dtype).eval()
    return _MODELS[dtype]


def _prompt(seed: int = 1, n: int = PROMPT) -> Any:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _prefill(model: Any, ids: Any) -> Any:
    return cache_of(model(ids, use_cache=True))


def _layers(cache: Any) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def _next_logits(model: Any, ids: Any, n: int, cache: Any) -> Any:
    return model(ids[:, n:], use_cache=True, **{CACHE_KW: cache}).logits[0, -1]


def _cropped(cache: Any, n: int) -> Any:
    """The original in-memory cache cut to its first ``n`` positions (a copy)."""
    pairs = [(k[..., :n, :].clone(), v[..., :n, :].clone()) for k, v in _layers(cache)]
    return transformers.DynamicCache(pairs)


def _save_and_reload(tmp_path: Path, dtype: Any, version: int) -> tuple[Any, Any, Any, int, Any]:
    model, ids = _model(dtype), _prompt()
    cache = _prefill(model, ids)
    with Store(tmp_path / "store") as store:
        assert save_prefix(store, ids, cache, version=version, config=model) == 2
    with Store(tmp_path / "store") as store:  # a new Store object on the same directory
        n, loaded = load_prefix(store, ids, config=model)
    assert n == 32 and loaded.get_seq_length() == 32
    return model, ids, cache, n, loaded


def test_f16_v1_round_trip_gives_bit_identical_logits_and_greedy_tokens(tmp_path: Path) -> None:
    model, ids, cache, n, loaded = _save_and_reload(tmp_path, torch.float16, 1)
    for (k0, v0), (k1, v1) in zip(_layers(cache), _layers(loaded)):
        assert k1.dtype == torch.float16 and torch.equal(k0[..., :n, :], k1)
        assert torch.equal(v0[..., :n, :], v1)
    want = _next_logits(model, ids, n, _cropped(cache, n))
    assert torch.equal(_next_logits(model, ids, n, loaded), want)
    with Store(tmp_path / "store") as store:
        n, loaded = load_prefix(store, ids, config=model)
    with torch.no_grad():
        cold = model.generate(ids, max_new_tokens=20, do_sample=False)
        warm = model.generate(ids, max_new_tokens=20, do_sample=False, **{CACHE_KW: loaded})
    assert torch.equal(cold, warm)


def test_bf16_v1_is_exact_but_for_values_below_f16_normal_range(tmp_path: Path) -> None:
    model, ids, cache, n, loaded = _save_and_reload(tmp_path, torch.bfloat16, 1)
    below = total = 0
    for (k0, v0), (k1, v1) in zip(_layers(cache), _layers(loaded)):
        assert k1.dtype == torch.bfloat16
        for orig, got in ((k0[..., :n, :], k1), (v0[..., :n, :], v1)):
            tiny = (orig != 0) & (orig.abs() < F16_MIN_NORMAL)
            below += int(tiny.sum())
            total += orig.numel()
            assert torch.equal(orig[~tiny], got[~tiny])  # bit-exact everywhere else
    logits = _next_logits(model, ids, n, loaded)
    want = _next_logits(model, ids, n, _cropped(cache, n))
    diff = float((logits.float() - want.float()).abs().max())
    print(
        f"REPORT bf16 v1: {below} of {total} KV values below f16's normal range; "
        f"max |logit diff| {diff:g}"
    )
    if below == 0:
        assert torch.equal(logits, want)


def test_bf16_values_below_f16_normal_range_are_the_only_difference(tmp_path: Path) -> None:
    model, ids = _model(torch.bfloat16), _prompt()
    cache = _prefill(model, ids)
    tiny = torch.tensor([1e-6, -3e-7, 1e-9, 2.0**-14], dtype=torch.bfloat16)
    cache.layers[1].keys[0, 1, 5:9, 3] = tiny  # three below f16's normal range, one at it
    with Store(tmp_path / "s") as store:
        save_prefix(store, ids, cache)
        n, loaded = load_prefix(store, ids, config=model)
    got = loaded.layers[1].keys[0, 1, 5:9, 3]
    assert got[3] == tiny[3] and got[2] == 0
    assert not torch.equal(got[:2], tiny[:2])  # rounded to f16 subnormals
    keys = loaded.layers[1].keys.clone()
    keys[0, 1, 5:9, 3] = tiny
    assert torch.equal(keys, cache.layers[1].keys[..., :n, :])  # exact everywhere else


@pytest.mark.parametrize(
    ("dtype", "version"),
    [
        (torch.float16, 2),
        (torch.bfloat16, 2),
        (torch.float32, 2),
        (torch.float32, 1),
    ],
    ids=["f16-v2", "bf16-v2", "f32-v2", "f32-v1"],
)
def test_lossy_round_trips_report_the_logit_difference(
    tmp_path: Path, dtype: Any, version: int
) -> None:
    model, ids, cache, n, loaded = _save_and_reload(tmp_path, dtype, version)
    assert loaded.layers[0].keys.dtype == dtype
    logits = _next_logits(model, ids, n, loaded).float()
    want = _next_logits(model, ids, n, _cropped(cache, n)).float()
    diff = (logits - want).abs()
    print(
        f"REPORT {dtype} v{version}: max |logit diff| {float(diff.max()):g}, "
        f"mean {float(diff.mean()):g}, logit range {float(want.abs().max()):g}, "
        f"same argmax {bool(logits.argmax() == want.argmax())}"
    )
    assert torch.isfinite(logits).all()


def test_over_http_with_a_server_restart(tmp_path: Path) -> None:
    model, ids = _model(torch.float16), _prompt(seed=2)
    cache = _prefill(model, ids)
    data = tmp_path / "data"
    with ServerProcess(data) as srv, Client(srv.url) as client:
        assert load_prefix(client, ids, config=model) == (0, None)  # no geometry yet
        assert save_prefix(client, ids, cache, config=model) == 2
        assert save_prefix(client, ids, cache, config=model) == 0  # nothing re-sent
    with ServerProcess(data) as srv, Client(srv.url) as client:
        n, loaded = load_prefix(client, ids, config=model)
    assert n == 32
    want = _next_logits(model, ids, n, _cropped(cache, n))
    assert torch.equal(_next_logits(model, ids, n, loaded), want)


def test_over_tl_kv_v1_grpc(tmp_path: Path) -> None:
    from http_server import free_port

    from kvstore.transfer import TransferClient

    model, ids = _model(torch.float16), _prompt(seed=4)
    cache = _prefill(model, ids)
    port = free_port()
    with (
        ServerProcess(tmp_path / "data", "--grpc-port", str(port)),
        TransferClient(f"127.0.0.1:{port}") as client,
    ):
        assert load_prefix(client, ids, config=model) == (0, None)
        assert save_prefix(client, ids, cache, config=model) == 2
        assert save_prefix(client, ids, cache, config=model) == 0  # nothing re-sent
        n, loaded = load_prefix(client, ids, config=model)
    assert n == 32
    want = _next_logits(model, ids, n, _cropped(cache, n))
    assert torch.equal(_next_logits(model, ids, n, loaded), want)


def test_only_missing_blocks_are_stored_and_a_longer_prompt_extends_the_prefix(
    tmp_path: Path,
) -> None:
    model = _model(torch.float16)
    ids = _prompt(seed=3, n=70)
    with Store(tmp_path / "s") as store:
        assert save_prefix(store, ids[:, :40], _prefill(model, ids[:, :40])) == 2
        blocks = store.stats()["blocks"]
        assert save_prefix(store, ids[:, :40], _prefill(model, ids[:, :40])) == 0
        assert store.stats()["blocks"] == blocks
        assert save_prefix(store, ids, _prefill(model, ids)) == 2  # blocks 2 and 3 only
        assert save_prefix(store, ids[:, :10], _prefill(model, ids[:, :10])) == 0  # no full block
        assert load_prefix(store, ids, config=model)[0] == 64
        assert load_prefix(store, ids[:, :64], config=model)[0] == 48  # one token is left
        assert load_prefix(store, ids[:, :65], config=model)[0] == 64
        other = ids.clone()
        other[0, 20] += 1  # diverges inside block 1
        assert load_prefix(store, other, config=model)[0] == 16


def test_dtype_and_device_defaults(tmp_path: Path) -> None:
    model, ids = _model(torch.float16), _prompt()
    with Store(tmp_path / "s") as store:
        assert load_prefix(store, ids) == (0, None)  # no geometry yet
        save_prefix(store, ids, _prefill(model, ids))
        _, cache = load_prefix(store, ids)  # no model: the stored dtype
        assert cache.layers[0].keys.dtype == torch.float16
        _, cache = load_prefix(store, ids, dtype=torch.float32, device="cpu")
        assert cache.layers[1].values.dtype == torch.float32
        assert cache.layers[1].values.shape == (1, 2, 32, 16)
        assert load_prefix(store, _prompt(seed=9)) == (0, None)  # nothing in common


def test_batch_size_other_than_one_is_refused(tmp_path: Path) -> None:
    model = _model(torch.float16)
    ids = torch.cat([_prompt(), _prompt(seed=5)])
    cache = _prefill(model, ids)
    with Store(tmp_path / "s") as store:
        with pytest.raises(ValueError, match="batch size must be 1"):
            save_prefix(store, ids, cache)
        with pytest.raises(ValueError, match="batch size must be 1"):
            save_prefix(store, ids[:1], cache)
        with pytest.raises(ValueError, match="batch size must be 1"):
            load_prefix(store, ids)


def test_a_store_of_another_geometry_is_refused_naming_both(tmp_path: Path) -> None:
    model, ids = _model(torch.float16), _prompt()
    other = Geometry(16, 2, 2, 32)
    with Store(tmp_path / "s", geometry=other) as store:
        with pytest.raises(ShapeError, match=r"\(16, 2, 2, 32\).*L=2, Hkv=2, D=16"):
            save_prefix(store, ids, _prefill(model, ids))
        with pytest.raises(ShapeError, match=r"\(16, 2, 2, 32\).*L=2, Hkv=2, D=16"):
            load_prefix(store, ids, config=model)
    with Store(tmp_path / "b8", geometry=Geometry(8, 2, 2, 16)) as store:
        with pytest.raises(ShapeError, match="block_tokens 8, asked for 16"):
            save_prefix(store, ids, _prefill(model, ids), block_tokens=16)
        assert save_prefix(store, ids, _prefill(model, ids)) == 5  # B=8 is the store's
        assert load_prefix(store, ids, config=model)[0] == 40


def test_config_mismatch_and_unknown_targets_are_refused(tmp_path: Path) -> None:
    model, ids = _model(torch.float16), _prompt()
    config = _config()
    config.num_key_value_heads = 4
    with Store(tmp_path / "s") as store, pytest.raises(ShapeError, match="config says"):
        save_prefix(store, ids, _prefill(model, ids), config=config)
    with pytest.raises(TypeError, match="or a Target"):
        save_prefix({}, ids, _prefill(model, ids))
    assert model_geometry(model) == Geometry(16, 2, 2, 16)


def test_an_outside_target_is_used_as_it_is(tmp_path: Path) -> None:
    # The seam an outside backend plugs into: four methods, the rest inherited.
    import contextlib

    from kvstore import decode
    from kvstore.engines.targets import Target

    class Memory(Target):
        def __init__(self) -> None:
            self.blocks: dict[int, bytes] = {}
            self.held: Geometry | None = None

        def geometry(self) -> Geometry | None:
            return self.held

        def has(self, hashes: Any) -> list[bool]:
            return [h in self.blocks for h in hashes]

        # a Target written before token ids: save_prefix passes the envelope alone
        def put(self, envelope: Any) -> int:  # type: ignore[override]
            env = decode(envelope)
            self.held = env.geometry
            new = [bv.hash for bv in env if bv.hash not in self.blocks]
            self.blocks.update((bv.hash, env.single(i)) for i, bv in enumerate(env))
            return len(new)

        @contextlib.contextmanager
        def held_views(self, hashes: Any) -> Any:
            views = []
            for h in hashes:
                if h not in self.blocks:
                    break
                views.append(decode(self.blocks[h])[0])
            yield views

    model, ids = _model(torch.float16), _prompt()
    cache = _prefill(model, ids)
    target = Memory()
    assert save_prefix(target, ids, cache) == 2
    n, loaded = load_prefix(target, ids, config=model)
    assert torch.equal(
        _next_logits(model, ids, n, loaded), _next_logits(model, ids, n, _cropped(cache, n))
    )


def test_kvlayout_reads_a_dynamic_cache_as_the_bridge_does() -> None:
    model, ids = _model(torch.bfloat16), _prompt()
    cache = _prefill(model, ids)
    g = model_geometry(model)
    keys = [k for k, _ in _layers(cache)]
    values = [v for _, v in _layers(cache)]
    blocks = blocks_from_layers(keys, values, ids[0], g)
    assert [b.n_tokens for b in blocks] == [16, 16, 13]
    assert len(encode(g, blocks, 2)) == g.envelope_bytes(3, 2)
    np.testing.assert_array_equal(
        np.asarray(blocks[2].kv)[1, 1, :, :13].astype(np.float32),
        values[1][0, :, 32:45].float().numpy(),
    )


def test_a_model_not_created_yet_is_created_by_the_first_save_over_http_and_grpc(
    tmp_path: Path,
) -> None:
    from http_server import free_port

    from kvstore.transfer import TransferClient

    model, ids = _model(torch.float16), _prompt(seed=6)
    cache = _prefill(model, ids)
    port = free_port()
    want = _next_logits(model, ids, 32, _cropped(cache, 32))
    with ServerProcess(tmp_path / "data", "--grpc-port", str(port)) as srv:
        with Client(srv.url, model="org/modelA@1/f32") as client:
            assert load_prefix(client, ids, config=model) == (0, None)
            assert save_prefix(client, ids, cache, config=model) == 2
            n, loaded = load_prefix(client, ids, config=model)
            assert n == 32 and torch.equal(_next_logits(model, ids, n, loaded), want)
        with TransferClient(f"127.0.0.1:{port}", model="org/modelB@1/f16") as grpc_client:
            assert load_prefix(grpc_client, ids, config=model) == (0, None)
            assert load_prefix(grpc_client, ids) == (0, None)
            assert save_prefix(grpc_client, ids, cache, config=model) == 2
            n, loaded = load_prefix(grpc_client, ids, config=model)
            assert n == 32 and torch.equal(_next_logits(model, ids, n, loaded), want)
        with Client(srv.url) as client:
            names = {m["model"] for m in client.models()}
            assert {"org/modelA@1/f32", "org/modelB@1/f16"} <= names


def test_grpc_load_without_config_takes_the_servers_geometry(tmp_path: Path) -> None:
    from http_server import free_port

    from kvstore.transfer import TransferClient

    model, ids = _model(torch.float16), _prompt(seed=7)
    cache = _prefill(model, ids)
    port = free_port()
    args = ("--grpc-port", str(port), "--geometry", "8,2,2,16")  # B=8, not the default 16
    with (
        ServerProcess(tmp_path / "data", *args),
        TransferClient(f"127.0.0.1:{port}") as client,
    ):
        assert save_prefix(client, ids, cache, config=model, block_tokens=8) == 5
        n, loaded = load_prefix(client, ids)  # no config: the blocks carry the geometry
        assert n == 40
        assert load_prefix(client, ids, config=model)[0] == 40
    want = _next_logits(model, ids, n, _cropped(cache, n))
    assert torch.equal(_next_logits(model, ids, n, loaded), want)


def _wait_uploaded(client: Client, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while client.info()["tier"]["pending_uploads"]:
        assert time.monotonic() < deadline, "uploads did not drain"
        time.sleep(0.1)


def test_a_tiered_store_reads_a_prefix_through_from_the_library(
    tmp_path: Path, s3_server: Any
) -> None:
    model, ids = _model(torch.float16), _prompt(seed=8)
    cache = _prefill(model, ids)
    url = f"s3://{s3_server.new_bucket()}/fleet"
    g = model_geometry(model)
    with Store(tmp_path / "a", tier=url, tier_endpoint=s3_server.endpoint) as a:
        assert save_prefix(a, ids, cache, config=model) == 2
        assert a.wait_uploaded(30)
    with Store(tmp_path / "b", geometry=g, tier=url, tier_endpoint=s3_server.endpoint) as b:
        assert b.stats()["blocks"] == 0
        n, loaded = load_prefix(b, ids, config=model)  # local misses read through
        assert n == 32 and b.stats()["blocks"] == 2
    with Store(tmp_path / "c", tier=url, tier_endpoint=s3_server.endpoint) as c:
        assert load_prefix(c, ids, config=model)[0] == 32  # no geometry: the tier's
    want = _next_logits(model, ids, n, _cropped(cache, n))
    assert torch.equal(_next_logits(model, ids, n, loaded), want)


def test_a_new_tier_node_learns_the_geometry_from_the_bucket(
    tmp_path: Path, s3_server: Any
) -> None:
    from s3_server import CREDENTIALS

    model, ids = _model(torch.float16), _prompt(seed=9)
    cache = _prefill(model, ids)
    tier = ("--tier", f"s3://{s3_server.new_bucket()}/fleet", "--tier-endpoint", s3_server.endpoint)
    with ServerProcess(tmp_path / "a", *tier, env=CREDENTIALS) as a, Client(a.url) as ca:
        assert save_prefix(ca, ids, cache, config=model) == 2
        _wait_uploaded(ca)
    with ServerProcess(tmp_path / "b", *tier, env=CREDENTIALS) as b, Client(b.url) as cb:
        assert cb.info()["geometry"] == model_geometry(model).as_dict()  # from the tier
        n, loaded = load_prefix(cb, ids, config=model)
        assert n == 32 and cb.info()["blocks"] == 2
    want = _next_logits(model, ids, n, _cropped(cache, n))
    assert torch.equal(_next_logits(model, ids, n, loaded), want)
