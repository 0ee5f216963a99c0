"""HTTP service benchmarks: GET throughput against a bare ASGI app, has-blocks latency,
durable PUT throughput, and a mixed load run (5xx, lost puts, worker RSS:
``bench_http_load``; the clients and parts: ``bench_http_clients``).

Both servers run as subprocesses with 2 workers, uvloop and httptools: ``tlkv serve`` on a
temporary store of 2 MiB v1 blocks (geometry 16, 32, 8, 128), and a bare uvicorn ASGI app
(``bench_bare_app``) answering every GET with the same 2 MiB bytes from memory, and the
same app checking the envelope's CRC-32C before each answer (tlkv's read check, kept on
every read: the baseline that does the same work). For PUT, besides in-process
``Store.put`` (no HTTP at all), the bare app storing each received body with
``Store.put`` in its own store: the same HTTP receive and durable put, none of tlkv's
service around them. The load generator is ``wrk`` when it is on PATH, else stdlib
``http.client`` keep-alive connections in several processes (httpx would be slower than
the server); the same generator drives both servers, so the ratio compares server cost
only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench_common import Row
from bench_http_clients import (
    block_envelopes,
    get_cpu,
    get_throughput,
    has_p50,
    join_envelopes,
    put_throughput,
    raw_lmdb_put,
    rehash_body,
    store_put,
)
from bench_http_load import load_run
from bench_servers import Server, start_bare, start_tlkv

from kvstore.protocol import HASHES_MEDIA_TYPE

GET_ROUNDS = 9  # interleaved wrk rounds per server (5 with --quick): the VM's CPU time
# per request drifts by up to 2x between rounds, so the median of many short ones
PUT_ROUNDS = 5  # the disk writes fresh pages at 0.2-0.5 GB/s: the median of five rounds


# --- the suite ---------------------------------------------------------------------------


def _median_index(values: list[float]) -> int:
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def _median_rows(
    label: str, value: str, baseline: str, ratios: list[float], limit: float, what: str
) -> list[Row]:
    """The median round's row and the per-round ``what`` under it. ``limit``: the target
    ratio, a ceiling when above 1 (CPU), a floor below 1 (throughput)."""
    mid = ratios[_median_index(ratios)]
    target, ok = (f"<= {limit}x", mid <= limit) if limit > 1 else (f">= {limit}x", mid >= limit)
    return [
        Row(label, value, baseline, mid, target, ok),
        Row(f"  (per-round {what}, {len(ratios)} rounds)", ", ".join(f"{x:.2f}x" for x in ratios)),
    ]


def _cpu_rows(label: str, ours: float, baseline: str, ratios: list[float]) -> list[Row]:
    """The median round's row (target <= 1.3x) and the per-round ratios under it."""
    return _median_rows(label, f"{ours * 1e6:.0f} us", baseline, ratios, 1.3, "CPU ratios")


def run(args: argparse.Namespace) -> list[Row]:
    """Run every HTTP measurement; rows for tools/bench.py's table."""
    import numpy as np

    quick = bool(args.quick)
    base = Path(os.environ.get("TLKV_BENCH_DIR", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="tlkv-bench-http-", dir=base))
    rows: list[Row] = []
    n_batches = 4 if quick else 8  # per PUT client; 8 blocks (16 MiB) per PUT
    get_seconds = 3.0
    get_rounds = 5 if quick else GET_ROUNDS
    load_seconds = 10.0 if quick else 60.0
    clients = 4
    servers: list[Server] = []
    try:
        tlkv = start_tlkv(root / "store", root / "tlkv.log")
        servers.append(tlkv)

        # Durable PUT: two clients, each sending 8-block envelopes of new blocks.
        batches: list[list[bytes]] = []
        hashes: list[int] = []
        for c in range(2):
            bodies = []
            for b in range(n_batches):
                hs = [((c + 1) << 32) + b * 8 + i + 1 for i in range(8)]
                hashes += hs
                bodies.append(join_envelopes([e for _, e in block_envelopes(hs)]))
            batches.append(bodies)
        # Interleaved with the baselines over fresh hashes each round; ratios per round.
        bare_put = start_bare(None, root / "bare-put.log", store=root / "bare-put-store")
        servers.append(bare_put)
        put_runs: list[tuple[float, float, float]] = []
        bare_puts: list[float] = []
        for r in range(PUT_ROUNDS):
            # Round 0 puts the blocks the GET and load runs read; later rounds new ones.
            rb = [[rehash_body(body, r) if r else body for body in bodies] for bodies in batches]
            store_gbps = store_put(root / f"store-put-{r}", rb)
            put_gbps = put_throughput(tlkv.port, rb)
            bare_puts.append(put_throughput(bare_put.port, rb))
            raw_gbps = raw_lmdb_put(root / f"raw-lmdb-{r}", rb)
            put_runs.append((put_gbps, store_gbps, raw_gbps))
        bare_put.stop()
        servers.remove(bare_put)
        ratios = [p / s_ for p, s_, _ in put_runs]
        mid = _median_index(ratios)
        put_gbps, store_gbps, raw_gbps = put_runs[mid]
        rows.append(
            Row(
                "PUT /v1/blocks durable, 16 MiB bodies, 2 clients (median round)",
                f"{put_gbps:.2f} GB/s",
                f"in-process Store.put, same bytes {store_gbps:.2f} GB/s",
                ratios[mid],
                ">= 0.8x",
                ratios[mid] >= 0.8,
            )
        )
        rows.append(
            Row(
                f"  (per-round ratios, {len(ratios)} rounds)",
                ", ".join(f"{x:.2f}x" for x in ratios),
                f"raw py-lmdb sync put {', '.join(f'{r_:.2f}' for *_, r_ in put_runs)} GB/s",
            )
        )
        fair = [p / b for (p, _, _), b in zip(put_runs, bare_puts)]
        fmid = _median_index(fair)
        rows += _median_rows(
            "  same vs the bare app receiving each body and calling Store.put",
            f"{put_runs[fmid][0]:.2f} GB/s",
            f"bare uvicorn ASGI + Store.put {bare_puts[fmid]:.2f} GB/s",
            fair,
            0.8,
            "ratios",
        )

        # GET throughput: tlkv vs the bare app serving the same 2 MiB bytes from memory.
        _h, blob = next(block_envelopes([hashes[0]]))
        blob_path = root / "blob.tlkv"
        blob_path.write_bytes(blob)
        bare = start_bare(blob_path, root / "bare.log")
        servers.append(bare)
        bare_crc = start_bare(blob_path, root / "bare-crc.log", check_crc=True)
        servers.append(bare_crc)
        paths = [f"/v1/blocks/{h:016x}" for h in hashes]
        gen = "wrk" if shutil.which("wrk") else "http.client"
        if gen == "wrk":
            # Server CPU per request (client and server share the cores): interleaved
            # rounds, the ratio of each round; the median round is the row.
            cpu_runs, crc_cpu = [], []
            for _ in range(get_rounds):
                b = get_cpu(bare, paths, get_seconds, clients)
                t = get_cpu(tlkv, paths, get_seconds, clients)
                c = get_cpu(bare_crc, paths, get_seconds, clients)
                if b is None or t is None or c is None:
                    raise RuntimeError("wrk gave no result")
                cpu_runs.append((t, b))
                crc_cpu.append(c[1])
            ratios = [t[1] / b[1] for t, b in cpu_runs]
            mid = _median_index(ratios)
            (t_get, t_cpu), (b_get, b_cpu) = cpu_runs[mid]
            rows += _cpu_rows(
                f"GET /v1/blocks/{{hash}}, 2 MiB, server CPU per request ({clients} conns)",
                t_cpu,
                f"bare uvicorn ASGI from memory {b_cpu * 1e6:.0f} us",
                ratios,
            )
            fair = [t[1] / c for (t, _), c in zip(cpu_runs, crc_cpu)]
            fmid = _median_index(fair)
            rows += _cpu_rows(
                "  same vs the bare app checking each body's CRC-32C (tlkv's read check)",
                cpu_runs[fmid][0][1],
                f"bare + crc_matches {crc_cpu[fmid] * 1e6:.0f} us",
                fair,
            )
            rows.append(
                Row(
                    "  same run, throughput (wrk)",
                    f"{t_get:.2f} GB/s",
                    f"bare {b_get:.2f} GB/s",
                    t_get / b_get,
                )
            )
            rows.append(
                Row(
                    "  (per-round GB/s, tlkv / bare)",
                    ", ".join(f"{t[0]:.2f}/{b[0]:.2f}" for t, b in cpu_runs),
                )
            )
        else:
            tlkv_runs, bare_runs = [], []
            for _ in range(2):  # interleaved, best of two each
                bare_runs.append(get_throughput(bare.port, paths, get_seconds, clients))
                tlkv_runs.append(get_throughput(tlkv.port, paths, get_seconds, clients))
            t_get, b_get = max(tlkv_runs), max(bare_runs)
            rows.append(
                Row(
                    f"GET /v1/blocks/{{hash}}, 2 MiB, {clients} conns ({gen})",
                    f"{t_get:.2f} GB/s",
                    f"bare uvicorn ASGI from memory {b_get:.2f} GB/s",
                    t_get / b_get,
                )
            )
        for extra in (bare, bare_crc):
            extra.stop()
            servers.remove(extra)

        # has-blocks, 8,192 hashes (the stored ones first, then absent ones).
        probe = np.array(hashes + [(7 << 56) + i for i in range(8192 - len(hashes))], "<u8")
        repeat = 100 if quick else 400
        p50_bin = has_p50(tlkv.port, probe.tobytes(), HASHES_MEDIA_TYPE, repeat)
        body = json.dumps({"hashes": [f"{int(h):016x}" for h in probe]}).encode()
        p50_json = has_p50(tlkv.port, body, "application/json", repeat)
        rows.append(
            Row(
                "POST /v1/has-blocks, 8,192 hashes, binary, p50",
                f"{p50_bin * 1e3:.2f} ms",
                target="<= 3 ms",
                ok=p50_bin <= 0.003,
            )
        )
        rows.append(
            Row(
                "POST /v1/has-blocks, 8,192 hashes, JSON, p50",
                f"{p50_json * 1e3:.2f} ms",
                target="<= 8 ms",
                ok=p50_json <= 0.008,
            )
        )

        # Mixed load: 16 clients, put/get/has-blocks.
        load = load_run(tlkv, hashes, load_seconds, 16)
        rows.append(
            Row(
                f"load: 16 clients x {load_seconds:.0f} s, {load['requests']} requests",
                f"{load['5xx']} 5xx, {len(load['errors'])} conn errors",
                target="0 5xx",
                ok=load["5xx"] == 0 and not load["errors"] and load["alive"],
            )
        )
        lost = load["missing"] + load["corrupt"]
        rows.append(
            Row(
                "load: acknowledged puts read back after the run",
                f"{load['acked'] - lost}/{load['acked']} intact",
                target="0 lost",
                ok=lost == 0,
            )
        )
        grew = load["rss_end"] - load["rss_mid"]
        rows.append(
            Row(
                "load: worker RSS (anon, 2 workers) start / mid / end",
                f"{load['rss_start']:.0f} / {load['rss_mid']:.0f} / {load['rss_end']:.0f} MiB",
                target="stable (2nd half < +64 MiB)",
                ok=grew < 64,
            )
        )
        if load["errors"]:
            print("connection errors:", load["errors"][:5], file=sys.stderr)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    from bench_common import print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print_table(run(parser.parse_args()))
