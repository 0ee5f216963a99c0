"""Benchmarks with ratios against baselines measured in the same run.

Usage: python tools/bench.py
       {codec,store,scale,http,archive,client,engine,grpc,tier,vllm,sglang,events,peers,fleet}
       [--quick] [--markdown]

Each suite lives in tools/bench_<suite>.py and exposes ``run(args) -> list[Row]``;
this script prints them as one table (Markdown with --markdown, for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repo, when not installed

from bench_common import print_table

SUITES = (
    "codec",
    "store",
    "scale",
    "http",
    "archive",
    "client",
    "engine",
    "grpc",
    "tier",
    "vllm",
    "sglang",
    "events",
    "peers",
    "fleet",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    module = importlib.import_module(f"bench_{args.suite}")
    rows = module.run(args)
    print_table(rows, markdown=args.markdown)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
