"""Models over HTTP on a real ``tlkv serve``: ``/v1/models/{model}/...`` routes, isolation,
``GET /v1/models``, and tokens scoped to models (404 for what a token may not read)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import grpc
import httpx
import numpy as np
import pytest
from conftest import SMALL, make_blocks
from http_server import ServerProcess, assert_error, free_port

from kvstore import Block, NotFoundError, decode, encode
from kvstore.client import Client
from kvstore.errors import ForbiddenError, ModelLimitError
from kvstore.transfer import TransferClient

ENVELOPE = {"content-type": "application/vnd.tlkv"}
LLAMA = "meta-llama/Llama-3.1-8B@5206a32/bf16"
TOKENS = """
[[tokens]]
token = "admin"
read = ["*"]
write = ["*"]

[[tokens]]
token = "alice"
read = ["a", "shared"]
write = ["a"]

[[tokens]]
token = "writer"
write = ["w"]
"""


def url(model: str, rest: str) -> str:
    return f"/v1/models/{quote(model, safe='')}/{rest}"


def client(server: ServerProcess, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=30.0
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("models") / "store"
    token_file = data.parent / "tokens.toml"
    token_file.write_text(TOKENS)
    grpc_port = free_port()
    metrics_token = data.parent / "metrics-token"
    metrics_token.write_text("prometheus-9d1e\n")
    args: tuple[str, ...] = ("--token-file", str(token_file), "--grpc-port", str(grpc_port))
    args += ("--quota", f"q={2 * SMALL.envelope_bytes(1)}")
    args += ("--metrics-token-file", str(metrics_token))
    with ServerProcess(data, *args) as srv:
        srv.grpc_port = grpc_port  # type: ignore[attr-defined]
        with client(srv, "admin") as c:
            for model in ("shared", "b", LLAMA):
                r = c.put(url(model, "blocks"), content=PROMPT_A, headers=ENVELOPE)
                assert r.status_code == 200, r.text
        yield srv


BLOCKS = make_blocks(SMALL, 4 * 3, seed=5)
PROMPT_A = encode(SMALL, BLOCKS)
PROMPT_B = encode(SMALL, [Block(b.hash, b.n_tokens, b.kv * 2) for b in BLOCKS])
HASHES = [f"{int(h):016x}" for h in decode(PROMPT_A).hashes]


def test_same_prompt_two_models_never_mix(server: ServerProcess) -> None:
    with client(server, "admin") as c:
        r = c.post(url("a", "has-blocks"), json={"hashes": HASHES})
        assert r.status_code == 404  # model a does not exist yet
        r = c.put(url("a", "blocks"), content=PROMPT_B, headers=ENVELOPE)
        assert r.status_code == 200 and r.json()["stored"] == HASHES
        r = c.post(url(LLAMA, "has-blocks"), json={"hashes": HASHES})
        assert r.json() == {"present": [True] * 3, "prefix": 3}
        r = c.post("/v1/has-blocks", json={"hashes": HASHES})  # today's routes: default
        assert r.json() == {"present": [False] * 3, "prefix": 0}
        a = c.get(url("a", f"blocks/{HASHES[0]}"))
        llama = c.get(url(LLAMA, f"blocks/{HASHES[0]}"))
        assert a.content == decode(PROMPT_B).single(0)
        assert llama.content == decode(PROMPT_A).single(0)
        raw = np.array([int(h, 16) for h in HASHES], "<u8").tobytes()
        octets = {"content-type": "application/octet-stream"}
        r = c.post(url("a", "prefix"), content=raw, headers=octets)
        assert r.status_code == 200 and r.content == PROMPT_B
        assert c.get(f"/v1/blocks/{HASHES[0]}").status_code == 404
        info = c.get(url(LLAMA, "info")).json()
        assert info["blocks"] == 3 and info["geometry"] == SMALL.as_dict()


def test_models_lists_what_the_token_may_read(server: ServerProcess) -> None:
    with client(server, "admin") as c:
        c.put(url("a", "blocks"), content=PROMPT_B, headers=ENVELOPE)
        models = {m["model"]: m for m in c.get("/v1/models").json()["models"]}
        assert {"default", "a", "b", "shared", LLAMA} <= set(models)
        assert models[LLAMA]["blocks"] == 3 and models[LLAMA]["geometry"] == SMALL.as_dict()
        assert models["default"]["geometry"] is None
    with client(server, "alice") as c:
        assert [m["model"] for m in c.get("/v1/models").json()["models"]] == ["a", "shared"]
    with client(server, "writer") as c:
        assert c.get("/v1/models").json() == {"models": []}


@pytest.mark.parametrize(
    ("method", "rest", "body"),
    [
        ("GET", f"blocks/{HASHES[0]}", None),
        ("HEAD", f"blocks/{HASHES[0]}", None),
        ("POST", "has-blocks", {"hashes": HASHES}),
        ("POST", "prefix", {"hashes": HASHES}),
        ("GET", "sequences", None),
        ("GET", "info", None),
        ("PUT", "blocks", PROMPT_A),
        ("DELETE", f"blocks/{HASHES[0]}", None),
    ],
)
def test_an_unreadable_model_is_a_model_that_does_not_exist(
    server: ServerProcess, method: str, rest: str, body: object
) -> None:
    def ask(model: str) -> httpx.Response:
        kwargs: dict[str, object] = {}
        if isinstance(body, bytes):
            kwargs = {"content": body, "headers": ENVELOPE}
        elif body is not None:
            kwargs = {"json": body}
        with client(server, "alice") as c:
            return c.request(method, url(model, rest), **kwargs)  # type: ignore[arg-type]

    hidden, missing = ask("b"), ask("no-such-model")
    assert hidden.status_code == missing.status_code == 404
    if method != "HEAD":
        assert assert_error(hidden, 404, "not_found") == "model 'b' not found"
        assert assert_error(missing, 404, "not_found") == "model 'no-such-model' not found"
    assert hidden.headers.keys() == missing.headers.keys()


def test_read_only_write_only_and_default(server: ServerProcess) -> None:
    with client(server, "alice") as c:
        r = c.put(url("shared", "blocks"), content=PROMPT_A, headers=ENVELOPE)
        assert_error(r, 403, "forbidden")
        assert c.get(url("shared", f"blocks/{HASHES[0]}")).status_code == 200
        assert_error(c.get(f"/v1/blocks/{HASHES[0]}"), 404, "not_found")  # no default
        assert c.put(url("a", "blocks"), content=PROMPT_B, headers=ENVELOPE).status_code == 200
    with client(server, "writer") as c:
        r = c.put(url("w", "blocks"), content=PROMPT_A, headers=ENVELOPE)
        assert r.status_code == 200 and r.json()["stored"] == HASHES
        assert_error(c.get(url("w", f"blocks/{HASHES[0]}")), 404, "not_found")
    with client(server, "nobody") as c:
        assert_error(c.get("/v1/models"), 401, "unauthorized")


def test_bad_model_ids_are_refused(server: ServerProcess) -> None:
    with client(server, "admin") as c:
        for bad in ("a%20b", "%C3%BC", "x" * 201):
            assert_error(c.get(f"/v1/models/{bad}/sequences"), 422, "invalid_request")
        r = c.get("/v1/models/a")  # the model itself is only deleted: DELETE
        assert r.status_code == 405 and "DELETE" in r.headers["allow"]


def test_client_and_transfer_client_address_a_model(server: ServerProcess) -> None:
    with Client(server.url, token="admin", model="c/1") as c, Client(server.url, "admin") as d:
        assert c.put(PROMPT_B).stored == [int(h, 16) for h in HASHES]
        assert (
            c.has_blocks(HASHES).present == [True] * 3
            and d.has_blocks(HASHES).present == [False] * 3
        )
        assert c.get(HASHES[0]) == decode(PROMPT_B).single(0) and d.get(HASHES[0]) is None
        assert c.prefix(HASHES) == PROMPT_B and d.models()[0]["model"] == "a"
        assert "c/1" in [m["model"] for m in c.models()]
    target = f"grpc://127.0.0.1:{server.grpc_port}"  # type: ignore[attr-defined]
    with TransferClient(target, "admin", model="c/1") as t:
        assert t.has_blocks(HASHES).present == [True] * 3
        assert t.fetch(hashes=HASHES) == PROMPT_B
    with TransferClient(target, "admin") as t:
        assert t.has_blocks(HASHES).present == [False] * 3
    hidden = pytest.raises(NotFoundError, match="model 'b' not found")
    with TransferClient(target, "alice", model="b") as t, hidden:
        t.has_blocks(HASHES)
    with TransferClient(target, "alice", model="shared") as t, pytest.raises(ForbiddenError) as e:
        t.push(PROMPT_A)
    assert e.value.grpc_code is grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    hidden = pytest.raises(NotFoundError, match="model 'b' not found")
    with Client(server.url, token="alice", model="b") as c, hidden:
        c.has_blocks(HASHES)


def test_metrics_have_per_model_gauges_the_token_may_read(server: ServerProcess) -> None:
    with client(server, "admin") as c:
        text = c.get("/metrics").text
    assert f'tlkv_model_blocks{{model="{LLAMA}"}} 3.0' in text
    assert 'tlkv_model_bytes{model="b"}' in text and 'tlkv_model_sequences{model="b"} 0.0' in text
    with client(server, "alice") as c:
        text = c.get("/metrics").text
    assert 'tlkv_model_blocks{model="shared"} 3.0' in text
    assert 'model="b"' not in text and LLAMA not in text


def test_store_wide_metrics_only_for_tokens_that_read_every_model(
    server: ServerProcess,
) -> None:
    """A token that may read some models gets their ``tlkv_model_*`` series and nothing
    store-wide (the default model's counts, hits and misses moving with other tenants'
    reads, request counts); a token that reads every model and the metrics token get
    everything; the metrics token reads no model."""
    with client(server, "admin") as c:
        c.get(f"/v1/blocks/{HASHES[0]}")  # a read of default: store-wide counters move
        full = c.get("/metrics").text
    with client(server, "alice") as c:
        scoped = c.get("/metrics").text
    with client(server, "prometheus-9d1e") as c:
        metrics_token = c.get("/metrics").text
        assert c.get("/v1/models").json()["models"] == []
        assert c.get(f"/v1/blocks/{HASHES[0]}").status_code == 404
        assert c.post("/v1/has-blocks", json={"hashes": HASHES}).status_code == 404
        assert c.put("/v1/blocks", content=PROMPT_A, headers=ENVELOPE).status_code == 404
    for text in (full, metrics_token):
        assert "tlkv_store_blocks " in text and "tlkv_store_hits_total " in text
        assert "tlkv_http_requests_total{" in text
        assert f'tlkv_model_blocks{{model="{LLAMA}"}} 3.0' in text
    assert 'tlkv_model_blocks{model="shared"} 3.0' in scoped
    for series in ("tlkv_store_", "tlkv_http_", "tlkv_grpc_", "tlkv_worker_", 'model="b"'):
        assert series not in scoped, series
    with client(server, "writer") as c:  # reads nothing: no series at all
        assert "model=" not in c.get("/metrics").text


def test_a_models_quota_from_the_command_line(server: ServerProcess) -> None:
    with client(server, "admin") as c:
        r = c.put(url("q", "blocks"), content=PROMPT_A, headers=ENVELOPE)
        assert_error(r, 507, "store_full")  # 3 blocks in one put never fit a 2-block quota
        for i in range(3):
            one = decode(PROMPT_A).single(i)
            assert c.put(url("q", "blocks"), content=one, headers=ENVELOPE).status_code == 200
        assert c.post(url("q", "has-blocks"), json={"hashes": HASHES}).json()["present"] == [
            False,
            True,
            True,
        ]  # the model's own oldest block went to make room
        assert c.get(url(LLAMA, f"blocks/{HASHES[0]}")).status_code == 200  # others untouched


# --- the model limit ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_model_limit_holds_for_every_worker_and_both_protocols(tmp_path: Path) -> None:
    """``--max-models 3`` under two workers: models asked for over many HTTP connections
    and gRPC PushKv calls at once; exactly 3 are created, every other answer is 507
    model_limit (RESOURCE_EXHAUSTED), and the store keeps serving its models and metrics.
    Restarted with the default limit after a restart under a higher one, a store past the
    limit serves ``/v1/models``, ``/metrics`` and a whole-store ``archive create``."""
    data = tmp_path / "store"
    grpc_port = free_port()
    envelope = encode(SMALL, make_blocks(SMALL, 16, seed=5))
    args = ("--workers", "2", "--max-models", "3", "--grpc-port", str(grpc_port))
    with ServerProcess(data, *args) as srv:
        answers: list[str] = []

        def over_http(model: str) -> None:
            with httpx.Client(base_url=srv.url, timeout=30.0) as c:  # a connection each
                r = c.put(url(model, "blocks"), content=envelope, headers=ENVELOPE)
                answers.append(
                    "ok" if r.status_code == 200 else assert_error(r, 507, "model_limit")
                )

        def over_grpc(model: str) -> None:
            with TransferClient(f"127.0.0.1:{grpc_port}", model=model) as t:
                try:
                    t.push(envelope)
                    answers.append("ok")
                except ModelLimitError as exc:
                    assert exc.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
                    answers.append(str(exc))

        jobs = [(over_http if i % 2 else over_grpc, f"m{i}") for i in range(12)]
        threads = [threading.Thread(target=f, args=(m,)) for f, m in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers.count("ok") == 3, answers
        assert all("at most 3 models" in a for a in answers if a != "ok")
        with srv.client() as c:
            models = c.get("/v1/models").json()["models"]
            assert len(models) == 4
            assert c.get("/metrics").status_code == 200
    # Restarted with a higher limit, the store takes 5 more; then back to 3: past the limit.
    with ServerProcess(data, "--workers", "2", "--max-models", "8") as srv, srv.client() as c:
        for i in range(5):
            r = c.put(url(f"late{i}", "blocks"), content=envelope, headers=ENVELOPE)
            assert r.status_code == 200, r.text
    with ServerProcess(data, "--workers", "2", "--max-models", "3") as srv, srv.client() as c:
        assert len(c.get("/v1/models").json()["models"]) == 9
        assert c.get("/metrics").status_code == 200
        r = c.put(url("one-more", "blocks"), content=envelope, headers=ENVELOPE)
        assert_error(r, 507, "model_limit")
        out = tmp_path / "all.tlkv"
        ran = subprocess.run(
            [sys.executable, "-m", "kvstore", "archive", "create", "--data", str(data), "-o", out],
            capture_output=True,
            text=True,
        )
        assert ran.returncode == 0, ran.stderr
