"""A store's models as an operator manages them (real LMDB under ``tmp_path``, other
processes as real subprocesses): the limit on models belongs to the store, whoever opens
it; a model is deleted with everything of it, its number reused; handles on a deleted
model (here or in another process) find it not created yet; the model ids ``.`` and
``..`` are refused, and a store that holds one from before still opens, with a tier too,
and deletes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL, make_envelope
from store_helpers import elsewhere as _elsewhere
from test_store_models import check_models, hashes_of, singles

from kvstore import Store
from kvstore.errors import InvalidRequestError, ModelLimitError
from kvstore.store import writes
from kvstore.store.state import Handle


def test_the_limit_belongs_to_the_store(tmp_path: Path) -> None:
    """Opened with ``max_models=5``, the store keeps 5: another process that opens it
    without a limit (as ``tlkv archive restore`` does) is held to 5; one that gives a
    limit sets it for every process, and the first process then serves the models the
    second made (before: it answered MDB_DBS_FULL for them until restarted)."""
    path = tmp_path / "s"
    env = make_envelope(SMALL, 8, seed=1)
    with Store(path, max_models=5) as s:
        assert s.max_models == 5
        s.model("mine").put(env)
        out = _elsewhere(
            """
            import sys
            sys.path.insert(0, "tests")
            from conftest import SMALL, make_envelope
            from kvstore import Store
            from kvstore.errors import ModelLimitError
            env = make_envelope(SMALL, 8, seed=1)
            with Store(sys.argv[1]) as s:
                made = 0
                try:
                    for i in range(10):
                        s.model(f"theirs-{i}").put(env)
                        made += 1
                except ModelLimitError as exc:
                    print(made, s.max_models, exc)
            """,
            str(path),
        )
        assert out.startswith("4 5 rule 'a store holds at most 5 models"), out
        _elsewhere(
            """
            import sys
            sys.path.insert(0, "tests")
            from conftest import SMALL, make_envelope
            from kvstore import Store
            env = make_envelope(SMALL, 8, seed=1)
            with Store(sys.argv[1], max_models=200) as s:
                for i in range(4, 36):
                    s.model(f"theirs-{i}").put(env)
            """,
            str(path),
        )
        assert s.max_models == 200
        assert len(s.models()) == 1 + 1 + 36
        assert all(s.model(m).stats()["blocks"] == 2 for m in s.models() if m != "default")
        s.model("one-more").put(env)  # this process holds to the store's new limit
        check_models(s)
    with Store(path) as s:
        assert s.max_models == 200


def test_a_deleted_model_is_gone_and_its_number_reused(tmp_path: Path) -> None:
    """Everything of the model goes in one transaction (blocks, sequences, its share of the
    totals, its place in the LRU order); the other models are untouched; the next new model
    takes the freed number and starts empty; eviction runs over what is left."""
    blocks = singles(6, seed=3)
    with Store(tmp_path / "s", capacity_bytes=20 * len(blocks[0])) as s:
        s.put(blocks[0])
        a, b = s.model("org/a@1"), s.model("org/b@1")
        for e in blocks:
            a.put(e)
            b.put(e)
        a.put_sequence("seq", make_envelope(SMALL, 10, seed=4))
        number = a._h.dbs.number
        before_default = s.stats()
        held = s.delete_model("org/a@1")
        assert held is not None
        assert held == {"blocks": 6 + 2, "bytes": held["bytes"], "sequences": 1}
        assert held["bytes"] > 6 * len(blocks[0])
        assert s.models() == ["default", "org/b@1"]
        assert s.delete_model("org/a@1") is None  # gone
        assert a.stats()["blocks"] == 0 and a.get(hashes_of(blocks[0])[0]) is None
        assert a.get_sequence("seq") is None
        assert s.stats() == before_default  # the default model's figures do not move
        assert b.stats()["blocks"] == 6
        check_models(s)
        c = s.model("org/c@1")
        c.put(blocks[1])
        assert c._h.dbs.number == number and c.stats()["blocks"] == 1
        a.put(blocks[2])  # a put through the old handle makes the model again, empty
        assert a.stats()["blocks"] == 1 and a._h.dbs.number != number
        for i in range(30):  # past the capacity: the LRU order holds only live blocks
            s.put(singles(1, seed=100 + i)[0])
        check_models(s)
        with pytest.raises(InvalidRequestError, match="store itself"):
            s.delete_model("default")
        with pytest.raises(ValueError, match="model id"):
            s.delete_model("a b")


def test_another_process_deleting_a_model_is_seen_here(tmp_path: Path) -> None:
    """A handle held open while another process deletes its model reads nothing from then
    on, never the blocks of a model that took its number; a put through it makes the model
    again."""
    path = tmp_path / "s"
    mine, theirs = singles(3, seed=5), singles(3, seed=6)
    with Store(path) as s:
        m = s.model("m")
        for e in mine:
            m.put(e)
        h = hashes_of(mine[0])[0]
        assert m.get(h) == mine[0]
        _elsewhere(
            """
            import sys
            sys.path.insert(0, "tests")
            from test_store_models import singles
            from kvstore import Store
            with Store(sys.argv[1]) as s:
                assert s.delete_model("m")["blocks"] == 3
                n = s.model("other")
                for e in singles(3, seed=6):
                    n.put(e)  # takes m's number, and its emptied sub-databases
            """,
            str(path),
        )
        assert m.get(h) is None and m.has(hashes_of(theirs[0])) == [False]
        assert m.stats()["blocks"] == 0 and s.models() == ["default", "other"]
        assert s.model("other").get(hashes_of(theirs[0])[0]) == theirs[0]
        m.put(mine[0])
        assert m.get(h) == mine[0] and s.models() == ["default", "m", "other"]
        check_models(s)


def _old_store(path: Path, model: str) -> bytes:
    """A store holding ``model`` as a release before the rule on ``.``/``..`` wrote it
    (the same write path, the id not checked); its envelope."""
    env = make_envelope(SMALL, 8, seed=7)
    with Store(path) as s:
        writes.put_report(Handle(s._h.env, model, None), env)
    return env


@pytest.mark.parametrize("model", [".", ".."])
def test_dot_ids_are_refused_and_an_old_one_still_opens(tmp_path: Path, model: str) -> None:
    """``.`` and ``..`` are no model ids; a store that holds one from before opens (with a
    tier: before, it did not, the id being no tier namespace), serves it without the tier,
    and deletes it by its id."""
    with Store(tmp_path / "new") as s, pytest.raises(ValueError, match=r"not '\.' or '\.\.'"):
        s.model(model).put(make_envelope(SMALL, 8, seed=1))
    path = tmp_path / "old"
    env = _old_store(path, model)
    tier = f"file://{tmp_path / 'tier'}"
    with Store(path, tier=tier) as s:
        assert model in s.models()
        old = s.model(model)
        assert old.stats()["blocks"] == 2 and old.tier_info() is None
        assert old.get(hashes_of(env)[0]) is not None
        s.put(make_envelope(SMALL, 8, seed=8))  # the store's other models use the tier
        assert s.wait_uploaded(20)
        assert s.delete_model(model) == {
            "blocks": 2,
            "bytes": 2 * SMALL.envelope_bytes(1),
            "sequences": 0,
        }
        assert s.models() == ["default"]
    with Store(path, tier=tier) as s:
        assert s.models() == ["default"]


def test_model_limit_error_names_the_store_limit(tmp_path: Path) -> None:
    with Store(tmp_path / "s", max_models=1) as s:
        s.model("a").put(make_envelope(SMALL, 8, seed=1))
        with pytest.raises(ModelLimitError, match="at most 1 models"):
            s.model("b").put(make_envelope(SMALL, 8, seed=1))
        s.delete_model("a")
        s.model("b").put(make_envelope(SMALL, 8, seed=1))  # room again
