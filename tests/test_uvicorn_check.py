"""``api.uvicorn_check``: ``tlkv serve`` runs ``TlkvHttpProtocol`` only on a uvicorn that
has every internal it relies on, and otherwise uvicorn's own protocol with one warning.

A uvicorn without one of them is simulated by removing the attribute from the installed
uvicorn (in this process with monkeypatch; in a ``tlkv serve`` subprocess through a
``sitecustomize`` module that removes it at start-up).
"""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import numpy as np
import pytest
import uvicorn.protocols.http.httptools_impl as httptools_impl
import uvicorn.protocols.utils as uvicorn_utils
from http_server import REPO, ServerProcess

from api.uvicorn_check import (
    FAST_PATH,
    RELIED_ON,
    STANDARD,
    _assigned_names,
    fast_path_problem,
    http_protocol,
)
from kvstore import Block, Geometry, encode
from kvstore.protocol import ENVELOPE_MEDIA_TYPE as ENVELOPE

G = Geometry(4, 1, 1, 8)
WARNING = "tlkv serve: warning: "


def test_installed_uvicorn_runs_the_fast_path() -> None:
    assert fast_path_problem() is None
    assert http_protocol() == (FAST_PATH, None)


@pytest.mark.parametrize(
    ("module", "cls", "name"),
    [(m, c, n) for m, c, names in RELIED_ON for n in names],
)
def test_every_relied_on_name_exists(module: str, cls: str | None, name: str) -> None:
    """Each name the check lists is one the installed uvicorn has: the list cannot name
    something that was never there (and so never be found missing)."""
    owner = importlib.import_module(module)
    if cls is not None:
        owner = getattr(owner, cls)
    assert hasattr(owner, name) or (isinstance(owner, type) and name in _assigned_names(owner))


def test_a_missing_method_is_named_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(httptools_impl.HttpToolsProtocol, "_unset_keepalive_if_required")
    problem = fast_path_problem()
    assert problem is not None
    assert "HttpToolsProtocol._unset_keepalive_if_required" in problem
    http, warning = http_protocol()
    assert http == STANDARD
    assert warning is not None and problem in warning


def test_a_missing_module_attribute_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(uvicorn_utils, "get_client_addr")
    problem = fast_path_problem()
    assert problem is not None and "uvicorn.protocols.utils.get_client_addr" in problem


def test_a_renamed_instance_attribute_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attribute set in a method (``self.pipeline = ...``) counts through the methods'
    code: a uvicorn whose code no longer assigns the name lacks it."""
    import api.uvicorn_check as check

    monkeypatch.setattr(
        check,
        "RELIED_ON",
        ((httptools_impl.__name__, "HttpToolsProtocol", ("pipeline", "no_such_attribute")),),
    )
    problem = fast_path_problem()
    assert problem is not None
    assert problem.endswith("HttpToolsProtocol.no_such_attribute")


def test_serve_without_the_internals_serves_through_uvicorn_with_one_warning(
    tmp_path: Path,
) -> None:
    """``tlkv serve`` on a uvicorn lacking ``get_client_addr`` (which ``api.http_protocol``
    imports, so the fast path could not even load): it warns once and answers through
    uvicorn's own protocol, block reads included."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            # uvicorn's own protocols bind get_client_addr as they are imported
            import uvicorn.protocols.http.auto
            import uvicorn.protocols.http.httptools_impl
            import uvicorn.protocols.websockets.auto
            import uvicorn.protocols.utils

            del uvicorn.protocols.utils.get_client_addr
            """
        )
    )
    kv = np.arange(np.prod(G.kv_shape), dtype=np.float16).reshape(G.kv_shape)
    block = encode(G, [Block(0x1234, G.block_tokens, kv)], 1)
    env = {"PYTHONPATH": f"{REPO}:{site}"}
    server = ServerProcess(tmp_path / "data", "--geometry", "4,1,1,8", env=env)
    with server, server.client() as client:
        put = client.put("/v1/blocks", content=block, headers={"content-type": ENVELOPE})
        assert put.status_code == 200, put.text
        got = client.get(f"/v1/blocks/{0x1234:016x}")
        assert got.status_code == 200 and got.content == block
    log = server.log()
    assert log.count(WARNING) == 1, log
    assert "uvicorn.protocols.utils.get_client_addr" in log
    assert f"serving through uvicorn's {STANDARD!r} protocol" in log


def test_a_uvicorn_without_class_paths_for_http_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn before 0.36 looks ``http=`` up among its own protocols' names only, and
    fails with a ``KeyError`` on a class path: simulated by a ``Config.load`` doing so."""
    import uvicorn

    def load(self: uvicorn.Config) -> None:
        raise KeyError(self.http)

    monkeypatch.setattr(uvicorn.Config, "load", load)
    problem = fast_path_problem()
    assert problem is not None and f"cannot load http={FAST_PATH!r} (KeyError" in problem
    assert http_protocol()[0] == STANDARD
