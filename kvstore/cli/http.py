"""The ``tlkv`` commands of the HTTP service: ``serve``, the client's ``put``/``get``/``has``,
and ``stats`` (of a server, or of a store directory).

Imported lazily by ``kvstore.cli``; fastapi, uvicorn and httpx are imported only inside
the commands, so the codec commands run without them. The client commands take the
token from ``--token-file`` or the ``TLKV_TOKEN`` environment variable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..protocol import is_hash_hex
from .common import EXIT_FAILURE, EXIT_OK, geometry_arg

_LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
DEFAULT_URL_HELP = "server base URL, e.g. http://127.0.0.1:8000"
PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's multiprocess mode


def _size_arg(text: str) -> int:
    from api.settings import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def _cmd_serve(args: argparse.Namespace) -> int:
    # Set before anything imports prometheus_client, which chooses between memory and
    # files at import. One process keeps its metrics in memory (and uvicorn ends it by
    # re-raising SIGTERM, past any cleanup); several workers write theirs to a fresh
    # private directory, summed by whichever worker answers a scrape and removed when
    # the supervisor returns.
    if args.workers == 1:
        os.environ.pop(PROMETHEUS_MULTIPROC_DIR, None)
        return _serve(args, None)
    metrics_dir = tempfile.mkdtemp(prefix="tlkv-metrics-")
    os.environ[PROMETHEUS_MULTIPROC_DIR] = metrics_dir
    try:
        return _serve(args, metrics_dir)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve(args: argparse.Namespace, metrics_dir: str | None) -> int:
    import uvicorn

    from api import settings as s

    env = {
        s.ENV_DATA: str(Path(args.data).resolve()),
        s.ENV_MAX_BODY: str(args.max_body),
    }
    if args.max_inflight is not None:
        env[s.ENV_MAX_INFLIGHT] = str(args.max_inflight)
    if args.allow_nonfinite:
        env[s.ENV_ALLOW_NONFINITE] = "1"
    if args.geometry is not None:
        env[s.ENV_GEOMETRY] = ",".join(map(str, args.geometry.as_tuple()))
    if args.capacity is not None:
        env[s.ENV_CAPACITY] = str(args.capacity)
    if args.token_file is not None:
        env[s.ENV_TOKEN_FILE] = str(Path(args.token_file).resolve())
    os.environ.update(env)  # the workers (spawned processes) inherit these
    settings = s.Settings.from_env()  # fail here, once, on a bad token file

    # Open and close the store once before any worker starts: a geometry mismatch or an
    # unusable directory is reported here instead of by every worker in a restart loop.
    from ..store.store import Store

    Store(settings.data, geometry=settings.geometry, capacity_bytes=settings.capacity_bytes).close()
    auth = "on" if settings.token else "off"
    metrics = "" if metrics_dir is None else f"metrics {metrics_dir}, "
    print(
        f"tlkv serve: data {settings.data}, auth {auth}, {args.workers} worker(s), "
        f"{metrics}http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=args.access_log,
    )
    return EXIT_OK


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        from api.settings import read_token_file

        return read_token_file(args.token_file)
    return os.environ.get("TLKV_TOKEN") or None


def _client(args: argparse.Namespace) -> Any:
    from ..client import Client

    return Client(args.url, token=_token(args))


def _run_client(args: argparse.Namespace, action: Any) -> int:
    import httpx

    try:
        with _client(args) as client:
            return int(action(client))
    except httpx.HTTPError as exc:
        print(f"tlkv {args.command}: {args.url}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _cmd_put(args: argparse.Namespace) -> int:
    data = Path(args.file).read_bytes()

    def action(client: Any) -> int:
        result = client.put(data)
        reply = {
            "stored": [f"{h:016x}" for h in result.stored],
            "duplicate": [f"{h:016x}" for h in result.duplicate],
            "partial": result.partial,
        }
        json.dump(reply, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK

    return _run_client(args, action)


def _cmd_get(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        data = client.get(args.hash, format=args.format)
        if data is None:
            print(f"tlkv get: block {args.hash} not found", file=sys.stderr)
            return EXIT_FAILURE
        if args.output == "-":
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            Path(args.output).write_bytes(data)
        return EXIT_OK

    return _run_client(args, action)


def _cmd_has(args: argparse.Namespace) -> int:
    if args.tokens is None and not args.hashes:
        print("tlkv has: give --tokens ... or one or more hashes", file=sys.stderr)
        return 2
    if args.tokens is not None and args.hashes:
        print("tlkv has: give --tokens or hashes, not both", file=sys.stderr)
        return 2

    def action(client: Any) -> int:
        if args.tokens is not None:
            result = client.has_blocks(tokens=args.tokens)
            names = [f"block {i}" for i in range(len(result.present))]
        else:
            result = client.has_blocks(hashes=args.hashes)
            names = list(args.hashes)
        if args.json:
            json.dump({"present": result.present, "prefix": result.prefix}, sys.stdout)
            sys.stdout.write("\n")
            return EXIT_OK
        for name, here in zip(names, result.present):
            print(f"{name} {'present' if here else 'absent'}")
        print(f"prefix {result.prefix}/{len(result.present)}")
        return EXIT_OK

    return _run_client(args, action)


def _print_stats(stats: dict[str, Any], as_json: bool) -> int:
    if as_json:
        json.dump(stats, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    for key, value in stats.items():
        print(f"{key:<16} {'-' if value is None else value}")
    return EXIT_OK


def _cmd_stats(args: argparse.Namespace) -> int:
    if (args.url is None) == (args.data is None):
        print("tlkv stats: give a server URL or --data DIR (one of them)", file=sys.stderr)
        return 2
    if args.data is not None:
        from ..store.store import Store

        if not Path(args.data).is_dir():
            print(f"tlkv stats: {args.data}: no store there", file=sys.stderr)
            return EXIT_FAILURE
        with Store(args.data) as store:
            stats: dict[str, Any] = dict(store.stats())
            g = store.geometry
        stats.pop("hits", None)  # this process's reads: none
        stats.pop("misses", None)
        stats = {"geometry": None if g is None else g.as_dict(), **stats}
        return _print_stats(stats, args.json)
    return _run_client(args, lambda client: _print_stats(client.info(), args.json))


def _add_token(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the bearer token (else $TLKV_TOKEN)")


def _hash_arg(text: str) -> str:
    if not is_hash_hex(text):
        raise argparse.ArgumentTypeError(f"a block hash is 16 lowercase hex digits: {text!r}")
    return text


def register(sub: Any) -> None:
    """Add ``serve``, ``put``, ``get`` and ``has`` to the ``tlkv`` subcommands."""
    p = sub.add_parser("serve", help="run the HTTP service (uvicorn) on a store")
    p.add_argument("--data", default="./tlkv-data", help="store directory (default ./tlkv-data)")
    p.add_argument("--geometry", type=geometry_arg, default=None, help="B,L,H,D of a new store")
    p.add_argument("--capacity", type=_size_arg, default=None, help="capacity, e.g. 2GiB")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=_positive_int, default=1, help="worker processes")
    p.add_argument("--token-file", default=None, help="bearer token file (else $TLKV_TOKEN)")
    p.add_argument(
        "--max-body", type=_size_arg, default=64 * 1024 * 1024, help="body limit (64MiB)"
    )
    p.add_argument(
        "--max-inflight",
        type=_size_arg,
        default=None,
        help="request-body bytes one worker holds at once; more wait, then 503 (2 x max-body)",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="store NaN/Inf values and out-of-range v2 scales verbatim (refused by default)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "stats", help="a store's counts, quarantined (corrupt) blocks included: server or --data"
    )
    p.add_argument("url", nargs="?", default=None, help=DEFAULT_URL_HELP)
    p.add_argument("--data", default=None, help="a store directory instead of a server")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_token(p)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("put", help="send an envelope's blocks to a server")
    p.add_argument("url", help=DEFAULT_URL_HELP)
    p.add_argument("file", help="envelope file")
    _add_token(p)
    p.set_defaults(func=_cmd_put)

    p = sub.add_parser("get", help="fetch one block's envelope from a server")
    p.add_argument("url", help=DEFAULT_URL_HELP)
    p.add_argument("hash", type=_hash_arg, help="16 lowercase hex digits")
    p.add_argument("-o", "--output", required=True, help="output file ('-' for stdout)")
    p.add_argument("--format", type=int, choices=[1, 2], default=None, help="transcode to")
    _add_token(p)
    p.set_defaults(func=_cmd_get)

    p = sub.add_parser("has", help="ask a server which blocks it holds")
    p.add_argument("url", help=DEFAULT_URL_HELP)
    p.add_argument("hashes", nargs="*", type=_hash_arg, help="block hashes")
    p.add_argument("--tokens", nargs="+", type=int, default=None, help="token ids instead")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_token(p)
    p.set_defaults(func=_cmd_has)
