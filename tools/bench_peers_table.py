"""The table ``tools/bench.py peers`` prints (``bench_peers``): each row a tlkv figure
against the peer's in the same run, as rates of the run's bytes and fractions of the
loopback socket copy, and the per-run ratio's median and spread."""

from __future__ import annotations

import statistics
from typing import Any

from bench_common import Row

EXIST_KEYS = 8192  # keys asked per existence call, the run's blocks among them
EXIST_CALLS = 20
FAST_MODE = "Store(sync=False), keep_freed_memory()"  # the writer's fastest-mode label
PERSIST = "Mooncake with file persistence (--root_fs_dir: a file per value, no fsync)"


def _med(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def table(
    results: list[dict[str, Any]],
    restart: dict[str, Any],
    loop: float,
    n: int,
    single: int,
    runs: int,
    judged: bool,
) -> list[Row]:
    """The table; ``judged``: targets are checked (not in a ``--quick`` smoke run)."""
    nbytes = n * single

    def rate(seconds: float) -> str:
        return f"{nbytes / seconds / 1e9:.2f} GB/s ({nbytes / seconds / loop:.2f} of loopback)"

    def ratio_row(name: str, ours: str, peer: str | tuple[str, str], target: float | None) -> Row:
        peers = (peer,) if isinstance(peer, str) else peer
        per_run = [min(r[p] for p in peers) / r[ours] for r in results]
        t_ours = _med(results, ours)
        t_peer = statistics.median(min(r[p] for p in peers) for r in results)
        spread = f"runs {min(per_run):.2f}-{max(per_run):.2f}x" if len(per_run) > 1 else ""
        ok = None if target is None or not judged else all(x >= target for x in per_run)
        return Row(
            f"{name} ({len(per_run)} runs{', ' + spread if spread else ''})",
            rate(t_ours),
            rate(t_peer),
            statistics.median(per_run),
            f">= {target}x" if target is not None else "",
            ok,
        )

    rows = [
        Row(f"loopback socket copy, {nbytes >> 20} MiB", f"{loop / 1e9:.2f} GB/s"),
        ratio_row(
            "put one by one, tlkv durable vs Mooncake DRAM",
            "tlkv_durable_one",
            ("mc_one", "mc_one_reg"),
            0.5,
        ),
        ratio_row(
            "put batched, tlkv durable vs Mooncake DRAM",
            "tlkv_durable_batch",
            ("mc_batch", "mc_batch_reg"),
            0.5,
        ),
        *(  # the same durable put without HTTP: a store directory in the writer's process
            ratio_row(
                f"put {how}, tlkv durable, Store() in the writer vs Mooncake DRAM",
                f"tlkv_local_durable_{way}",
                (f"mc_{way}", f"mc_{way}_reg"),
                0.5,
            )
            for way, how in (("one", "one by one"), ("batch", "batched"))
        ),
        ratio_row(
            f"put one by one, tlkv {FAST_MODE} vs Mooncake DRAM",
            "tlkv_fast_one",
            ("mc_one", "mc_one_reg"),
            None,
        ),
        ratio_row(
            f"put batched, tlkv {FAST_MODE} vs Mooncake DRAM",
            "tlkv_fast_batch",
            ("mc_batch", "mc_batch_reg"),
            1.0,
        ),
        *(  # against what this disk allows: the same bytes as a file (bench_floors.file_write)
            ratio_row(
                f"put {how}, tlkv {mode} vs {floor}",
                f"tlkv_{kind}_{way}",
                f"file_{kind}_{way}",
                None,
            )
            for kind, mode, sync in (
                ("durable", "durable", " + fdatasync"),
                ("fast", FAST_MODE, ""),
            )
            for way, how, floor in (
                ("one", "one by one", f"a file write{sync} each"),
                ("batch", "batched", f"one file write{sync}"),
            )
        ),
        *(  # against the peer's own persistence: its client also writes each value to a file
            ratio_row(
                f"put {how}, tlkv {mode} vs {PERSIST}, {until}",
                f"tlkv_{kind}_{way}",
                (f"{peer}_{way}", f"{peer}_{way}_reg"),
                None,
            )
            for kind, mode, peer, until in (
                ("fast", FAST_MODE, "mcp", "until its put returns"),
                ("fast", FAST_MODE, "mcpf", "until its files hold every value"),
                ("durable", "durable", "mcpf", "until its files hold every value"),
            )
            for way, how in (("one", "one by one"), ("batch", "batched"))
        ),
        *(  # tlkv's own work, and LMDB's, against the same puts (bench_floors.LmdbFloor)
            row
            for way, how, txns in (
                ("one", "one by one", "a transaction each"),
                ("batch", "batched", "one transaction"),
            )
            for row in (
                ratio_row(
                    f"put {how}, tlkv {FAST_MODE} vs plain py-lmdb, {txns}",
                    f"tlkv_fast_{way}",
                    f"lmdb_fast_{way}",
                    None,
                ),
                ratio_row(
                    f"put {how}, plain py-lmdb ({txns}, no fsync) vs Mooncake DRAM",
                    f"lmdb_fast_{way}",
                    (f"mc_{way}", f"mc_{way}_reg"),
                    None,
                ),
            )
        ),
        ratio_row(
            "get one by one, Client.get vs get/get_into",
            "tlkv_get_one",
            ("mc_get_one", "mc_get_one_reg"),
            2.0,
        ),
        ratio_row(  # a socket copy per block either way above; no socket here
            "get one by one, same host: Store.get_buffers on the server's directory, copied "
            "into a buffer, vs get/get_into",
            "tlkv_local_one",
            ("mc_get_one", "mc_get_one_reg"),
            None,
        ),
        ratio_row(
            f"whole {n}-block prefix, Client.prefix vs batch_get_into",
            "tlkv_prefix",
            "mc_batch_get_into",
            1.3,
        ),
        ratio_row(
            f"whole {n}-block prefix, Client.prefix_into vs batch_get_into",
            "tlkv_prefix_into",
            "mc_batch_get_into",
            None,
        ),
    ]
    t_has, t_exist = _med(results, "tlkv_has"), _med(results, "mc_exist")
    per_run = [r["mc_exist"] / r["tlkv_has"] for r in results]
    rows.append(
        Row(
            f"existence of {EXIST_KEYS:,} keys, p50 ({runs} runs x {EXIST_CALLS})",
            f"has_blocks {t_has * 1e3:.2f} ms",
            f"batch_is_exist {t_exist * 1e3:.2f} ms",
            statistics.median(per_run),
            "p50 <= peer's",
            all(x >= 1 for x in per_run) if judged else None,
        )
    )
    rows.append(
        Row(
            "after both servers restart",
            f"tlkv: {restart['tlkv_found']} of {n} blocks, prefix read in "
            f"{restart['tlkv_s'] * 1e3:.0f} ms",
            f"Mooncake: {restart['mc']}",
        )
    )
    rows.append(Row("after both servers restart, the persisting master", "", restart["mcp"]))
    return rows
