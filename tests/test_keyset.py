"""kvstore.store.keyset: bulk has/longest_prefix, scanned or probed, against a plain set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope

from kvstore import Store, decode
from kvstore.store import keyset


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "s", geometry=SMALL, sync=False)
    for seed in range(6):
        s.put(make_envelope(SMALL, 4 * 8, seed=seed))
    return s


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "probe"])
def test_has_and_longest_prefix_agree_with_a_set(
    store: Store, monkeypatch: pytest.MonkeyPatch, scan: bool
) -> None:
    monkeypatch.setattr(keyset, "SCAN_PER_LOOKUP", 10**9 if scan else 0)
    stored = [
        int(h) for seed in range(6) for h in decode(make_envelope(SMALL, 32, seed=seed)).hashes
    ]
    rng = np.random.default_rng(1)
    absent = [int(x) for x in rng.integers(1, 2**63, 50, dtype=np.int64)]
    queries = stored[:10] + absent[:1] + stored[10:20] + absent[1:]
    expected = [h in set(stored) for h in queries]
    assert store.has(queries) == expected
    assert store.longest_prefix(queries) == 10
    assert store.longest_prefix(stored) == len(stored)
    assert store.longest_prefix([]) == 0 and store.has([]) == []
    assert store.has([0]) == [False]  # hash 0 names no block


def test_hash_array_refuses_what_is_not_u64() -> None:
    assert keyset.hash_array([1, 2**64 - 1]).dtype == np.uint64
    assert keyset.hash_array(np.array([3], dtype=np.int32)).tolist() == [3]
    for bad in ([-1], [2**64], np.array([-1]), np.zeros((2, 2), dtype=np.uint64), ["x"]):
        with pytest.raises(ValueError):
            keyset.hash_array(bad)
