"""The restore journal (kvstore/store/journal.py): a restore whose process is gone is undone
when the store next opens; a running one is left alone; a kept one leaves no trace."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from archive_helpers import populate, snapshot
from conftest import SMALL, make_envelope

from kvstore import decode
from kvstore.store.store import Store


def _import_some(store: Store, journal: object, seed: int) -> list[int]:
    """What a restore's batches do: blocks in two commits, then sequences (one new, one
    replacing the store's ``chat-1``). Returns the new blocks' hashes."""
    envs = [make_envelope(SMALL, 4 * 5, seed=seed + i) for i in range(3)]
    store.import_batch(blocks=envs[:2], journal=journal)  # type: ignore[arg-type]
    store.import_batch(blocks=envs[2:], journal=journal)  # type: ignore[arg-type]
    seqs = [
        ("chat-1", make_envelope(SMALL, 4 * 3 + 1, seed=seed + 10)),  # its blocks are new too
        ("restored", envs[0]),
    ]
    store.import_batch(sequences=seqs, journal=journal)  # type: ignore[arg-type]
    return [int(h) for env in envs for h in decode(env).hashes]


def _lock_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("restore-"))


def test_a_restore_whose_process_died_is_undone_on_open(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        populate(store)
        before = snapshot(store)
        journal = store.begin_restore()
        hashes = _import_some(store, journal, seed=500)
        assert all(store.has(hashes)) and store.get_sequence("restored") is not None
        journal.release(unlink=False)  # what the kernel does when the process dies
    assert _lock_files(tmp_path / "s")  # the killed restore's lock file stayed behind
    with Store(tmp_path / "s") as store:
        assert snapshot(store) == before  # blocks removed, chat-1 put back, restored gone
        assert store.has(hashes) == [False] * len(hashes)
        store.put(make_envelope(SMALL, 8, seed=12345))  # usable
    assert _lock_files(tmp_path / "s") == []
    with Store(tmp_path / "s") as store:  # nothing left to undo
        assert store.stats()["blocks"] == before["stats"]["blocks"] + 2


def test_a_kept_restore_stays_whole(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        populate(store)
        journal = store.begin_restore()
        hashes = _import_some(store, journal, seed=600)
        store.end_restore(journal, keep=True)
        after = snapshot(store)
    assert _lock_files(tmp_path / "s") == []
    with Store(tmp_path / "s") as store:
        assert snapshot(store) == after
        assert all(store.has(hashes))


def test_end_restore_without_keep_undoes_at_once(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        populate(store)
        before = snapshot(store)
        journal = store.begin_restore()
        _import_some(store, journal, seed=700)
        store.end_restore(journal, keep=False)
        assert snapshot(store) == before
    assert _lock_files(tmp_path / "s") == []


def test_a_block_pinned_by_another_sequence_is_not_removed(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as store:
        journal = store.begin_restore()
        env = make_envelope(SMALL, 4 * 2, seed=800)
        store.import_batch(blocks=[env], journal=journal)
        store.put_sequence("someone-else", env)  # another client pins the new blocks
        journal.release(unlink=False)
    with Store(tmp_path / "s") as store:
        assert store.get_sequence("someone-else") == env
        assert store.stats()["blocks"] == 2


def _open_and_count(path: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with Store(path) as store:
        out.put(store.stats()["blocks"])


def test_the_lock_of_a_restore_killed_before_its_first_commit_is_removed(
    tmp_path: Path,
) -> None:
    """A restore killed after taking its lock and before any commit leaves a lock file and
    no journal: the next open removes the file; a lock another restore holds stays."""
    path = tmp_path / "s"
    with Store(path) as store:
        killed = store.begin_restore()
        killed.release(unlink=False)  # what the kernel does when the process dies
        running = store.begin_restore()
        assert len(_lock_files(path)) == 2
    # The next open, in another process (LMDB: one environment handle per process).
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_open_and_count, args=(os.fspath(path), out))
    child.start()
    assert out.get(timeout=60) == 0
    child.join(timeout=60)
    assert _lock_files(path) == [os.path.basename(running.path)]  # still held: kept
    running.release()
    assert _lock_files(path) == []


def test_a_running_restore_is_left_alone(tmp_path: Path) -> None:
    """Another process opening the store while the restore runs (its lock held) undoes
    nothing."""
    path = tmp_path / "s"
    with Store(path) as store:
        journal = store.begin_restore()
        store.import_batch(blocks=[make_envelope(SMALL, 4 * 3, seed=900)], journal=journal)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_open_and_count, args=(os.fspath(path), out))
        child.start()
        assert out.get(timeout=60) == 3
        child.join(timeout=60)
        assert store.stats()["blocks"] == 3
        store.end_restore(journal, keep=True)
    with Store(path) as store:
        assert store.stats()["blocks"] == 3


def test_a_killed_restore_into_a_model_is_undone_in_that_model(tmp_path: Path) -> None:
    """The journal names the model it wrote: the rollback on open removes that model's
    blocks, and the default model's blocks with the same hashes stay."""
    with Store(tmp_path / "s") as store:
        env = make_envelope(SMALL, 4 * 3, seed=1000)
        store.put(env)  # the same hashes in the default model
        model = store.model("org/m@1")
        journal = model.begin_restore()
        hashes = _import_some(model, journal, seed=1000)  # envs[0] is env: same hashes
        assert all(model.has(hashes))
        journal.release(unlink=False)  # killed
    with Store(tmp_path / "s") as store:
        assert store.model("org/m@1").has(hashes) == [False] * len(hashes)
        assert store.model("org/m@1").get_sequence("restored") is None
        assert store.get(int(decode(env).hashes[0])) is not None  # default untouched
        assert store.stats()["blocks"] == 3
    assert _lock_files(tmp_path / "s") == []
