"""Shared timing helpers, server-process helpers and the result table of tools/bench.py."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent


@dataclass
class Row:
    """One measured figure: what, the value, the baseline it is compared to, the target."""

    name: str
    value: str
    baseline: str = ""
    ratio: float | None = None
    target: str = ""
    ok: bool | None = None


def best_seconds(fn: Callable[[], object], repeat: int = 5, number: int = 1) -> float:
    """Best wall time of ``number`` calls of ``fn`` over ``repeat`` rounds, per call."""
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def median_seconds(fn: Callable[[], object], repeat: int = 50) -> float:
    """Median wall time of one call of ``fn`` over ``repeat`` calls."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    before: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time of one call of each of ``fns`` over ``repeat`` rounds, after one
    warm-up call each. Every round calls each once, in an order rotated round by round,
    so a slow spell of the machine falls on every side of a comparison alike. ``before``
    runs, untimed, before each timed call (e.g. a sweep that leaves the caches cold)."""
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if before is not None:
                before()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def gbps(nbytes: int, seconds: float) -> str:
    """Throughput as a string in GB/s (10^9 bytes per second)."""
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def print_table(rows: list[Row], markdown: bool = False) -> None:
    """Print rows as an aligned text table, or as Markdown."""
    header = ["measure", "value", "baseline (same run)", "ratio", "target", "met"]
    lines = [
        [
            r.name,
            r.value,
            r.baseline,
            "" if r.ratio is None else f"{r.ratio:.2f}x",
            r.target,
            "" if r.ok is None else ("yes" if r.ok else "NO"),
        ]
        for r in rows
    ]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())


def server_env() -> dict[str, str]:
    """The environment for a server subprocess: no inherited TLKV_* settings, the repo and
    the tools on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLKV_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TOOLS)])
    return env


def stop_process(proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """SIGTERM a server subprocess (SIGKILL after 30 s) and close its log."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
