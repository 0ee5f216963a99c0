"""What ``kvstore.engines.sglang`` decides without SGLang: the block name of a page key, the
namespace of a rank's pages, a call's salt, and that importing it imports no SGLang
(these run in every venv; ``test_engine_sglang.py`` runs the backend on SGLang's classes)."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
from http_server import REPO

from kvstore.engines.sglang import (
    SMALL_BATCH,
    block_name,
    block_names,
    namespace_for,
    salt_of,
)
from kvstore.errors import PageKeyError

KEY = hashlib.sha256(b"page").hexdigest()

VALID = [
    (KEY, int(KEY[:16], 16)),
    ("0123456789abcdef" + "f" * 48, 0x0123456789ABCDEF),
    ("0" * 64, 1),  # 0 names no block in the format: 1 instead
    ("0" * 15 + "1" + "e" * 48, 1),
    ("f" * 64, 2**64 - 1),
]

INVALID = [
    "hash0",  # SGLang's own unit tests use such keys: not a page hash
    KEY.upper(),
    KEY[:-1],
    KEY + "0",
    KEY[:63] + "g",
    " " + KEY[1:],
    KEY + ".mamba",  # a hybrid pool's key: not read
    "",
    "é" * 64,
    None,
    12,
]


@pytest.mark.parametrize(("key", "name"), VALID)
def test_a_page_key_names_the_u64_of_its_first_16_digits(key: str, name: int) -> None:
    assert block_name(key) == name
    assert block_names([key, key]) == [name, name]  # parsed one by one
    long = SMALL_BATCH + 1  # parsed as one joined batch
    assert block_names([key] * long) == [name] * long


@pytest.mark.parametrize("key", INVALID)
def test_a_key_that_is_not_a_page_hash_is_refused(key: object) -> None:
    with pytest.raises(PageKeyError, match="not an SGLang page hash"):
        block_name(key)  # type: ignore[arg-type]
    with pytest.raises(PageKeyError, match="not an SGLang page hash"):
        block_names([KEY, key, KEY])  # type: ignore[list-item]
    with pytest.raises(PageKeyError, match="not an SGLang page hash"):
        block_names([KEY] * SMALL_BATCH + [key])  # type: ignore[list-item]


def test_block_names_of_many_keys_match_one_by_one() -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]
    assert block_names(keys) == [block_name(k) for k in keys]
    assert block_names([]) == []


def test_sglangs_event_block_ids_are_the_same_64_bits() -> None:
    """SGLang's KV events publish ``hash_str_to_int64(key)``: the first 16 hex digits as a
    signed int64 (its ``mem_cache/utils.py``); the block name is that value unsigned."""
    for i in range(50):
        key = hashlib.sha256(bytes([i])).hexdigest()
        signed = int(key[:16], 16) - (2**64 if int(key[:16], 16) >= 2**63 else 0)
        assert block_name(key) == signed % 2**64 or block_name(key) == 1


def test_namespaces_keep_models_ranks_dtypes_and_salts_apart() -> None:
    base = namespace_for("meta-llama/Llama-3.1-8B", "bfloat16")
    assert base == "meta-llama/Llama-3.1-8B@sglang-tp0of1/bfloat16"
    assert namespace_for("m", "float16", tp=(1, 4)) == "m@sglang-tp1of4/float16"
    assert (
        namespace_for("m", "float16", tp=(0, 2), pp=(1, 2), cp=(0, 3))
        == "m@sglang-tp0of2-pp1of2-cp0of3/float16"
    )
    salted = namespace_for("m", "float16", salt="tenant-a")
    digest = hashlib.sha256(b"tenant-a").hexdigest()[:16]
    assert salted == f"m@sglang-tp0of1/float16+salt:{digest}"
    names = {
        namespace_for("m", "float16"),
        namespace_for("m", "bfloat16"),
        namespace_for("n", "float16"),
        namespace_for("m", "float16", tp=(1, 2)),
        namespace_for("m", "float16", salt="a"),
        namespace_for("m", "float16", salt="b"),
    }
    assert len(names) == 6


def test_a_long_or_odd_model_name_fits_the_model_id_rule() -> None:
    from kvstore.protocol import MODEL_ID_MAX, is_model_id

    long = namespace_for("x" * 500 + " weird name?", "float16", salt="s")
    assert is_model_id(long) and len(long) <= MODEL_ID_MAX
    assert namespace_for("x" * 500, "float16") != namespace_for("x" * 499 + "y", "float16")


@pytest.mark.parametrize(
    ("extra", "salt"),
    [
        (None, None),
        (SimpleNamespace(prefix_keys=None, extra_info=None), None),
        (SimpleNamespace(extra_info={"cache_salt": "t"}), "t"),
        (SimpleNamespace(extra_info={"cache_salt": ""}), None),
        (SimpleNamespace(extra_info={"session_id": "s"}), None),
        (SimpleNamespace(extra_info={"cache_salt": 3}), None),
    ],
)
def test_the_salt_of_a_call(extra: object, salt: str | None) -> None:
    assert salt_of(extra) == salt


def test_importing_the_module_imports_no_sglang() -> None:
    code = (
        "import sys, kvstore, kvstore.engines.sglang\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is here")
def test_without_sglang_the_class_names_what_it_needs() -> None:
    import kvstore.engines.sglang as module

    with pytest.raises(ImportError, match=r"needs SGLang \(tested with sglang==0.5.23\)"):
        module.TlkvHiCacheStorage  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        module.Nope  # type: ignore[attr-defined]  # noqa: B018
