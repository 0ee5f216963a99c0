"""Shared timing helpers and the result table of tools/bench.py."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


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
