"""``tlkv scrub``: one pass of the store's scrub in the foreground (``kvstore.store.scrub``).

Re-checks every stored block's CRC-32C and every sequence, quarantines what fails and,
with ``--repair-from``, reads valid copies back from that tier: blocks found now, and
blocks quarantined before (by an earlier scrub or a read) and not stored again since. A
progress bar is drawn on stderr when it is a terminal. Exit 0 when every block and
sequence is sound or was repaired; 1 when a corrupt block stays quarantined (no tier, or
the tier holds no valid copy) or a sequence stays damaged (each is named on stderr);
``--forget-unrepaired`` then drops the records of what stays, so that later passes no
longer report it. A store directory whose ``data.mdb`` is missing, empty or truncated
is refused (exit 1) before anything opens it. While the store is open with
``--repair-from`` its blocks pending upload to that tier are uploaded too, as ``tlkv
serve --tier`` would.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .archive import ProgressBar
from .common import EXIT_FAILURE, EXIT_OK, rate_arg


def _cmd_scrub(args: argparse.Namespace) -> int:
    from ..store.lmdbenv import check_data_file
    from ..store.scrub import scrub_pass
    from ..store.store import Store

    if not os.path.isdir(args.data):
        raise FileNotFoundError(f"no store at {args.data!r}")
    check_data_file(args.data)
    bar = ProgressBar("scrub", enabled=not args.quiet)
    with Store(args.data, tier=args.repair_from, tier_endpoint=args.tier_endpoint) as store:
        total = sum(store.model(m).stats()["blocks"] or 0 for m in store.models())
        bar.start(total)
        done = [0, 0]

        def on_batch(blocks: int, nbytes: int, found: int, repaired: int) -> None:
            done[0] += blocks
            done[1] += nbytes
            bar.update(done[0], done[1])

        report = scrub_pass(
            store, rate=args.rate, on_batch=on_batch, forget_unrepaired=args.forget_unrepaired
        )
        bar.close()
    forgotten = "; forgotten" if args.forget_unrepaired else ""
    for model, h in report.unrepaired:
        print(
            f"tlkv scrub: block {h:016x} of model {model!r}: corrupt, quarantined, not "
            f"repaired{forgotten}",
            file=sys.stderr,
        )
    for model, name in report.lost:
        print(
            f"tlkv scrub: sequence {name!r} of model {model!r}: its record failed its "
            f"CRC-32C, quarantined, not repaired (a tier holds blocks only){forgotten}",
            file=sys.stderr,
        )
    for model, name, missing in report.incomplete:
        print(
            f"tlkv scrub: sequence {name!r} of model {model!r}: {missing} of its blocks are "
            "not stored (put them again, or delete the sequence)",
            file=sys.stderr,
        )
    if not args.quiet:
        earlier = f", {report.earlier} quarantined earlier" if report.earlier else ""
        damaged = len(report.lost) + len(report.incomplete)
        print(
            f"scrub: {report.blocks} blocks, {report.bytes} bytes checked in "
            f"{report.seconds:.2f} s; {report.found} corrupt{earlier}, {report.repaired} "
            f"repaired; {report.sequences} sequences, {damaged} damaged",
            file=sys.stderr,
        )
    forgettable = report.unrepaired or report.lost
    stays = report.incomplete or (forgettable and not args.forget_unrepaired)
    return EXIT_FAILURE if stays else EXIT_OK


def register(sub: Any) -> None:
    """Add ``scrub`` to the ``tlkv`` subcommands."""
    p = sub.add_parser("scrub", help="re-check every block's CRC; quarantine and repair what fails")
    p.add_argument("--data", required=True, help="store directory")
    p.add_argument(
        "--repair-from",
        default=None,
        metavar="URL",
        help="tier to repair from: s3://bucket/prefix (AWS_* env) or file:///path",
    )
    p.add_argument(
        "--tier-endpoint", default=None, help="S3-compatible server URL (else AWS_ENDPOINT_URL)"
    )
    p.add_argument(
        "--rate",
        type=rate_arg,
        default=0,
        help="bytes per second at most, e.g. 256MiB/s (0: no limit)",
    )
    p.add_argument(
        "--forget-unrepaired",
        action="store_true",
        help="after reporting them, stop tracking what stays corrupt (the loss is accepted)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=_cmd_scrub)
