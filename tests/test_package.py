"""``kvstore/__init__.py``: its exports are listed once (the ``TYPE_CHECKING`` imports),
each resolves to the object its module defines, and ``import kvstore`` stays light."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kvstore


def test_all_is_the_type_checking_imports() -> None:
    exports = kvstore._exports()
    assert sorted(kvstore.__all__) == sorted(["__version__", *exports])
    assert {"Store", "encode", "decode", "Geometry", "ChecksumError"} <= set(exports)
    assert len(kvstore.__all__) == len(set(kvstore.__all__))


def test_each_export_is_its_module_object() -> None:
    for name, module in kvstore._exports().items():
        assert getattr(kvstore, name) is getattr(importlib.import_module(module), name), name
    assert set(kvstore.__all__) <= set(dir(kvstore))


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        kvstore.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_import_kvstore_and_the_codec_load_no_storage_or_http_library() -> None:
    code = (
        "import sys, kvstore\n"
        "kvstore.encode, kvstore.Geometry, kvstore.ChecksumError\n"
        "heavy = {'lmdb', 'zstandard', 'httpx', 'fastapi', 'grpc', 'obstore'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
