"""Token ids per block (kvstore/codec/tokens.py): chains, the name check, token records."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import block_hash, chain_hashes
from kvstore.codec.tokens import (
    BlockTokens,
    chain_tokens,
    pack_records,
    record_bytes,
    split_records,
    tokens_for,
    unpack_records,
    verify_tokens,
)
from kvstore.errors import TokenMismatchError

IDS = list(range(100, 122))  # 5 full blocks of 4 and 2 more


@pytest.mark.parametrize("kind", [list, np.array], ids=["list", "ndarray"])
def test_a_chain_verifies_and_a_flipped_token_names_its_block(kind: type) -> None:
    hashes = chain_hashes(IDS, 4)
    tokens = chain_tokens(kind(IDS), hashes, 4)
    assert tokens.n_blocks == 5 and tokens.block_tokens == 4
    assert tokens.parents.tolist() == [0, *hashes[:-1]]
    verify_tokens(hashes, tokens)
    bad = list(IDS)
    bad[9] = 7  # block 2
    with pytest.raises(TokenMismatchError, match=f"block 2 \\({hashes[2]:016x}\\)") as exc:
        verify_tokens(hashes, chain_tokens(bad, hashes, 4))
    assert exc.value.block_hash == hashes[2]


def test_the_count_of_ids_must_cover_the_full_blocks() -> None:
    hashes = chain_hashes(IDS, 4)
    chain_tokens(IDS[:20], hashes, 4)  # exactly the full blocks
    chain_tokens(IDS[:23], hashes, 4)  # and up to B - 1 of a tail
    more = [*IDS, 1, 2]
    for n in (19, 24, 0):
        with pytest.raises(TokenMismatchError, match="cover the envelope's full blocks"):
            chain_tokens(more[:n], hashes, 4)


def test_a_parent_outside_the_envelope_starts_the_chain() -> None:
    hashes = chain_hashes(IDS, 4)
    tail = chain_hashes(IDS[8:], 4, parent=hashes[1])
    assert tail == hashes[2:]
    verify_tokens(tail, chain_tokens(IDS[8:20], tail, 4, parent=hashes[1]))
    with pytest.raises(TokenMismatchError, match="block 0"):
        verify_tokens(tail, chain_tokens(IDS[8:20], tail, 4, parent=0))


def test_blocks_of_several_chains_each_with_its_parent() -> None:
    a = chain_hashes(IDS, 4)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    rows = BlockTokens(
        np.array([a[2], 0, b[0]], "<u8"),
        np.array([IDS[12:16], [1, 2, 3, 4], [5, 6, 7, 8]], "<u4"),
    )
    verify_tokens([a[3], b[0], b[1]], rows)
    with pytest.raises(TokenMismatchError, match="block 1"):
        verify_tokens([a[3], b[1], b[1]], rows)
    with pytest.raises(TokenMismatchError, match="3 full blocks, token ids for 2"):
        verify_tokens([a[3], b[0], b[1]], rows.take([0, 1]))


def test_tokens_for_an_envelope_skips_its_partial_blocks() -> None:
    hashes = chain_hashes(IDS, 4)
    env_hashes = np.array([*hashes, 0], "<u8")
    tokens = tokens_for(env_hashes, 4, IDS)
    assert tokens.n_blocks == 5
    assert tokens_for(env_hashes, 4, tokens) is tokens
    with pytest.raises(TokenMismatchError, match="holds block_tokens ids"):
        tokens_for(env_hashes, 8, tokens)


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 64),
    n=st.integers(0, 20),
    parent=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_records_round_trip(b: int, n: int, parent: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**32, n * b, dtype=np.uint64).astype(np.uint32)
    hashes = chain_hashes(ids, b, parent)
    tokens = chain_tokens(ids, hashes, b, parent)
    raw = pack_records(tokens)
    assert len(raw) == n * record_bytes(b) == n * (8 + 4 * b)
    back = unpack_records(raw, b)
    assert back.parents.tolist() == tokens.parents.tolist()
    assert (back.ids == tokens.ids).all()
    verify_tokens(hashes, back)
    if n:  # the record's bytes are the spec's: u64 parent, then the ids, little-endian
        assert raw[:8] == parent.to_bytes(8, "little")
        assert block_hash(parent, ids[:b]) == hashes[0]


def test_split_records_after_an_envelope() -> None:
    from conftest import make_envelope

    env = make_envelope(n_tokens_total=8)
    hashes = chain_hashes(list(range(8)), 4)
    tokens = chain_tokens(list(range(8)), hashes, 4)
    body = env + pack_records(tokens)
    part, back = split_records(body, 2)
    assert bytes(part) == env and back is not None and back.parents.tolist() == [0, hashes[0]]
    assert split_records(env, 0) == (env, None)
    with pytest.raises(TokenMismatchError, match="8 \\+ 4\\*B"):
        unpack_records(b"\0" * 23, 4)


def test_format_docs_token_record_is_the_bytes_its_block_hash_hashes() -> None:
    from test_format_doc import example_bytes

    from kvstore import fnv1a64

    record = example_bytes("token-record")
    assert len(record) == record_bytes(2)
    tokens = unpack_records(record, 2)
    assert int(tokens.parents[0]) == 0xA91AB0C1027B9366 and tokens.ids[0].tolist() == [3, 4]
    assert fnv1a64(record) == 0x03DF829571605C60 == chain_hashes([1, 2, 3, 4], 2)[1]
    verify_tokens([0x03DF829571605C60], tokens)
