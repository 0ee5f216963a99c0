"""Models as an operator manages them on a real ``tlkv serve`` (HTTP and gRPC on loopback,
the CLI as a subprocess): the ids ``.`` and ``..`` are refused by every door; a model is
deleted over HTTP, gRPC and ``tlkv delete-model``, by a token that may write it only; and
models another process adds (a library ``Store`` with its own limit, ``tlkv archive
restore``) never break the server's listings (``/v1/models``, ``/metrics``,
``/v1/status``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import grpc
import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import REPO, ServerProcess, assert_error, free_port

from kvstore import Store, decode
from kvstore.errors import ForbiddenError, InvalidRequestError
from kvstore.protocol import MODEL_HEADER
from kvstore.transfer import TransferClient

ENVELOPE = {"content-type": "application/vnd.tlkv"}
TOKENS = """
[[tokens]]
token = "admin"
read = ["*"]
write = ["*"]

[[tokens]]
token = "reader"
read = ["*"]

[[tokens]]
token = "team"
read = ["team/m@1"]
write = ["team/m@1"]
"""


def _path(model: str) -> str:
    return f"/v1/models/{quote(model, safe='').replace('.', '%2E')}"


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _tlkv(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLKV_")}
    if token:
        env["TLKV_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dot_model_ids_are_refused_by_every_door(tmp_path: Path) -> None:
    """Before, ``PUT /v1/models/./blocks`` (``%2E``) and a gRPC push with ``x-tlkv-model:
    .`` created the model, and the store then did not start with ``--tier``."""
    data = make_envelope(SMALL, 8, seed=1)
    grpc_port = free_port()
    with ServerProcess(tmp_path / "store", "--grpc-port", str(grpc_port)) as srv:
        for model in (".", ".."):
            r = httpx.put(f"{srv.url}{_path(model)}/blocks", content=data, headers=ENVELOPE)
            assert "not '.' or '..'" in assert_error(r, 422, "invalid_request")
            channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
            from kvstore.transfer._tlkv_v1 import kv_pb2, kv_pb2_grpc

            stub = kv_pb2_grpc.KvTransferStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.HasBlocks(kv_pb2.HasBlocksRequest(), metadata=((MODEL_HEADER, model),))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            channel.close()
            with pytest.raises(ValueError, match="model id"):
                TransferClient(f"127.0.0.1:{grpc_port}", model=model)
            ran = _tlkv("put", srv.url, "x.tlkv", "--model", model)
            assert ran.returncode == 2 and "model id" in ran.stderr
        assert httpx.get(f"{srv.url}/v1/models").json()["models"][0]["model"] == "default"
    with Store(tmp_path / "store", tier=f"file://{tmp_path / 'tier'}") as s:  # opens
        assert s.models() == ["default"]


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    grpc_port = free_port()
    args = ("--token-file", str(tokens), "--grpc-port", str(grpc_port))
    with ServerProcess(tmp_path / "store", *args, token="admin") as srv:
        srv.grpc_port = grpc_port  # type: ignore[attr-defined]
        for i, model in enumerate(("team/m@1", "b", "c", "d")):
            data = make_envelope(SMALL, 4 * (i + 2) + 1, seed=10 + i)
            r = httpx.put(
                f"{srv.url}{_path(model)}/blocks",
                content=data,
                headers={**ENVELOPE, **_auth("admin")},
            )
            assert r.status_code == 200, r.text
        seq = make_envelope(SMALL, 9, seed=20)
        r = httpx.put(
            f"{srv.url}{_path('team/m@1')}/sequences/s1",
            content=seq,
            headers={**ENVELOPE, **_auth("admin")},
        )
        assert r.status_code == 201, r.text
        yield srv


def test_a_model_is_deleted_by_a_token_that_may_write_it(served: ServerProcess) -> None:
    srv = served
    team = _path("team/m@1")
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        r = http.delete(team, headers=_auth("reader"))  # may read it, not write it
        assert_error(r, 403, "forbidden")
        r = http.delete(_path("b"), headers=_auth("team"))  # may not see it: as absent
        assert "not found" in assert_error(r, 404, "not_found")
        r = http.delete(_path("nothing-here"), headers=_auth("admin"))
        assert_error(r, 404, "not_found")
        r = http.delete("/v1/models/default", headers=_auth("admin"))
        assert "store itself" in assert_error(r, 422, "invalid_request")
        total = http.get("/v1/status", headers=_auth("admin")).json()["total_bytes"]
        r = http.delete(team, headers=_auth("team"))
        assert r.status_code == 200, r.text
        held = r.json()
        assert held["model"] == "team/m@1" and held["blocks"] == 2 + 2 and held["sequences"] == 1
        assert_error(http.get(f"{team}/info", headers=_auth("team")), 404, "not_found")
        listed = [
            m["model"] for m in http.get("/v1/models", headers=_auth("admin")).json()["models"]
        ]
        assert listed == ["b", "c", "d", "default"]
        after = http.get("/v1/status", headers=_auth("admin")).json()["total_bytes"]
        assert after == total - held["bytes"]
        data = make_envelope(SMALL, 8, seed=30)  # written again: a new, empty model
        r = http.put(f"{team}/blocks", content=data, headers={**ENVELOPE, **_auth("team")})
        assert r.status_code == 200 and len(r.json()["stored"]) == 2
        assert http.get(f"{team}/info", headers=_auth("team")).json()["blocks"] == 2
    port = srv.grpc_port  # type: ignore[attr-defined]
    with (
        TransferClient(f"grpc://127.0.0.1:{port}", token="reader") as t,
        pytest.raises(ForbiddenError),
    ):
        t.delete_model("b")
    with TransferClient(f"grpc://127.0.0.1:{port}", token="admin") as t:
        assert t.delete_model("b") == {
            "blocks": 3,
            "bytes": 3 * SMALL.envelope_bytes(1),
            "sequences": 0,
        }
        assert t.delete_model("b") is None
        with pytest.raises(InvalidRequestError, match="store itself"):
            t.delete_model("default")
    ran = _tlkv("delete-model", srv.url, "c", token="admin")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == {
        "model": "c",
        "blocks": 4,
        "bytes": 4 * SMALL.envelope_bytes(1),
        "sequences": 0,
    }
    assert _tlkv("delete-model", srv.url, "c", token="admin").returncode == 1  # none left
    ran = _tlkv("delete-model", f"grpc://127.0.0.1:{port}", "d", token="admin")
    assert ran.returncode == 0 and json.loads(ran.stdout)["blocks"] == 5, ran.stderr
    metrics = httpx.get(f"{srv.url}/metrics", headers=_auth("admin")).text
    assert 'tlkv_grpc_requests_total{code="OK",method="/tlkv.v1.Models/DeleteModel"}' in metrics
    assert 'method="DELETE",route="/v1/models/{model:path}",status="200"' in metrics, [
        line for line in metrics.splitlines() if "DELETE" in line
    ]


def test_delete_model_of_a_store_directory(tmp_path: Path) -> None:
    """``tlkv delete-model --data DIR`` deletes a model of a store on disk, an id kept from
    before the rule on ``.`` included (the way to clear such a store)."""
    from kvstore.store import writes
    from kvstore.store.state import Handle

    path = tmp_path / "s"
    env = make_envelope(SMALL, 8, seed=2)
    with Store(path) as s:
        writes.put_report(Handle(s._h.env, ".", None), env)  # as an older release wrote it
        s.model("m").put(env)
    ran = _tlkv("delete-model", "--data", str(path), ".")
    assert ran.returncode == 0 and json.loads(ran.stdout)["blocks"] == 2, ran.stderr
    again = _tlkv("delete-model", "--data", str(path), ".")  # gone: no longer an id at all
    assert again.returncode == 2 and "not '.' or '..'" in again.stderr, again.stderr
    ran = _tlkv("delete-model", "--data", str(path), "default")
    assert ran.returncode != 0 and "store itself" in ran.stderr
    with Store(path) as s:
        assert s.models() == ["default", "m"]
        assert s.model("m").get(int(decode(env).hashes[0])) is not None


@pytest.mark.slow  # other processes beside the server, an archive made and restored
@pytest.mark.parametrize("how", ["library", "restore"])
def test_models_another_process_adds_never_break_the_listings(tmp_path: Path, how: str) -> None:
    """The issue's run: a server started with ``--max-models 5``; another process adds 32
    models, through a library ``Store(path, max_models=200)`` (which sets the store's
    limit) or ``tlkv archive restore`` of an archive of 32 models (held to the store's 5:
    refused, its blocks undone). Either way ``/v1/models``, ``/metrics`` and ``/v1/status``
    keep answering 200 (before: 500 MDB_DBS_FULL until restarted) and list them."""
    data = tmp_path / "store"
    env = make_envelope(SMALL, 8, seed=3)
    with ServerProcess(data, "--max-models", "5") as srv:
        for name in ("a", "b"):
            r = httpx.put(f"{srv.url}{_path(name)}/blocks", content=env, headers=ENVELOPE)
            assert r.status_code == 200, r.text
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200  # handles opened
        if how == "library":
            code = (
                "import sys; sys.path.insert(0, 'tests')\n"
                "from conftest import SMALL, make_envelope\n"
                "from kvstore import Store\n"
                "env = make_envelope(SMALL, 8, seed=3)\n"
                "with Store(sys.argv[1], max_models=200) as s:\n"
                "    for i in range(32): s.model(f'lib-{i}').put(env)\n"
            )
            ran = subprocess.run(
                [sys.executable, "-c", code, str(data)], cwd=REPO, capture_output=True, text=True
            )
            assert ran.returncode == 0, ran.stderr
            expected = 2 + 32
        else:
            other = tmp_path / "other"
            with Store(other) as s:
                for i in range(32):
                    s.model(f"arc-{i}").put(env)
            archive = tmp_path / "all.tlkv"
            assert (
                _tlkv("archive", "create", "--data", str(other), "-o", str(archive)).returncode == 0
            )
            ran = _tlkv("archive", "restore", str(archive), "--data", str(data))
            assert ran.returncode != 0 and "at most 5 models" in ran.stderr, ran.stderr
            expected = 5  # a, b and the models the restore made up to the limit (emptied)
        for route in ("/v1/models", "/metrics", "/v1/status"):
            r = httpx.get(f"{srv.url}{route}")
            assert r.status_code == 200, (route, r.text[:300])
        models = httpx.get(f"{srv.url}/v1/models").json()["models"]
        assert len(models) == 1 + expected
        assert all(
            m["blocks"] == (0 if m["model"].startswith("arc-") else 2)
            for m in models
            if m["model"] != "default"
        )
        if how == "library":
            r = httpx.put(
                f"{srv.url}{_path('lib-31')}/blocks",
                content=make_envelope(SMALL, 8, seed=4),
                headers=ENVELOPE,
            )
            assert r.status_code == 200, r.text  # and it writes them


@pytest.mark.slow  # a server restarted
def test_a_server_started_without_max_models_keeps_the_stores(tmp_path: Path) -> None:
    """``--max-models 2`` is written into the store; a server started on it later without
    the option holds to 2 as well (it does not put the default back)."""
    env = make_envelope(SMALL, 8, seed=5)
    with ServerProcess(tmp_path / "store", "--max-models", "2") as srv:
        for name in ("a", "b"):
            r = httpx.put(f"{srv.url}{_path(name)}/blocks", content=env, headers=ENVELOPE)
            assert r.status_code == 200, r.text
    with ServerProcess(tmp_path / "store") as srv:
        r = httpx.put(f"{srv.url}{_path('c')}/blocks", content=env, headers=ENVELOPE)
        assert "at most 2 models" in assert_error(r, 507, "model_limit")
