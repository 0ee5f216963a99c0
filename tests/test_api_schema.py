"""The OpenAPI document is the contract the server keeps (``api.openapi``), checked two ways:
its content here, and schemathesis -- every check, every phase, the stateful one included --
against a live ``tlkv serve`` with a token, which must report no finding."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import REPO, ServerProcess, assert_error

from api.app import create_app
from api.settings import Settings
from kvstore.protocol import (
    ERROR_KINDS,
    HASH_HEX_PATTERN,
    MODEL_ID_PATTERN,
    SEQUENCE_NAME_PATTERN,
)

GEOMETRY_ARG = ",".join(map(str, SMALL.as_tuple()))
TOKEN = "schema-token"
TESTS = Path(__file__).resolve().parent


def _schema(token: str | None) -> dict:
    return create_app(Settings(token=token)).openapi()


def _ops(schema: dict) -> Iterator[tuple[str, str, dict]]:
    for path, item in schema["paths"].items():
        for method, op in item.items():
            yield method, path, op


def test_every_error_status_is_documented_in_the_error_shape() -> None:
    schema = _schema(TOKEN)
    error = schema["components"]["schemas"]["Error"]
    assert set(error["properties"]["error"]["properties"]["kind"]["enum"]) == set(ERROR_KINDS)
    expected = {
        ("put", "/v1/blocks"): {"200", "401", "408", "413", "415", "422", "503", "507"},
        ("get", "/v1/blocks/{hash}"): {"200", "304", "401", "404", "409", "422"},
        ("delete", "/v1/blocks/{hash}"): {"204", "401", "404", "409", "422"},
        ("post", "/v1/has-blocks"): {"200", "401", "408", "413", "422", "503"},
        ("post", "/v1/prefix"): {"200", "401", "404", "408", "409", "413", "422", "503"},
        ("put", "/v1/sequences/{name}"): {"201", "401", "408", "413", "415", "422", "503", "507"},
        ("get", "/v1/sequences/{name}"): {"200", "401", "404", "422"},
        ("delete", "/v1/sequences/{name}"): {"204", "401", "404", "422"},
        ("get", "/v1/info"): {"200", "401"},
        ("get", "/healthz"): {"200"},
    }
    ids = set()
    for method, path, op in _ops(schema):
        assert op["operationId"] not in ids
        ids.add(op["operationId"])
        if (method, path) in expected:
            assert set(op["responses"]) == expected[method, path], (method, path)
        for status, response in op["responses"].items():
            if int(status) >= 400:
                content = response["content"]["application/json"]["schema"]
                assert content == {"$ref": "#/components/schemas/Error"}
        assert ("security" in op) == (path != "/healthz")
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_no_token_no_security_and_no_401() -> None:
    schema = _schema(None)
    assert "securitySchemes" not in schema["components"]
    for _method, _path, op in _ops(schema):
        assert "security" not in op and "401" not in op["responses"]


def test_patterns_and_envelope_media_types() -> None:
    schema = _schema(None)
    params = {
        p["name"]: p["schema"]["pattern"]
        for _m, _p, op in _ops(schema)
        for p in op.get("parameters", [])
        if "pattern" in p["schema"]
    }
    assert params == {
        "hash": HASH_HEX_PATTERN,
        "name": SEQUENCE_NAME_PATTERN,
        "model": MODEL_ID_PATTERN,
    }
    for path in ("/v1/blocks", "/v1/sequences/{name}"):
        body = schema["paths"][path]["put"]["requestBody"]
        assert set(body["content"]) == {"application/vnd.tlkv", "application/octet-stream"}
        assert "no parameters" in body["description"]
    ok = schema["paths"]["/v1/blocks/{hash}"]["get"]["responses"]["200"]["content"]
    assert set(ok) == {"application/vnd.tlkv"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("schema") / "store"
    args = ("--geometry", GEOMETRY_ARG, "--max-body", "256KiB")
    with ServerProcess(data, *args, token=TOKEN) as srv:
        yield srv


ALLOW = {
    "/v1/blocks": "OPTIONS, PUT",
    "/v1/blocks/0123456789abcdef": "DELETE, GET, HEAD, OPTIONS",
    "/v1/sequences": "GET, OPTIONS",
    "/v1/sequences/name": "DELETE, GET, OPTIONS, PUT",
    "/v1/info": "GET, OPTIONS",
}


@pytest.mark.parametrize("path", sorted(ALLOW))
def test_allow_lists_every_method_of_the_path(server: ServerProcess, path: str) -> None:
    with server.client() as http:
        r = http.options(path)
        assert r.status_code == 204 and r.headers["allow"] == ALLOW[path]
        r = http.patch(path)
        assert_error(r, 405, "method_not_allowed")
        assert r.headers["allow"] == ALLOW[path]
        assert_error(http.options("/v1/nothing"), 404, "not_found")
    assert httpx.options(f"{server.url}{path}").status_code == 401  # auth first


def test_sequence_and_blocks_round_trip_after_schema_changes(server: ServerProcess) -> None:
    data = make_envelope(SMALL, 9, seed=21)
    with server.client() as http:
        typed = {"content-type": "application/vnd.tlkv"}
        assert http.put("/v1/sequences/a.b-c_1", content=data, headers=typed).status_code == 201
        assert http.get("/v1/sequences/a.b-c_1").content == data
        assert_error(http.get("/v1/sequences/" + "x" * 129), 422, "invalid_request")
        r = http.post("/v1/has-blocks", json={"hashes": [], "extra": 1})
        assert "nothing else" in assert_error(r, 422, "invalid_request")


@pytest.mark.slow
def test_schemathesis_finds_nothing(server: ServerProcess) -> None:
    """``st run`` with every check and phase; its own exit code says whether it found any."""
    pytest.importorskip("schemathesis")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]),
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
        "TLKV_SCHEMA_GEOMETRY": GEOMETRY_ARG,
    }
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(TESTS / "schemathesis.toml"),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--max-examples",
        "40",
        "--workers",
        "1",
        "--seed",
        "15",
    ]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert "Stateful" in run.stdout and "failures" not in run.stdout.split("SUMMARY")[-1], report
    assert server.alive()
    assert "Traceback" not in server.log(), server.log()[-3000:]
