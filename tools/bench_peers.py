"""Peers: tlkv against Mooncake Store, the same blocks and the same process layout.

Geometry (16, 32, 8, 128): 64 single-block v1 envelopes of 2 MiB. One ``tlkv serve``
(2 workers, durable) and one ``mooncake_master`` (HTTP metadata server on, otherwise its
defaults) on loopback ports; a writer process and a reader process, each a tlkv
``Client`` and a Mooncake ``MooncakeDistributedStore`` (TCP transport). The writer's
Mooncake client mounts a 1 GiB segment (where the values live: DRAM) and a 512 MiB
local buffer; the reader mounts no segment (every read crosses processes, as tlkv's
do) and a 512 MiB local buffer. Mooncake's fast paths are used: registered buffers
(``register_buffer``) for ``put_from``/``batch_put_from``/``get_into``/``batch_get_into``;
each row takes the faster of Mooncake's plain and registered call.

Rows, each the median over 5 runs (fresh blocks per run; 1 with ``--quick``), the ratio
tlkv/peer in the same run (for times: peer time / tlkv time):

- put one by one and batched (one 64-block envelope / one batch call): tlkv durable
  (``Client.put`` to the server: fsync before the answer), tlkv's fastest mode
  (``Store(sync=False).put`` into the server's store directory from the writer process:
  no fsync, no HTTP; the writer keeps freed memory, ``kvstore.store.keep_freed_memory()``,
  as the docs tell a process that puts large batches), and tlkv durable in the writer's
  process (``Store()`` on a store directory of its own, as an engine's connector opens
  one: fsync before each put returns, no HTTP), against Mooncake's DRAM
  ``put``/``put_from``/``batch_put_from``;
- the same puts against what this disk allows any store (Mooncake's DRAM put keeps
  nothing across a restart): the same bytes written into a new file beside the store,
  one ``write`` each or one joined, with an ``fdatasync`` after each write (against
  tlkv durable) or none (against tlkv's fastest mode: the page cache);
- the same Mooncake puts against a second master started with ``--root_fs_dir`` (its
  file persistence: the writer's client, which mounts a segment there as on the first,
  also writes each value it puts to a file under that directory, on a thread pool after
  the put returns, with no fsync; ``remove`` leaves the file), timed to the put's return
  and until the files hold every value, against tlkv's fastest mode (whose put returns
  with the bytes in its file's page cache) and tlkv durable;
- tlkv's fastest mode against plain py-lmdb putting the same values in the writer
  (``bench_floors.LmdbFloor``: opened as that mode opens its store, one transaction or one
  each, no envelope and no checks), and that plain LMDB against Mooncake's DRAM put: what
  tlkv's own work adds, and what LMDB itself costs any store built on it;
- get one by one from the reader (``Client.get`` against ``get``/``get_into``), after the
  writer's ``os.sync()``: no read is timed against the kernel writing back the puts'
  pages (on 2 cores, without it, a run's reads ran up to 2x slower on both sides);
  beside it, not judged, the same blocks as a same-host engine reads them: the server's
  store directory opened in the reader, each CRC-checked view (``Store.get_buffers``)
  copied into the reader's buffer, no socket;
- a whole 64-block prefix at once from the reader (``Client.prefix``, the default call,
  and ``Client.prefix_into`` a reused buffer, against ``batch_get_into``);
- each read row: the median of ``READ_ROUNDS`` passes per call, the calls of both sides
  taking turns pass by pass (``bench_common.interleaved_medians``), so a slow spell of
  the VM (BENCHMARKS.md, peers) falls on both sides alike instead of on whichever was
  timed during it;
- existence of 8,192 keys, 64 present (``Client.has_blocks``, p50 of 20, against
  ``batch_is_exist``);
- both servers restarted: what the reader finds (tlkv from disk; each Mooncake master
  keeps its metadata in memory, the persisting one too), the writer's segments still
  mounted in its process;
- every rate also as a fraction of a loopback socket copy measured in the same run
  (one process ``sendall``s 128 MiB, another ``recv_into``s a reused buffer).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import Row, interleaved_medians
from bench_floors import LmdbFloor, file_write, loopback_rate
from bench_mooncake import OBJECT_NOT_FOUND, check_rc, mooncake_client, start_master, stop_master
from bench_peers_table import EXIST_CALLS, EXIST_KEYS, table
from bench_procs import BenchProcess
from bench_servers import GEOMETRY, start_tlkv

RUNS = 5  # the rule: each target holds in the median of 5 runs and in each
READ_ROUNDS = 5  # timed passes of each read call per run, taking turns
SEGMENT = 1 << 30
LOCAL_BUFFER = 512 << 20
FILES_POLL = 0.002  # seconds between looks at the persisting master's files


def _envelopes(n: int, seed: int) -> tuple[list[int], list[bytes]]:
    from kvstore import Block, Geometry, encode

    g = Geometry(*GEOMETRY)
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal(g.kv_shape).astype(np.float16)
    hashes = [int(h) for h in rng.integers(1, 2**63, n, dtype=np.uint64)]
    return hashes, [encode(g, [Block(h, g.block_tokens, kv)], 1) for h in hashes]


def _persisted(keys: list[str]) -> list[str]:
    """The keys the persisting master holds the values of ``keys`` under."""
    return [f"p{k}" for k in keys]


def _files_bytes(root: str, names: set[str]) -> int:
    """Bytes in the files under ``root`` named one of ``names`` (only those are stat'ed)."""
    total = 0
    for top, _, files in os.walk(root):
        for name in files:
            if name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(top, name)).st_size
    return total


class _Side:
    """One process's clients: tlkv's and Mooncake's, and a registered buffer."""

    def __init__(self, cfg: dict[str, Any], writer: bool) -> None:
        from kvstore.client import Client

        self.cfg = cfg
        if writer:  # tlkv's fastest mode: the process keeps what a large put frees
            from kvstore.store import keep_freed_memory

            keep_freed_memory()
        self.client = Client(cfg["url"])
        self.mc = mooncake_client(
            cfg["master_port"], cfg["meta_port"], SEGMENT if writer else 0, LOCAL_BUFFER
        )
        # The same layout against the master that persists values (--root_fs_dir, run()).
        self.mcp = mooncake_client(
            cfg["persist_port"], cfg["persist_meta"], SEGMENT if writer else 0, LOCAL_BUFFER
        )
        self.single = int(cfg["single"])
        self.buf = np.zeros(cfg["n"] * self.single, np.uint8)
        for mc in (self.mc, self.mcp):
            if mc.register_buffer(self.buf.ctypes.data, self.buf.nbytes) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
        self.ptrs = [self.buf.ctypes.data + i * self.single for i in range(cfg["n"])]
        self.store: Any = None
        self.local: Any = None  # tlkv durable in this process: a store directory of its own
        self.floor: LmdbFloor | None = None

    # --- writer -----------------------------------------------------------------------

    def puts(self, seed: int) -> dict[str, Any]:
        """Every put row of one run; the blocks read later are the durable batch's."""
        from kvstore import Store, join

        n = self.cfg["n"]
        out: dict[str, Any] = {}
        sets = [_envelopes(n, seed * 10 + k) for k in range(4)]
        keys = [[f"{seed}-{k}-{h:016x}" for h in sets[k][0]] for k in range(4)]

        def timed(fn: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        out["tlkv_durable_one"] = timed(lambda: [self.client.put(e) for e in sets[0][1]])
        batches = [join(sets[1][1]), join(sets[3][1])]  # envelopes an engine encodes whole
        out["tlkv_durable_batch"] = timed(lambda: self.client.put(batches[0]))
        if self.store is None:
            self.store = Store(self.cfg["data"], sync=False)
        out["tlkv_fast_one"] = timed(lambda: [self.store.put(e) for e in sets[2][1]])
        out["tlkv_fast_batch"] = timed(lambda: self.store.put(batches[1]))
        if self.local is None:
            self.local = Store(self.cfg["local"])
        out["tlkv_local_durable_one"] = timed(lambda: [self.local.put(e) for e in sets[0][1]])
        out["tlkv_local_durable_batch"] = timed(lambda: self.local.put(batches[0]))
        if self.floor is None:
            self.floor = LmdbFloor(self.cfg["lmdb"])
        out["lmdb_fast_one"] = self.floor.put(*sets[2], batched=False)
        out["lmdb_fast_batch"] = self.floor.put(*sets[3], batched=True)
        mc = self.mc
        one = timed(lambda: [check_rc(mc.put(k, e)) for k, e in zip(keys[0], sets[0][1])])
        for i, e in enumerate(sets[2][1]):
            self.buf[i * self.single : (i + 1) * self.single] = np.frombuffer(e, np.uint8)
        sizes = [self.single] * n
        one_reg = timed(
            lambda: [check_rc(mc.put_from(k, p, self.single)) for k, p in zip(keys[2], self.ptrs)]
        )
        batch = timed(lambda: check_rc(mc.put_batch(keys[1], sets[1][1])))
        batch_reg = timed(lambda: check_rc(mc.batch_put_from(keys[3], self.ptrs, sizes)))
        out["mc_one"], out["mc_one_reg"] = one, one_reg
        out["mc_batch"], out["mc_batch_reg"] = batch, batch_reg
        files = os.path.join(self.cfg["files"], f"run-{seed}")  # removed by drop()
        os.makedirs(files, exist_ok=True)
        for durable in (True, False):  # what this disk allows: the same bytes as files
            kind = "durable" if durable else "fast"
            out[f"file_{kind}_one"] = file_write(files, sets[0][1], durable, batched=False)
            out[f"file_{kind}_batch"] = file_write(files, sets[1][1], durable, batched=True)
        # Mooncake's persisting puts last: its files' pages are not written back in the floors.
        out.update(self._persisted_puts(sets, [_persisted(ks) for ks in keys]))
        os.sync()  # the reads that follow are not timed against the writeback of these puts
        out["hashes"] = sets[1][0]  # the durable batch: read by the reader
        out["keys"] = keys[1]
        out["all_hashes"] = [h for s in sets for h in s[0]]
        out["all_keys"] = [k for ks in keys for k in ks]
        out["persist_keys"] = _persisted(keys[1])
        return out

    def _persisted_puts(self, sets: list[Any], keys: list[list[str]]) -> dict[str, float]:
        """The Mooncake puts again against the persisting master: plain and registered,
        one by one and batched (the registered buffer holds ``sets[2]``'s envelopes). Each
        call's time to return (``mcp_*``), and until its values are all in its files
        (``mcpf_*``: the master's client writes them on a thread pool after the put
        returns; polled every ``FILES_POLL`` seconds, names first, sizes of the call's own).

        Raises:
            RuntimeError: a call's files did not hold what it put within 60 s.
        """
        mc, n, size = self.mcp, self.cfg["n"], self.single
        calls: dict[str, tuple[int, Callable[[], object]]] = {
            "one": (0, lambda: [check_rc(mc.put(k, e)) for k, e in zip(keys[0], sets[0][1])]),
            "one_reg": (
                2,
                lambda: [check_rc(mc.put_from(k, p, size)) for k, p in zip(keys[2], self.ptrs)],
            ),
            "batch": (1, lambda: check_rc(mc.put_batch(keys[1], sets[1][1]))),
            "batch_reg": (
                3,
                lambda: check_rc(mc.batch_put_from(keys[3], self.ptrs, [size] * n)),
            ),
        }
        out = {}
        for name, (k, call) in calls.items():
            names = set(keys[k])
            t0 = time.perf_counter()
            call()
            out[f"mcp_{name}"] = time.perf_counter() - t0
            deadline = t0 + 60
            while _files_bytes(self.cfg["persist_dir"], names) < n * size:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"Mooncake's persisting master: {name}'s files short")
                time.sleep(FILES_POLL)
            out[f"mcpf_{name}"] = time.perf_counter() - t0
        return out

    def drop(self, hashes: list[int], keys: list[str]) -> None:
        """Remove a run's blocks from both, and its files (the disk and the DRAM segment
        stay bounded)."""
        shutil.rmtree(self.cfg["files"], ignore_errors=True)
        for h in hashes:
            self.store.delete(h)
            self.local.delete(h)
        if self.floor is not None:
            self.floor.delete(hashes)
        for mc, names in ((self.mc, list(keys)), (self.mcp, _persisted(keys))):
            left = names
            deadline = time.monotonic() + 30
            while left:  # a key read lately is under its lease (the master's default 10 s)
                left = [k for k in left if mc.remove(k) not in (0, OBJECT_NOT_FOUND)]
                if left and time.monotonic() > deadline:
                    raise RuntimeError(f"Mooncake kept {len(left)} removed keys for 30 s")
                if left:
                    time.sleep(0.5)

    # --- reader -----------------------------------------------------------------------

    def reads(self, hashes: list[int], keys: list[str]) -> dict[str, Any]:
        """Every read row of one run (after one warm-up read of each kind)."""
        n = len(hashes)
        mc, size, out = self.mc, self.single, {}
        sizes = [size] * n

        def checked(data: Any) -> None:
            if data is None or len(data) != size:
                raise RuntimeError("a block read back short")

        total = n * size + 0
        into = memoryview(bytearray(n * size + 4096))

        def whole(data: Any) -> None:
            if len(data) < total - 4096:
                raise RuntimeError("the prefix is not whole")

        # Each row's calls, tlkv's and Mooncake's, take turns (module docstring).
        out.update(
            interleaved_medians(
                {
                    "tlkv_get_one": lambda: [checked(self.client.get(h)) for h in hashes],
                    "mc_get_one": lambda: [checked(mc.get(k)) for k in keys],
                    "mc_get_one_reg": lambda: [
                        check_rc(mc.get_into(k, p, size)) for k, p in zip(keys, self.ptrs)
                    ],
                    "tlkv_local_one": lambda: [
                        self._local_into(h, i * size, size) for i, h in enumerate(hashes)
                    ],
                },
                READ_ROUNDS,
            )
        )
        out.update(
            interleaved_medians(
                {
                    "tlkv_prefix": lambda: whole(self.client.prefix(hashes=hashes)),
                    "tlkv_prefix_into": lambda: whole(self.client.prefix_into(into, hashes=hashes)),
                    "mc_batch_get_into": lambda: check_rc(
                        mc.batch_get_into(keys, self.ptrs, sizes)
                    ),
                },
                READ_ROUNDS,
            )
        )
        rng = np.random.default_rng(len(keys))
        absent = [int(h) for h in rng.integers(2**63, 2**64 - 1, EXIST_KEYS - n, np.uint64)]
        queries = hashes + absent
        mc_queries = keys + [f"absent-{h:016x}" for h in absent]
        t_has, t_exist = [], []
        for _ in range(EXIST_CALLS):
            t0 = time.perf_counter()
            found = self.client.has_blocks(queries).present
            t_has.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            exist = mc.batch_is_exist(mc_queries)
            t_exist.append(time.perf_counter() - t0)
        if sum(found) != n or sum(1 for e in exist if e == 1) != n:
            raise RuntimeError("existence answers differ from what was stored")
        out["tlkv_has"] = statistics.median(t_has)
        out["mc_exist"] = statistics.median(t_exist)
        return out

    def _local_into(self, block_hash: int, at: int, size: int) -> None:
        """One block read as a same-host engine reads its store directory: the server's
        directory opened in this process, the CRC-checked view copied into the buffer."""
        from kvstore import Store

        if self.store is None:
            self.store = Store(self.cfg["data"])
        [view] = self.store.get_buffers([block_hash])
        self.buf[at : at + size] = np.frombuffer(view, np.uint8)
        view.release()

    def after_restart(
        self, url: str, hashes: list[int], keys: list[str], persist_keys: list[str]
    ) -> dict[str, Any]:
        """What each finds of the blocks after the servers restarted (tlkv's at ``url``;
        Mooncake's masters, the writer's segments still mounted in its process)."""
        from kvstore.client import Client

        self.client.close()
        self.client = Client(url)
        t0 = time.perf_counter()
        data = self.client.prefix(hashes=hashes)
        t_tlkv = time.perf_counter() - t0
        blocks = (len(data) - 4096) // self.single if len(data) > self.single else 0
        found = self.client.has_blocks(hashes).prefix
        return {
            "tlkv_found": found,
            "tlkv_blocks": blocks,
            "tlkv_s": t_tlkv,
            "mc": self._mc_found(self.mc, keys),
            "mcp": self._mc_found(self.mcp, persist_keys),
        }

    def _mc_found(self, mc: Any, keys: list[str]) -> str:
        """How many of ``keys`` a Mooncake client finds, and how many read back whole."""
        try:
            t0 = time.perf_counter()
            exist = mc.batch_is_exist(keys)
            t_exist = time.perf_counter() - t0
            sizes = [self.single] * len(keys)
            got = mc.batch_get_into(keys, self.ptrs[: len(keys)], sizes)
            whole = sum(1 for rc in got if rc == self.single)
        except Exception as exc:  # whatever the peer does is the measurement
            return f"error: {type(exc).__name__}: {exc}"
        found = sum(1 for e in exist if e == 1)
        return f"{found} of {len(keys)} keys exist ({t_exist * 1e3:.1f} ms), {whole} read back"

    def close(self) -> None:
        self.client.close()
        for store in (self.store, self.local):
            if store is not None:
                store.close()
        if self.floor is not None:
            self.floor.close()
        for mc in (self.mc, self.mcp):
            with contextlib.suppress(Exception):
                mc.close()


def run(args: argparse.Namespace) -> list[Row]:
    import multiprocessing

    from kvstore import Geometry

    quick = bool(args.quick)
    runs = 1 if quick else RUNS
    n = 8 if quick else 64
    g = Geometry(*GEOMETRY)
    single = g.envelope_bytes(1, 1)
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-peers-", dir=base))
    ctx = multiprocessing.get_context("spawn")
    server = None
    masters: list[Any] = []
    workers: list[BenchProcess] = []
    logs: list[Any] = []
    persist = [f"--root_fs_dir={root / 'mooncake-files'}"]
    (root / "mooncake-files").mkdir()  # Mooncake's clients refuse a directory not there
    try:
        server = start_tlkv(root / "store", root / "tlkv.log", max_body="256MiB")
        master, mport, meta, log = start_master(root)
        masters.append(master)
        logs.append(log)
        pmaster, pport, pmeta, log = start_master(root, flags=persist, name="persisting_master")
        masters.append(pmaster)
        logs.append(log)
        cfg = {
            "url": f"http://127.0.0.1:{server.port}",
            "data": str(root / "store"),
            "files": str(root / "files"),
            "lmdb": str(root / "lmdb-floor"),
            "local": str(root / "local-store"),
            "master_port": mport,
            "meta_port": meta,
            "persist_dir": str(root / "mooncake-files"),
            "persist_port": pport,
            "persist_meta": pmeta,
            "n": n,
            "single": single,
        }
        writer = BenchProcess(ctx, _Side, cfg, True)
        workers.append(writer)  # stopped at the end even if it fails to start
        writer.ready(120)
        reader = BenchProcess(ctx, _Side, cfg, False)
        workers.append(reader)
        reader.ready(120)
        loop = loopback_rate(ctx, n * single, max(3, runs))
        results = []
        last: dict[str, Any] = {}
        for r in range(runs):
            put = writer.call("puts", r + 1)
            got = reader.call("reads", put["hashes"], put["keys"])
            timed = {k: v for k, v in put.items() if k.startswith(("tlkv", "mc", "file", "lmdb"))}
            results.append({**timed, **got})
            if r < runs - 1:
                writer.call("drop", put["all_hashes"], put["all_keys"])
            last = put
        # The servers restart; the reader asks again for the last run's blocks.
        server.stop()
        for m in masters:
            stop_master(m)
        masters = []
        server = start_tlkv(root / "store", root / "tlkv.log", max_body="256MiB")
        for port, mmeta, flags, name in (
            (mport, meta, [], "mooncake_master"),
            (pport, pmeta, persist, "persisting_master"),
        ):
            master, _, _, log = start_master(root, port, mmeta, flags, name)
            masters.append(master)
            logs.append(log)
        url = f"http://127.0.0.1:{server.port}"
        restart = reader.call(
            "after_restart", url, last["hashes"], last["keys"], last["persist_keys"]
        )
    finally:
        for w in workers:
            w.stop()
        if server is not None:
            server.stop()
        for m in masters:
            stop_master(m)
        for log in logs:
            log.close()
        shutil.rmtree(root, ignore_errors=True)
    return table(results, restart, loop, n, single, runs, judged=not quick)
