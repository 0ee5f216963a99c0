"""Settings of the HTTP service, read from the environment.

``tlkv serve`` writes its options into ``TLKV_*`` variables before it starts uvicorn, so
every worker process (spawned, not forked) builds the same :class:`Settings` in
``api.app.create_app`` and opens the store itself, after the fork.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.cli.common import parse_rate, parse_size
from kvstore.codec.geometry import Geometry
from kvstore.codec.layout import SUPPORTED_VERSIONS
from kvstore.protocol import is_model_id, parse_versions, read_token_file

from .access import TokenTable, read_tokens
from .bodies import DEFAULT_BODY_TIMEOUT, DEFAULT_MIN_BODY_RATE
from .hosts import HostRule

ENV_DATA = "TLKV_DATA"
ENV_GEOMETRY = "TLKV_GEOMETRY"
ENV_CAPACITY = "TLKV_CAPACITY"
ENV_PREALLOCATE = "TLKV_PREALLOCATE"  # room kept past the data file's last page (Store's)
ENV_TOKEN = "TLKV_TOKEN"
ENV_TOKEN_FILE = "TLKV_TOKEN_FILE"
ENV_MAX_BODY = "TLKV_MAX_BODY"
ENV_GRPC = "TLKV_GRPC"  # host:port of the tl.kv.v1 gRPC server; absent: no gRPC
ENV_GRPC_MAX_STREAM = "TLKV_GRPC_MAX_STREAM"
ENV_MAX_INFLIGHT = "TLKV_MAX_INFLIGHT"
ENV_ALLOW_NONFINITE = "TLKV_ALLOW_NONFINITE"
ENV_TIER = "TLKV_TIER"  # s3://bucket/prefix or file:///path
ENV_TIER_ENDPOINT = "TLKV_TIER_ENDPOINT"
ENV_FORMATS = "TLKV_FORMATS"  # envelope versions this server reads, e.g. "1" or "1,2"
ENV_QUOTAS = "TLKV_QUOTAS"  # per-model byte quotas: "model=SIZE,other/model=SIZE"
ENV_SCRUB_RATE = "TLKV_SCRUB_RATE"  # background scrub, bytes per second; 0 or absent: off
ENV_SCRUB_PERIOD = "TLKV_SCRUB_PERIOD"  # seconds from one scrub pass's start to the next
ENV_MAX_MODELS = "TLKV_MAX_MODELS"  # models besides default the store admits (kept in it)
ENV_METRICS_TOKEN_FILE = "TLKV_METRICS_TOKEN_FILE"  # a token that may read all of /metrics
ENV_HOST = "TLKV_HOST"  # the address the server is bound to (the Host rule's own name)
ENV_ALLOWED_HOSTS = "TLKV_ALLOWED_HOSTS"  # more Host names a server without a token answers
ENV_MIN_BODY_RATE = "TLKV_MIN_BODY_RATE"  # bytes/s a request body keeps up; 0: no minimum
ENV_BODY_TIMEOUT = "TLKV_BODY_TIMEOUT"  # seconds: the window the minimum rate is measured over

DEFAULT_DATA = "./tlkv-data"
DEFAULT_MAX_BODY = 64 * 1024 * 1024
DEFAULT_GRPC_MAX_STREAM = 1024 * 1024 * 1024
# --max-inflight by default: this many max-size bodies held by one worker at once.
DEFAULT_INFLIGHT_BODIES = 2


def parse_quotas(text: str) -> tuple[tuple[str, int], ...]:
    """Per-model quotas from ``"model=SIZE,other=SIZE"`` (sizes as ``parse_size``).

    Raises:
        ValueError: an item is not ``MODEL=SIZE`` with a valid model id, or a model repeats.
    """
    quotas: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        model, sep, size = item.partition("=")
        if not sep or not is_model_id(model.strip()) or model.strip() in quotas:
            raise ValueError(f"a quota is MODEL=SIZE, once per model, found {item!r}")
        quotas[model.strip()] = parse_size(size)
    return tuple(sorted(quotas.items()))


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs to open its store and guard its routes."""

    data: Path = Path(DEFAULT_DATA)
    geometry: Geometry | None = None
    capacity_bytes: int | None = None
    preallocate_bytes: int = 0  # Store(preallocate_bytes=): 0 off
    token: str | None = None  # one token for every model (TLKV_TOKEN, a bare token file)
    tokens: TokenTable | None = None  # a token file's table (models per token)
    max_body: int = DEFAULT_MAX_BODY
    grpc_address: str | None = None
    grpc_max_stream: int = DEFAULT_GRPC_MAX_STREAM
    formats: tuple[int, ...] = SUPPORTED_VERSIONS
    max_inflight: int | None = None  # None: DEFAULT_INFLIGHT_BODIES * max_body
    allow_nonfinite: bool = False  # store NaN/Inf and out-of-range v2 scales verbatim
    quotas: tuple[tuple[str, int], ...] = ()  # (model, quota_bytes) pairs
    tier: str | None = None  # s3://bucket/prefix or file:///path: the shared object-store tier
    tier_endpoint: str | None = None  # an S3-compatible server's URL
    # The background scrub (kvstore.store.scrub): off unless a rate is given (`tlkv serve`
    # gives one by default, --scrub-rate).
    scrub_rate: int = 0
    scrub_period: float = 24 * 3600.0
    # Models besides default the store admits: written into the store; None keeps its own.
    max_models: int | None = None
    # A request body must bring min_body_rate bytes/s in every body_timeout-second window
    # (api.bodies.BodyPace; 0: no minimum).
    min_body_rate: int = DEFAULT_MIN_BODY_RATE
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    # Without a token, answer only a Host naming the server (api.hosts): on when the bound
    # address is known (`tlkv serve` gives it) or names are allowed; None and (): no check.
    bind_host: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    host_rule: HostRule | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens is None and self.token is not None:
            object.__setattr__(self, "tokens", TokenTable.single(self.token))
        if self.max_inflight is None:
            object.__setattr__(self, "max_inflight", DEFAULT_INFLIGHT_BODIES * self.max_body)
        elif self.max_inflight < self.max_body:
            raise ValueError(
                f"--max-inflight ({self.max_inflight} bytes) must be at least --max-body "
                f"({self.max_body} bytes)"
            )
        if self.bind_host is not None or self.allowed_hosts:
            rule = HostRule(self.bind_host or "", self.allowed_hosts)
            object.__setattr__(self, "host_rule", rule)
        if self.min_body_rate < 0 or not self.body_timeout > 0:
            raise ValueError(
                f"--min-body-rate must be >= 0 and --body-timeout > 0, found "
                f"{self.min_body_rate} and {self.body_timeout}"
            )

    @property
    def inflight_bytes(self) -> int:
        """Bytes of request bodies one worker holds at most (``--max-inflight``)."""
        assert self.max_inflight is not None
        return self.max_inflight

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``TLKV_*`` variables; the token file wins over ``TLKV_TOKEN``.

        Raises:
            ValueError: a variable does not parse.
        """
        env = os.environ if env is None else env
        geometry = env.get(ENV_GEOMETRY)
        capacity = env.get(ENV_CAPACITY)
        preallocate = env.get(ENV_PREALLOCATE)
        token_file = env.get(ENV_TOKEN_FILE)
        tokens = read_tokens(token_file) if token_file else None
        token = tokens.bare if tokens is not None else (env.get(ENV_TOKEN) or None)
        metrics_file = env.get(ENV_METRICS_TOKEN_FILE)
        if metrics_file:
            if tokens is None and token is None:
                raise ValueError("a metrics token needs the service's tokens (--token-file)")
            table = tokens if tokens is not None else TokenTable.single(str(token))
            tokens = table.with_metrics_token(read_token_file(metrics_file))
        max_body = env.get(ENV_MAX_BODY)
        max_stream = env.get(ENV_GRPC_MAX_STREAM)
        formats = env.get(ENV_FORMATS)
        max_inflight = env.get(ENV_MAX_INFLIGHT)
        min_body_rate = env.get(ENV_MIN_BODY_RATE)
        body_timeout = env.get(ENV_BODY_TIMEOUT)
        allowed_hosts = env.get(ENV_ALLOWED_HOSTS, "")
        return cls(
            data=Path(env.get(ENV_DATA) or DEFAULT_DATA),
            geometry=Geometry.parse(geometry) if geometry else None,
            capacity_bytes=parse_size(capacity) if capacity else None,
            preallocate_bytes=parse_size(preallocate) if preallocate else 0,
            token=token,
            tokens=tokens,
            max_body=parse_size(max_body) if max_body else DEFAULT_MAX_BODY,
            grpc_address=env.get(ENV_GRPC) or None,
            grpc_max_stream=parse_size(max_stream) if max_stream else DEFAULT_GRPC_MAX_STREAM,
            formats=parse_versions(formats) if formats else SUPPORTED_VERSIONS,
            max_inflight=parse_size(max_inflight) if max_inflight else None,
            allow_nonfinite=env.get(ENV_ALLOW_NONFINITE, "") == "1",
            quotas=parse_quotas(env.get(ENV_QUOTAS, "")),
            tier=env.get(ENV_TIER) or None,
            tier_endpoint=env.get(ENV_TIER_ENDPOINT) or None,
            scrub_rate=int(env.get(ENV_SCRUB_RATE) or 0),
            scrub_period=float(env.get(ENV_SCRUB_PERIOD) or 24 * 3600.0),
            max_models=int(env[ENV_MAX_MODELS]) if env.get(ENV_MAX_MODELS) else None,
            min_body_rate=DEFAULT_MIN_BODY_RATE
            if min_body_rate is None
            else parse_rate(min_body_rate),
            body_timeout=float(body_timeout) if body_timeout else DEFAULT_BODY_TIMEOUT,
            bind_host=env.get(ENV_HOST) or None,
            allowed_hosts=tuple(h.strip() for h in allowed_hosts.split(",") if h.strip()),
        )
