"""Archives of blocks with their token ids (ARCHIVE.md 1.7, version 5): a store's ids are
archived, verified, extracted and restored; a token member that does not hash to its
block, or out of its place, is refused and the restore stores nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from archive_helpers import Raw, craft, manifest_member
from conftest import SMALL
from prompts import log_events, prompt

from kvstore import Store, split
from kvstore.archive import create, extract_all, restore, verify
from kvstore.archive.manifest import ARCHIVE_VERSION_TOKENS
from kvstore.codec.tokens import chain_tokens, pack_records
from kvstore.errors import ArchiveError, TokenMismatchError


def test_token_ids_are_archived_and_restored(tmp_path: Path) -> None:
    ids, hashes, env = prompt(20)
    _ids2, hashes2, env2 = prompt(8, seed=1)
    with Store(tmp_path / "a") as s:
        s.put(env, tokens=ids)
        s.put(env2)  # no ids: archived as a block alone
        s.put_sequence("q", env, tokens=ids)
        summary = create(s, tmp_path / "x.tlkv.tar.zst")
    assert summary.manifest.archive_version == ARCHIVE_VERSION_TOKENS
    assert verify(tmp_path / "x.tlkv.tar.zst").blocks == 7
    extract_all(tmp_path / "x.tlkv.tar.zst", tmp_path / "out")
    member = tmp_path / "out" / "blocks" / f"{hashes[1]:016x}.tokens"
    assert member.read_bytes() == pack_records(chain_tokens(ids[4:8], [hashes[1]], 4, hashes[0]))
    assert not (tmp_path / "out" / "blocks" / f"{hashes2[0]:016x}.tokens").exists()
    with Store(tmp_path / "b", events=100) as s:
        restore(tmp_path / "x.tlkv.tar.zst", s)
        assert [p for p, _ in s.block_tokens(hashes)] == [0, *hashes[:-1]]  # type: ignore[misc]
        assert s.block_tokens(hashes2) == [None, None]
        announced = [h for _, _, ev in log_events(s) for e in ev for h in e["block_hashes"]]
        assert announced == hashes
        again = create(s, tmp_path / "y.tlkv.tar.zst")
    assert again.manifest.archive_version == ARCHIVE_VERSION_TOKENS
    assert (tmp_path / "y.tlkv.tar.zst").read_bytes() == (tmp_path / "x.tlkv.tar.zst").read_bytes()


def _archive(tmp_path: Path, tokens_of: dict[int, bytes], order: str = "after") -> Path:
    _ids, hashes, env = prompt(8)
    by_hash = dict(zip(hashes, split(env)))
    members = []
    for h in sorted(hashes):
        block = Raw(f"blocks/{h:016x}.tlkv", by_hash[h])
        token = [Raw(f"blocks/{h:016x}.tokens", tokens_of[h])] if h in tokens_of else []
        members += [*token, block] if order == "before" else [block, *token]
    manifest = manifest_member(SMALL, 2, 0, archive_version=5, own_blocks=0)
    return craft(tmp_path / "c.tlkv.tar.zst", [manifest, members])


def _records(ids: list[int], hashes: list[int]) -> dict[int, bytes]:
    rows = chain_tokens(ids, hashes, 4)
    return {h: pack_records(rows.take([i])) for i, h in enumerate(hashes)}


def test_a_token_member_not_hashing_to_its_block_refuses_the_restore(tmp_path: Path) -> None:
    ids, hashes, _ = prompt(8)
    good = _records(ids, hashes)
    assert restore(_archive(tmp_path, good), Store(tmp_path / "ok")).new_blocks == 2
    bad = dict(good)
    bad[hashes[1]] = _records([*ids[:4], 7, 7, 7, 7], chain_tokens_hashes(ids[:4], [7] * 4))[
        chain_tokens_hashes(ids[:4], [7] * 4)[1]
    ]
    path = _archive(tmp_path, bad)
    with pytest.raises(TokenMismatchError, match=f"blocks/{hashes[1]:016x}.tokens") as exc:
        verify(path)
    assert exc.value.block_hash == hashes[1]
    with Store(tmp_path / "s", events=100) as s:
        with pytest.raises(TokenMismatchError):
            restore(path, s)
        assert s.has(hashes) == [False, False] and s.stats()["blocks"] == 0
        assert s.block_tokens(hashes) == [None, None]
        stored = [e for _, _, ev in log_events(s) for e in ev if e["type"] == "BlockStored"]
        removed = [e for _, _, ev in log_events(s) for e in ev if e["type"] == "BlockRemoved"]
        assert [e["block_hashes"] for e in stored] == [e["block_hashes"] for e in removed]
    with pytest.raises(ArchiveError, match="does not follow its block member"):
        verify(_archive(tmp_path, good, order="before"))


def chain_tokens_hashes(first: list[int], second: list[int]) -> list[int]:
    from kvstore import chain_hashes

    return chain_hashes([*first, *second], 4)
