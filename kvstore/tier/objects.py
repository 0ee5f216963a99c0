"""The object client: one object store (S3-compatible or a shared directory) over obstore.

obstore (Rust ``object_store``) puts as fast as boto3 in threads or faster (its
comparison against boto3 on moto's S3 server: BENCHMARKS.md, "Measurements behind design
choices"), and it does everything the tier needs with one API and no thread per request:
conditional create (``If-None-Match: *``, ``mode="create"``), ranged GETs, streaming
multipart uploads with bounded memory (``open_writer``), ``file://`` through the same
calls, and transfers that run without the GIL, leaving the CPU to LMDB and the CRC.

Every call runs on one private asyncio loop thread; the sync wrappers here wait for it.
Failures of the server or the network become :class:`~kvstore.errors.TierError`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
from obstore.store import LocalStore, S3Store

from ..errors import TierError
from .layout import ObjectUrl, parse_url

T = TypeVar("T")

DEFAULT_CONCURRENCY = 16  # requests in flight per batch call
CONNECT_TIMEOUT = "2s"
REQUEST_TIMEOUT = "30s"
# obstore's own retries stay short: the uploader retries with its own backoff, and a read
# through an unreachable tier must give up fast (the caller serves a miss instead).
RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=5)}
# Endpoint variables read when no endpoint is given (the AWS SDKs' names, then obstore's).
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
MULTIPART_CHUNK = 16 << 20  # bytes buffered per part of a streamed upload
MULTIPART_CONCURRENCY = 4  # parts in flight: memory is bounded by chunk x (this + 1)
_EXIT_DRAIN = 10.0  # seconds the calls in flight get to finish at interpreter exit


class _Loop:
    """One asyncio loop on a daemon thread, shared by every client of the process.

    At interpreter exit (``atexit``, which runs while daemon threads still do) the calls in
    flight get up to ``_EXIT_DRAIN`` seconds to finish, then the loop stops and its thread
    ends: an obstore future that completed during interpreter finalization would call into
    a finalizing interpreter from a Rust thread, which aborts the process (SIGABRT, seen at
    the exit of ``tlkv scrub --repair-from`` with uploads in flight).
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _pid = 0

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="tlkv-tier-io", daemon=True)
                thread.start()
                if cls._pid != os.getpid():
                    atexit.register(cls.shutdown)  # once per process
                cls._loop, cls._thread, cls._pid = loop, thread, os.getpid()
            return cls._loop

    @classmethod
    def shutdown(cls) -> None:
        """Let the calls in flight finish (at most ``_EXIT_DRAIN`` s), stop the loop, join
        its thread and close the loop."""
        with cls._lock:
            loop, thread = cls._loop, cls._thread
            if loop is None or thread is None or cls._pid != os.getpid():
                return
            cls._loop = cls._thread = None

        async def drain() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            if tasks:
                await asyncio.wait(tasks, timeout=_EXIT_DRAIN)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(drain(), loop).result(_EXIT_DRAIN + 1)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_EXIT_DRAIN)
        if not thread.is_alive():  # closed now, not by its finalizer during interpreter exit,
            loop.close()  # when its self-pipe may be gone already ("Invalid file descriptor")


def _run(coro: Awaitable[T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, _Loop.get()).result()  # type: ignore[arg-type]


def _call(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` awaited on the loop (obstore's calls need a running loop)."""

    async def call() -> T:
        return await fn(*args, **kwargs)

    return _run(call())


def _tier_error(what: str, exc: BaseException) -> TierError:
    text = str(exc).strip().splitlines()
    return TierError(f"{what}: {type(exc).__name__}: {text[0] if text else ''}")


def _make_store(url: ObjectUrl, endpoint: str | None) -> Any:
    if url.scheme == "file":
        os.makedirs(url.path, exist_ok=True)
        return LocalStore(url.path)
    endpoint = endpoint or next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
    options: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT, "timeout": REQUEST_TIMEOUT}
    config: dict[str, Any] = {}
    if endpoint:
        config["endpoint"] = endpoint
        options["allow_http"] = endpoint.startswith("http://")
        config.setdefault("virtual_hosted_style_request", False)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        config["region"] = region
    return S3Store(
        url.bucket,
        prefix=url.path or None,
        client_options=options,  # type: ignore[arg-type]
        retry_config=RETRY,  # type: ignore[arg-type]
        **config,
    )


class ObjectClient:
    """Objects under one URL (``s3://bucket/prefix`` or ``file:///dir``); keys are relative.

    Args:
        url: the root; S3 credentials and region come from the standard AWS environment
            variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
            ``AWS_REGION``), the endpoint from ``endpoint`` or ``AWS_ENDPOINT_URL``.
        endpoint: an S3-compatible server's URL (MinIO, Ceph RGW, moto).
        concurrency: requests in flight in one batch call.
    """

    def __init__(
        self, url: str, *, endpoint: str | None = None, concurrency: int = DEFAULT_CONCURRENCY
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, found {concurrency}")
        self.url = url
        self.parsed = parse_url(url)
        self.concurrency = concurrency
        self.store = _make_store(self.parsed, endpoint)
        self._sem: asyncio.Semaphore | None = None  # submit_put_new's, made on the loop

    def __repr__(self) -> str:
        return f"ObjectClient({self.url!r})"

    # --- single objects --------------------------------------------------------------------

    def put_new(self, key: str, data: Any) -> bool:
        """Create ``key`` holding ``data`` unless it exists (the first writer wins).

        Returns True when written, False when the object was there already.
        """
        return _run(self._put_new(key, data))

    async def _put_new(self, key: str, data: Any) -> bool:
        try:
            await obstore.put_async(self.store, key, data, mode="create", use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            return False
        except Exception as exc:
            raise _tier_error(f"put {key}", exc) from None
        return True

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when absent."""
        return _run(self._get(key))

    async def _get(self, key: str) -> bytes | None:
        try:
            result = await obstore.get_async(self.store, key)
            # Copied into a Python object here, while the other requests still transfer.
            return bytes(await result.bytes_async())
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as exc:
            raise _tier_error(f"get {key}", exc) from None

    async def _exists(self, key: str) -> bool:
        try:
            await obstore.head_async(self.store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        except Exception as exc:
            raise _tier_error(f"head {key}", exc) from None
        return True

    def size(self, key: str) -> int:
        """The object's size in bytes.

        Raises:
            FileNotFoundError: no such object.
        """
        try:
            meta = _call(obstore.head_async, self.store, key)
        except (NotFoundError, FileNotFoundError):
            raise FileNotFoundError(f"{self.url}/{key}: no such object") from None
        except Exception as exc:
            raise _tier_error(f"head {key}", exc) from None
        return int(meta["size"])

    def get_range(self, key: str, start: int, length: int) -> Any:
        """``length`` bytes of the object from ``start`` (fewer at its end)."""
        try:
            return _call(obstore.get_range_async, self.store, key, start=start, length=length)
        except Exception as exc:
            raise _tier_error(f"get {key} [{start}, +{length})", exc) from None

    def delete(self, key: str) -> None:
        """Remove an object (absent is fine)."""
        try:
            _call(obstore.delete_async, self.store, key)
        except (NotFoundError, FileNotFoundError):
            pass
        except Exception as exc:
            raise _tier_error(f"delete {key}", exc) from None

    def open_writer(self, key: str) -> Any:
        """A file-like writer streaming to ``key`` as a multipart upload (bounded memory:
        ``MULTIPART_CHUNK`` x ``MULTIPART_CONCURRENCY``); the object appears on ``close``."""
        return obstore.open_writer(
            self.store,
            key,
            buffer_size=MULTIPART_CHUNK,
            max_concurrency=MULTIPART_CONCURRENCY,
        )

    def put_file(self, key: str, path: str) -> None:
        """Upload a local file (multipart, concurrent parts)."""
        try:
            with open(path, "rb") as f:
                _call(
                    obstore.put_async,
                    self.store,
                    key,
                    f,
                    chunk_size=MULTIPART_CHUNK,
                    max_concurrency=MULTIPART_CONCURRENCY,
                )
        except Exception as exc:
            raise _tier_error(f"put {key}", exc) from None

    def submit_exists(self, key: str) -> concurrent.futures.Future[bool | TierError]:
        """Whether ``key`` exists (a HEAD), started on the loop without waiting. The
        future's result is the answer or the error."""

        async def one() -> bool | TierError:
            try:
                return await self._exists(key)
            except TierError as exc:
                return exc

        return asyncio.run_coroutine_threadsafe(one(), _Loop.get())

    def submit_put_new(self, key: str, data: Any) -> concurrent.futures.Future[bool | TierError]:
        """``put_new`` started on the loop without waiting; at most ``concurrency`` of
        these run at once (the rest queue). The future's result is the value or the error."""

        async def one() -> bool | TierError:
            if self._sem is None:
                self._sem = asyncio.Semaphore(self.concurrency)
            async with self._sem:
                try:
                    return await self._put_new(key, data)
                except TierError as exc:
                    return exc

        return asyncio.run_coroutine_threadsafe(one(), _Loop.get())

    # --- batches, ``concurrency`` in flight; each result is a value or the TierError ------

    def _gather(
        self, fn: Callable[[Any], Awaitable[T]], items: Sequence[Any]
    ) -> list[T | TierError]:
        async def all_of() -> list[T | TierError]:
            sem = asyncio.Semaphore(self.concurrency)

            async def one(item: Any) -> T | TierError:
                async with sem:
                    try:
                        return await fn(item)
                    except TierError as exc:
                        return exc

            return await asyncio.gather(*(one(i) for i in items))

        return _run(all_of())

    def put_new_many(self, items: Sequence[tuple[str, Any]]) -> list[bool | TierError]:
        """``put_new`` of every ``(key, data)``, concurrently."""
        return self._gather(lambda kv: self._put_new(kv[0], kv[1]), items)

    def get_many(self, keys: Sequence[str]) -> list[bytes | TierError | None]:
        """``get`` of every key, concurrently."""
        return self._gather(self._get, keys)

    def delete_many(self, keys: Sequence[str]) -> list[TierError | None]:
        """Remove every key (absent is fine), concurrently."""

        async def one(key: str) -> None:
            try:
                await obstore.delete_async(self.store, key)
            except (NotFoundError, FileNotFoundError):
                pass
            except Exception as exc:
                raise _tier_error(f"delete {key}", exc) from None

        return self._gather(one, keys)

    def exists_many(self, keys: Sequence[str]) -> list[bool | TierError]:
        """Whether each key exists (HEAD requests), concurrently."""
        return self._gather(self._exists, keys)
