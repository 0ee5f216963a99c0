"""The object-store tier's backend contract as a class of tests, ``TierBackendTests``: a
backend (``file://``, ``s3://`` or another ``obstore`` store) subclasses it in a pytest
module and gives a ``backend`` fixture, a fresh, empty ``TierBackend`` per test.

What the store, the uploader and the archive rely on from ``ObjectClient`` and ``Tier``:
create-only puts (the first writer wins, also under a race), exact bytes back, absent
objects as None / False / ``FileNotFoundError``, sizes and ranged reads, deletes that
accept absent keys, batches that keep their order past the concurrency bound, streamed
uploads, objects under the documented keys relative to the URL's prefix (read out of band:
the backend's own API or the file system), and the block and geometry calls of ``Tier``
over them. The code lists no objects, so listing is not part of the contract.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ..codec.envelope import encode, split
from ..codec.geometry import Geometry
from ..errors import TierError
from ..tier import ObjectClient, Tier, block_key, namespace_of
from ..tier.layout import geometry_key
from ._blocks import SMALL, random_blocks

__all__ = ["TierBackend", "TierBackendTests"]

OTHER = Geometry(block_tokens=8, n_layers=1, n_kv_heads=1, head_dim=4)
BUFFER_TYPES = pytest.mark.parametrize(
    "buffer_type", [bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"]
)


@dataclass
class TierBackend:
    """One tier root, with out-of-band access to the objects under it."""

    name: str
    url: str
    endpoint: str | None
    read_raw: Callable[[str], bytes | None]  # key relative to the root -> bytes, None: absent
    write_raw: Callable[[str, bytes], None]
    sibling: Callable[[str], TierBackend]  # another root beside this one, by its last segment

    def client(self, concurrency: int = 16) -> ObjectClient:
        """An ``ObjectClient`` on the root."""
        return ObjectClient(self.url, endpoint=self.endpoint, concurrency=concurrency)

    def tier(self, namespace: str = "default") -> Tier:
        """A ``Tier`` on the root, for ``namespace``."""
        return Tier(self.url, endpoint=self.endpoint, namespace=namespace)


def _payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _blocks(geometry: Geometry = SMALL, n: int = 6, seed: int = 0) -> dict[int, bytes]:
    """Single-block envelopes of full blocks by hash (what the uploader sends)."""
    _, hashes, blocks = random_blocks(geometry, n, seed)
    return dict(zip(hashes, split(encode(geometry, blocks))))


class TierBackendTests:
    """The tier backend contract: subclass it and give a ``backend`` fixture returning a
    fresh, empty ``TierBackend`` (a fixture with parameters runs every case on each)."""

    @pytest.fixture
    def backend(self) -> TierBackend:
        raise NotImplementedError("a subclass gives a `backend` fixture: a fresh TierBackend")

    @BUFFER_TYPES
    def test_create_then_read_the_exact_bytes(
        self, backend: TierBackend, buffer_type: type
    ) -> None:
        client = backend.client()
        data = _payload(4099, seed=1)
        assert client.put_new("x/one", buffer_type(data)) is True
        assert client.get("x/one") == data
        assert client.size("x/one") == len(data)
        assert client.exists_many(["x/one"]) == [True]
        assert backend.read_raw("x/one") == data

    def test_a_missing_object(self, backend: TierBackend) -> None:
        client = backend.client()
        assert client.get("no/such") is None
        assert client.get_many(["no/such"]) == [None]
        assert client.exists_many(["no/such"]) == [False]
        with pytest.raises(FileNotFoundError):
            client.size("no/such")
        with pytest.raises(TierError):
            client.get_range("no/such", 0, 10)

    def test_create_never_overwrites(self, backend: TierBackend) -> None:
        client = backend.client()
        assert client.put_new("k", b"first") is True
        assert client.put_new("k", b"second, longer") is False
        assert client.put_new_many([("k", b"third")]) == [False]
        assert client.get("k") == b"first"
        assert client.size("k") == len(b"first")

    def test_racing_creates_have_one_winner(self, backend: TierBackend) -> None:
        client = backend.client(concurrency=12)
        futures = [client.submit_put_new("race", bytes([i]) * 1000) for i in range(12)]
        results = [f.result(timeout=30) for f in futures]
        assert results.count(True) == 1, results
        assert results.count(False) == 11, results
        assert client.get("race") == bytes([results.index(True)]) * 1000

    def test_an_empty_object(self, backend: TierBackend) -> None:
        client = backend.client()
        assert client.put_new("empty", b"") is True
        assert client.get("empty") == b""  # there, and empty: not None
        assert client.size("empty") == 0
        assert client.exists_many(["empty"]) == [True]

    def test_sizes_and_ranged_reads(self, backend: TierBackend) -> None:
        client = backend.client()
        data = _payload(3 << 20, seed=2)
        client.put_new("big", data)
        assert client.size("big") == len(data)
        assert client.get("big") == data
        for start, length in ((0, 1), (0, len(data)), (12345, 1 << 20), (len(data) - 7, 7)):
            assert bytes(client.get_range("big", start, length)) == data[start : start + length]
        assert bytes(client.get_range("big", len(data) - 5, 100)) == data[-5:]  # fewer at the end

    def test_deletes(self, backend: TierBackend) -> None:
        client = backend.client()
        for key in ("d/1", "d/2", "d/3"):
            client.put_new(key, key.encode())
        client.delete("d/1")
        client.delete("d/1")  # absent is fine
        assert client.delete_many(["d/2", "d/absent", "d/3"]) == [None, None, None]
        assert client.get_many(["d/1", "d/2", "d/3"]) == [None, None, None]
        assert client.exists_many(["d/1", "d/2", "d/3"]) == [False, False, False]
        assert backend.read_raw("d/2") is None
        assert client.put_new("d/1", b"again") is True  # a deleted key can be created anew
        assert client.get("d/1") == b"again"

    def test_batches_keep_their_order_past_the_concurrency(self, backend: TierBackend) -> None:
        client = backend.client(concurrency=3)
        keys = [f"b/{i:02d}" for i in range(25)]
        datas = [_payload(100 + i, seed=i) for i in range(25)]
        assert client.put_new_many(list(zip(keys[::2], datas[::2]))) == [True] * 13
        # every other key exists already: those creates are refused, the rest made
        created = client.put_new_many(list(zip(keys, datas)))
        assert created == [i % 2 == 1 for i in range(25)]
        asked = [k for pair in zip(keys, [f"b/missing{i}" for i in range(25)]) for k in pair]
        got = client.get_many(asked)
        assert got == [d for pair in zip(datas, [None] * 25) for d in pair]
        assert client.exists_many(asked) == [i % 2 == 0 for i in range(50)]
        assert client.delete_many(keys[:10]) == [None] * 10
        assert client.exists_many(keys) == [i >= 10 for i in range(25)]

    def test_streamed_uploads(self, backend: TierBackend, tmp_path: Path) -> None:
        client = backend.client()
        data = _payload(5 << 20, seed=3)
        writer = client.open_writer("archives/streamed.tar")
        for start in range(0, len(data), 1 << 20):
            writer.write(data[start : start + (1 << 20)])
        assert client.get("archives/streamed.tar") is None  # appears on close only
        writer.close()
        assert client.get("archives/streamed.tar") == data
        path = tmp_path / "local.bin"
        path.write_bytes(data[:777_777])
        client.put_file("archives/file.bin", str(path))
        assert client.get("archives/file.bin") == data[:777_777]
        assert client.size("archives/file.bin") == 777_777

    def test_keys_are_relative_to_the_prefix(self, backend: TierBackend) -> None:
        other = backend.sibling("b")
        a, b = backend.client(), other.client()
        assert a.put_new("same/key", b"of a") is True
        assert b.put_new("same/key", b"of b") is True  # another root: another object
        assert (a.get("same/key"), b.get("same/key")) == (b"of a", b"of b")
        assert other.read_raw("same/key") == b"of b"

    def test_block_objects_under_the_documented_keys(self, backend: TierBackend) -> None:
        namespace = namespace_of("org/model@v1:x+y")
        assert namespace == "org%2Fmodel%40v1%3Ax%2By"
        tier = backend.tier()
        blocks = _blocks()
        ended: dict[int, bool] = {}
        all_ended = threading.Event()

        def done(block_hash: int, ok: bool) -> None:
            ended[block_hash] = ok
            if len(ended) == len(blocks):
                all_ended.set()

        for h, single in blocks.items():
            tier.submit_upload(h, single, done, namespace)
        assert all_ended.wait(30), f"{len(ended)} of {len(blocks)} uploads ended"
        assert ended == dict.fromkeys(blocks, True)
        assert tier.uploads == len(blocks) and tier.errors == 0 and tier.state == "ok"
        for h, single in blocks.items():  # the verbatim envelope, under the documented key
            assert backend.read_raw(f"{namespace}/blocks/{h:016x}.tlkv") == single
            assert block_key(namespace, h) == f"{namespace}/blocks/{h:016x}.tlkv"
        hashes = list(blocks)
        asked = [*hashes, 12345]
        assert tier.fetch(asked, namespace) == [*blocks.values(), None]
        assert tier.present(asked, namespace) == [True] * len(hashes) + [False]
        assert tier.fetch(hashes) == [None] * len(hashes)  # the tier's own namespace: other keys
        assert tier.present(hashes) == [False] * len(hashes)

    def test_an_existing_block_counts_as_uploaded_but_not_again(self, backend: TierBackend) -> None:
        tier = backend.tier()
        (h, single), (h2, _) = list(_blocks(n=2, seed=5).items())
        backend.write_raw(block_key("default", h), b"already here")
        results: list[tuple[int, bool]] = []
        ended = threading.Event()

        def done(block_hash: int, ok: bool) -> None:
            results.append((block_hash, ok))
            ended.set()

        tier.submit_upload(h, single, done)
        assert ended.wait(30)
        assert results == [(h, True)]  # the object exists: the upload is done
        assert tier.uploads == 0  # ... but nothing was written
        assert tier.fetch([h, h2]) == [b"already here", None]

    def test_geometry_objects(self, backend: TierBackend) -> None:
        tier = backend.tier()
        assert tier.get_geometry() is None
        assert tier.put_geometry(SMALL) is True
        assert tier.put_geometry(OTHER) is True  # exists now: the first writer's stays
        assert tier.get_geometry() == SMALL
        raw = backend.read_raw("default/geometry.json")
        assert raw is not None and json.loads(raw) == SMALL.as_dict()
        assert raw == json.dumps(SMALL.as_dict(), sort_keys=True).encode()
        namespace = namespace_of("team/model")
        assert tier.get_geometry(namespace) is None
        assert tier.put_geometry(OTHER, namespace) is True
        assert backend.tier(namespace).get_geometry() == OTHER
        assert backend.read_raw(geometry_key(namespace)) is not None
        backend.write_raw(geometry_key("broken"), b'{"block_tokens": 4}')
        assert tier.get_geometry("broken") is None
        assert tier.refused == 1 and tier.errors == 0 and tier.state == "ok"
