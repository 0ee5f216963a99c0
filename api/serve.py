"""``tlkv serve``: the service's command, registered with the ``tlkv`` command line.

The library's CLI (``kvstore.cli``) never imports the service; it loads the command groups
that installed packages declare under the ``tlkv.commands`` entry point, and this module is
the service's (``pyproject.toml``). ``serve`` writes its options into ``TLKV_*`` variables
and starts uvicorn, whose workers (spawned processes) each build the app from them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstore.cli.common import EXIT_FAILURE, EXIT_OK, geometry_arg, positive_int, rate_arg
from kvstore.events.wire import TOPIC_TEMPLATE
from kvstore.protocol import MAX_MODELS, MAX_MODELS_LIMIT
from kvstore.store.eventlog import DEFAULT_EVENTS_LIMIT

from . import settings as s
from .bodies import DEFAULT_BODY_TIMEOUT, DEFAULT_MIN_BODY_RATE
from .settings import parse_size
from .uvicorn_check import http_protocol

PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's multiprocess mode
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, found {text!r}")
    return value


def _max_models_arg(text: str) -> int:
    if not text.isdigit() or int(text) > MAX_MODELS_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..{MAX_MODELS_LIMIT}")
    return int(text)


def _tier_arg(text: str) -> str:
    from kvstore.tier import parse_url

    try:
        parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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
    env = {
        s.ENV_DATA: str(Path(args.data).resolve()),
        s.ENV_MAX_BODY: str(args.max_body),
        s.ENV_HOST: args.host,
        s.ENV_ALLOWED_HOSTS: ",".join(args.allowed_hosts),
    }
    if args.max_inflight is not None:
        env[s.ENV_MAX_INFLIGHT] = str(args.max_inflight)
    env[s.ENV_MIN_BODY_RATE] = str(args.min_body_rate)
    env[s.ENV_BODY_TIMEOUT] = str(args.body_timeout)
    if args.allow_nonfinite:
        env[s.ENV_ALLOW_NONFINITE] = "1"
    if args.geometry is not None:
        env[s.ENV_GEOMETRY] = ",".join(map(str, args.geometry.as_tuple()))
    if args.capacity is not None:
        env[s.ENV_CAPACITY] = str(args.capacity)
    if args.preallocate:
        env[s.ENV_PREALLOCATE] = str(args.preallocate)
    if args.token_file is not None:
        env[s.ENV_TOKEN_FILE] = str(Path(args.token_file).resolve())
    if args.metrics_token_file is not None:
        env[s.ENV_METRICS_TOKEN_FILE] = str(Path(args.metrics_token_file).resolve())
    if args.grpc_port is not None:
        grpc_host = args.host if args.grpc_host is None else args.grpc_host
        host = f"[{grpc_host}]" if ":" in grpc_host else grpc_host
        env[s.ENV_GRPC] = f"{host}:{args.grpc_port}"
        env[s.ENV_GRPC_MAX_STREAM] = str(args.grpc_max_stream)
    if args.tier is not None:
        env[s.ENV_TIER] = args.tier
    if args.tier_endpoint is not None:
        env[s.ENV_TIER_ENDPOINT] = args.tier_endpoint
    if args.formats is not None:
        env[s.ENV_FORMATS] = args.formats  # checked by Settings.from_env below
    if args.max_models is not None:
        env[s.ENV_MAX_MODELS] = str(args.max_models)
    if args.quota:
        env[s.ENV_QUOTAS] = ",".join(args.quota)  # checked by Settings.from_env below
    env[s.ENV_SCRUB_RATE] = str(args.scrub_rate)
    env[s.ENV_SCRUB_PERIOD] = str(args.scrub_period)
    os.environ.update(env)  # the workers (spawned processes) inherit these
    settings = s.Settings.from_env()  # fail here, once, on a bad token file

    # Open and close the store once before any worker starts: a geometry mismatch or an
    # unusable directory is reported here instead of by every worker in a restart loop.
    from kvstore.store import Store

    # The KV event log is a setting of the store (kvstore/store/eventlog.py): on while this
    # server publishes it, off (and emptied) otherwise.
    events = args.kv_events_replay_batches if args.kv_events_endpoint else 0
    Store(
        settings.data,
        geometry=settings.geometry,
        capacity_bytes=settings.capacity_bytes,
        max_models=settings.max_models,
        events=events,
    ).close()
    publisher = None
    if args.kv_events_endpoint:
        from .kvevents import PublisherProcess

        node = args.node_id or socket.gethostname()
        try:
            publisher = PublisherProcess(
                str(settings.data),
                args.kv_events_endpoint,
                args.kv_events_replay_endpoint,
                node,
                args.kv_events_topic,
            )
        except RuntimeError as exc:
            print(f"tlkv serve: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    try:
        return _run_uvicorn(args, settings, metrics_dir, publisher is not None)
    finally:
        if publisher is not None:
            publisher.stop()


def _run_uvicorn(
    args: argparse.Namespace, settings: s.Settings, metrics_dir: str | None, events: bool
) -> int:
    import uvicorn  # imported by the command only: `tlkv --help` stays fast

    auth = "on" if settings.tokens is not None else "off"
    grpc = f", grpc://{settings.grpc_address}" if settings.grpc_address else ""
    http, warning = http_protocol()  # the fast path, unless this uvicorn lacks its parts
    if warning is not None:
        print(f"tlkv serve: warning: {warning}", file=sys.stderr)
    metrics = "" if metrics_dir is None else f"metrics {metrics_dir}, "
    tier = f", tier {settings.tier}" if settings.tier else ""
    kv_events = f", KV events {args.kv_events_endpoint}" if events else ""
    print(
        f"tlkv serve: data {settings.data}{tier}, auth {auth}, {args.workers} worker(s), "
        f"{metrics}http://{args.host}:{args.port}{grpc}{kv_events}",
        file=sys.stderr,
    )
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        loop="uvloop",
        http=http,  # api.http_protocol (httptools; block reads answered in it) or "auto"
        log_level=args.log_level,
        access_log=args.access_log,
    )
    return EXIT_OK


def register(sub: Any) -> None:
    """Add ``serve`` to the ``tlkv`` subcommands."""
    p = sub.add_parser("serve", help="run the HTTP service (uvicorn) on a store")
    p.add_argument("--data", default="./tlkv-data", help="store directory (default ./tlkv-data)")
    p.add_argument("--geometry", type=geometry_arg, default=None, help="B,L,H,D of a new store")
    p.add_argument("--capacity", type=_size_arg, default=None, help="capacity, e.g. 2GiB")
    p.add_argument(
        "--preallocate",
        type=_size_arg,
        default=0,
        help="disk and page cache kept ready past the store's last page, e.g. 1GiB: large "
        "puts write into pages the kernel holds already (default 0: off)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--allowed-hosts",
        type=lambda text: [h.strip() for h in text.split(",") if h.strip()],
        action="extend",
        default=[],
        metavar="NAME[,NAME]",
        help="Host names a server without a token answers besides its address, loopback "
        "names and IP addresses ('*': any); repeatable",
    )
    p.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1)")
    p.add_argument("--token-file", default=None, help="bearer token file (else $TLKV_TOKEN)")
    p.add_argument(
        "--metrics-token-file",
        default=None,
        help="a token (file) that reads every /metrics series and no model (for Prometheus)",
    )
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
        "--min-body-rate",
        type=rate_arg,
        default=DEFAULT_MIN_BODY_RATE,
        metavar="RATE",
        help="a request body slower than this in any --body-timeout window is refused with "
        "408 and its budget freed (1MiB/s; 0: no minimum)",
    )
    p.add_argument(
        "--body-timeout",
        type=_seconds_arg,
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help="the window --min-body-rate is measured over; a body stalled this long is refused (5)",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="store NaN/Inf values and out-of-range v2 scales verbatim (refused by default)",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default info)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument(
        "--grpc-port", type=int, default=None, help="also serve tl.kv.v1 gRPC on this port"
    )
    p.add_argument(
        "--grpc-host", default=None, help="bind address of the gRPC server (default: --host)"
    )
    p.add_argument(
        "--grpc-max-stream",
        type=_size_arg,
        default=1024 * 1024 * 1024,
        help="payload bytes one PushKv stream may buffer (1GiB)",
    )
    p.add_argument("--formats", default=None, help="envelope versions read, e.g. 1 (1,2)")
    p.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="MODEL=SIZE",
        help="bound a model's stored bytes (its puts evict its own oldest blocks); repeatable",
    )
    p.add_argument(
        "--max-models",
        type=_max_models_arg,
        default=None,
        help=f"models besides default the store admits, kept in it (0..{MAX_MODELS_LIMIT}; "
        f"default: the store's own, {MAX_MODELS} for a new one)",
    )
    p.add_argument(
        "--tier",
        type=_tier_arg,
        default=None,
        help="shared object-store tier: s3://bucket/prefix (AWS_* env) or file:///path",
    )
    p.add_argument(
        "--tier-endpoint", default=None, help="S3-compatible server URL (else AWS_ENDPOINT_URL)"
    )
    p.add_argument(
        "--scrub-rate",
        type=rate_arg,
        default="64MiB/s",
        help="background CRC re-check of every block, bytes/s (64MiB/s; 0: off)",
    )
    p.add_argument(
        "--scrub-period",
        type=_seconds_arg,
        default=24 * 3600.0,
        help="seconds from one scrub pass's start to the next (86400)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish KV events (vLLM's format) on this ZMQ PUB endpoint, e.g. tcp://*:5557",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="answer vLLM's replay protocol on this ROUTER endpoint, e.g. tcp://*:5558",
    )
    p.add_argument(
        "--kv-events-topic",
        default=TOPIC_TEMPLATE,
        help=f"the topic of a model's events; {{node}} and {{model}} filled in ({TOPIC_TEMPLATE})",
    )
    p.add_argument(
        "--node-id", default=None, help="this node's id in the KV event topic (the host name)"
    )
    p.add_argument(
        "--kv-events-replay-batches",
        type=positive_int,
        default=DEFAULT_EVENTS_LIMIT,
        help=f"event batches the store keeps for replay ({DEFAULT_EVENTS_LIMIT})",
    )
    p.set_defaults(func=_cmd_serve)
