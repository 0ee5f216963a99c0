"""``tlkv archive``: create, restore, verify, list and extract archives.

Imported lazily by ``kvstore.cli``. Exit codes follow ``tlkv verify``: 3 a malformed or
unsafe archive or envelope, 4 a geometry mismatch, 5 an unsupported version, 1 anything
else (a missing block, an I/O error). Long operations draw a progress bar on stderr when
it is a terminal, and stay quiet otherwise or with ``--quiet``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any, TextIO

from ..errors import TlkvError
from ..protocol import parse_hash_hex
from .common import (
    EXIT_FAILURE,
    EXIT_INCONSISTENT,
    EXIT_OK,
    exit_code_for,
    geometry_arg,
    model_arg,
)

BAR_WIDTH = 24
REFRESH_SECONDS = 0.1


class ProgressBar:
    """A one-line progress bar on a terminal: blocks, MB/s and ETA (``archive.Progress``)."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.phase = ""
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.total_blocks = 0
        self.t0 = time.monotonic()
        self.last = 0.0
        self.drawn = False

    def start(self, total_blocks: int, phase: str = "") -> None:
        """Begin a phase over ``total_blocks`` blocks (restore validates, then imports)."""
        if self.drawn and phase != self.phase:
            self.stream.write("\n")  # keep the finished phase's line
        self.total_blocks, self.phase = total_blocks, phase
        self.t0 = time.monotonic()

    def update(self, blocks: int, nbytes: int) -> None:
        """Redraw (at most every 0.1 s)."""
        now = time.monotonic()
        if not self.enabled or now - self.last < REFRESH_SECONDS:
            return
        self.last = now
        self._draw(blocks, nbytes, now)

    def _draw(self, blocks: int, nbytes: int, now: float) -> None:
        """The fraction and ETA come from blocks (what the totals count); MB/s from bytes."""
        elapsed = max(now - self.t0, 1e-9)
        rate = nbytes / elapsed
        total = self.total_blocks
        frac = min(blocks / total, 1.0) if total else 1.0
        filled = int(frac * BAR_WIDTH)
        eta = (total - blocks) * elapsed / blocks if 0 < blocks < total else 0.0
        label = f"{self.label} ({self.phase})" if self.phase else self.label
        line = (
            f"\r{label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
            f"{blocks}/{total} blocks  {rate / 1e6:7.1f} MB/s  "
            f"ETA {int(eta) // 60}:{int(eta) % 60:02d} "
        )
        self.stream.write(line)
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """End the line."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _open_store(data: str, *, must_exist: bool, allow_nonfinite: bool = False) -> Any:
    from ..store.store import Store

    if must_exist and not os.path.isdir(data):
        raise FileNotFoundError(f"no store at {data!r}")
    return Store(data, allow_nonfinite=allow_nonfinite)


def _cmd_create(args: argparse.Namespace) -> int:
    from ..archive.operations import create

    bar = ProgressBar("create", enabled=not args.quiet)
    with _open_store(args.data, must_exist=True) as root:
        try:
            summary = create(
                root,
                args.output,
                models=args.model,
                level=args.level,
                sequences=args.sequence or None,
                threads=args.threads,
                progress=bar,
                allow_skipped=args.allow_skipped,
            )
        finally:
            bar.close()
    for line in summary.skipped:
        print(f"tlkv archive create: skipped {line}", file=sys.stderr)
    if not args.quiet:
        m = summary.manifest
        ids = ", ".join(x.model for x in m.sections())
        print(
            f"wrote {args.output}: {m.blocks} blocks, {m.sequences} sequences of {ids}, "
            f"{summary.archive_bytes} bytes ({summary.data_bytes} uncompressed)"
        )
    return EXIT_OK


def _renames(values: list[tuple[str | None, str]] | None) -> tuple[str | None, dict[str, str]]:
    """``--as NEW`` (the archive's only model) and ``--as OLD=NEW`` options."""
    single: str | None = None
    renames: dict[str, str] = {}
    for old, new in values or []:
        if old is None:
            if single is not None:
                raise ValueError("--as NEW may be given once")
            single = new
        elif renames.setdefault(old, new) != new:
            raise ValueError(f"--as renames the model {old!r} twice")
    return single, renames


def _cmd_restore(args: argparse.Namespace) -> int:
    from ..archive.operations import restore

    single, renames = _renames(args.rename)
    bar = ProgressBar("restore", enabled=not args.quiet)
    created = not os.path.exists(args.data)
    try:
        with _open_store(
            args.data, must_exist=False, allow_nonfinite=args.allow_nonfinite
        ) as store:
            try:
                report = restore(
                    args.file,
                    store,
                    partial=args.partial,
                    threads=args.threads,
                    progress=bar,
                    model=single,
                    renames=renames,
                )
            finally:
                bar.close()
    except BaseException:
        if created:  # a refused restore into a new directory leaves no empty store behind
            shutil.rmtree(args.data, ignore_errors=True)
        raise
    for problem in report.problems:
        print(f"tlkv archive restore: skipped {problem}", file=sys.stderr)
    if not args.quiet:
        print(
            f"restored {report.blocks} blocks ({report.new_blocks} new), "
            f"{report.sequences} sequences; {len(report.problems)} problems"
        )
    if report.problems:
        return max(exit_code_for(p.error) for p in report.problems)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..archive.operations import verify

    bar = ProgressBar("verify", enabled=not args.quiet)
    try:
        report = verify(
            args.file,
            geometry=args.geometry,
            allow_nonfinite=args.allow_nonfinite,
            threads=args.threads,
            progress=bar,
        )
    finally:
        bar.close()
    if not args.quiet:
        m = report.manifest
        models = "; ".join(
            f"model {x.model}: {x.blocks} blocks, {x.sequences} sequences" for x in m.sections()
        )
        print(
            f"ok: {m.blocks} blocks, {m.sequences} sequences, "
            f"{report.data_bytes} bytes in {report.frames} frames ({models})"
        )
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    from ..archive.manifest import block_member, sequence_member
    from ..archive.operations import list_archive

    listing = list_archive(args.file)
    if args.json:
        json.dump(listing.to_dict(), sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    m = listing.manifest
    sections = m.sections()
    several = len(sections) > 1
    if several:
        print(f"# {m.tool}, archive v{m.archive_version}, {len(sections)} models, ", end="")
        print(f"{m.blocks} blocks, {m.sequences} sequences")
    for x in sections:
        g = x.geometry
        dims = (
            "-"
            if g is None
            else f"B={g.block_tokens} L={g.n_layers} Hkv={g.n_kv_heads} D={g.head_dim}"
        )
        head = f"# {x.prefix}: " if several else f"# {m.tool}, archive v{m.archive_version}, "
        print(f"{head}model {x.model}, {dims}, {x.blocks} blocks, {x.sequences} sequences")
    out = sys.stdout
    prefix = {x.model: x.prefix for x in sections}
    for h, model_id in zip(listing.hashes.tolist(), listing.model_of()):
        out.write(f"{block_member(h, prefix[model_id])}\n")
    for s in listing.sequences:
        tail = " +tail" if s.tail else ""
        out.write(f"{sequence_member(s.name, prefix[s.model])}  {len(s.hashes)} blocks{tail}\n")
    return EXIT_OK


def _cmd_extract(args: argparse.Namespace) -> int:
    from ..archive.operations import extract_all, extract_checked

    if args.all:
        if args.hashes or args.model is not None:
            raise ValueError("give block hashes (and --model) or --all, not both")
        n = extract_all(args.file, args.output)
        if not args.quiet:
            print(f"extracted {n} members into {args.output}")
        return EXIT_OK
    if len(args.hashes) != 1:
        raise ValueError("extract takes one block hash (or --all)")
    block_hash = parse_hash_hex(args.hashes[0])
    done = extract_checked(args.file, block_hash, args.output, model=args.model)
    if not args.quiet and args.output != "-":
        print(f"wrote {args.output}: {done.size} bytes")
    if not done.findings:
        return EXIT_OK
    # The block is valid by every rule; the archive around it is not what it claims.
    print(
        f"tlkv archive extract: the block is valid, but the archive is inconsistent where "
        f"it looked ({len(done.findings)} findings); run `tlkv archive verify`:",
        file=sys.stderr,
    )
    for finding in done.findings[:20]:
        print(f"  {finding}", file=sys.stderr)
    if len(done.findings) > 20:
        print(f"  ... and {len(done.findings) - 20} more", file=sys.stderr)
    return EXIT_INCONSISTENT


def _run(func: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except KeyError as exc:  # a block or sequence that is not there
            print(f"tlkv archive {args.archive_command}: {exc.args[0]}", file=sys.stderr)
            return EXIT_FAILURE
        except TlkvError as exc:
            print(
                f"tlkv archive {args.archive_command}: {type(exc).__name__}: {exc}", file=sys.stderr
            )
            return exit_code_for(exc)

    return wrapped


def rename_arg(text: str) -> tuple[str | None, str]:
    """argparse type for ``--as NEW`` or ``--as OLD=NEW`` (a model id has no ``=``)."""
    old, sep, new = text.rpartition("=")
    return (model_arg(old) if sep else None), model_arg(new)


def register(sub: Any) -> None:
    """Add the ``archive`` command group to the ``tlkv`` parser."""

    p = sub.add_parser("archive", help="create, restore, verify, list and extract archives")
    group = p.add_subparsers(dest="archive_command", required=True, metavar="ACTION")

    def common(q: argparse.ArgumentParser, threads: bool = True) -> None:
        q.add_argument("--quiet", action="store_true", help="no progress bar or summary")
        if threads:
            q.add_argument("--threads", type=int, default=0, help="worker threads (0: per CPU)")

    q = group.add_parser("create", help="archive a store (a consistent snapshot)")
    q.add_argument("--data", required=True, help="the store's directory")
    q.add_argument("-o", "--output", required=True, help="archive file to write")
    q.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    q.add_argument(
        "--model",
        type=model_arg,
        action="append",
        default=None,
        metavar="ID",
        help="a model to archive (repeatable; default: every model of the store)",
    )
    q.add_argument(
        "--sequence",
        action="append",
        metavar="NAME",
        help="archive only this sequence and its blocks (repeatable)",
    )
    q.add_argument(
        "--allow-skipped",
        action="store_true",
        help="write the archive even if a sequence or a corrupt block is left out "
        "(default: exit 7, nothing written)",
    )
    common(q)
    q.set_defaults(func=_run(_cmd_create))

    q = group.add_parser("restore", help="validate an archive, then import it into a store")
    q.add_argument("file")
    q.add_argument("--data", required=True, help="the store's directory (created if missing)")
    q.add_argument(
        "--as",
        dest="rename",
        type=rename_arg,
        action="append",
        default=None,
        metavar="[OLD=]NEW",
        help="restore the archive's model OLD (or its only model) as NEW (repeatable; "
        "default: every model keeps its id)",
    )
    q.add_argument(
        "--partial", action="store_true", help="restore the valid members, report the rest"
    )
    q.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="store NaN/Inf values and out-of-range v2 scales verbatim (refused by default)",
    )
    common(q)
    q.set_defaults(func=_run(_cmd_restore))

    q = group.add_parser("verify", help="check every member of an archive")
    q.add_argument("file")
    q.add_argument("--geometry", type=geometry_arg, default=None, help="B,L,H,D to require")
    q.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="accept NaN/Inf values and out-of-range v2 scales (refused by default, as restore)",
    )
    common(q)
    q.set_defaults(func=_run(_cmd_verify))

    q = group.add_parser("ls", help="list an archive's members (from its index)")
    q.add_argument("file")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=_run(_cmd_ls))

    q = group.add_parser("extract", help="extract one block (reads only its frame), or --all")
    q.add_argument("file")
    q.add_argument("hashes", nargs="*", metavar="HASH", help="block hash (16 hex digits)")
    q.add_argument("-o", "--output", required=True, help="output file (a directory with --all)")
    q.add_argument("--all", action="store_true", help="every member, into a new directory")
    q.add_argument(
        "--model",
        type=model_arg,
        default=None,
        metavar="ID",
        help="the model of the block (needed when the archive holds several)",
    )
    common(q, threads=False)
    q.set_defaults(func=_run(_cmd_extract))
