"""What ``api.http_protocol`` takes from uvicorn's internals, checked before it is used.

:class:`api.http_protocol.TlkvHttpProtocol` subclasses uvicorn's private
``HttpToolsProtocol`` and reads its per-connection state; ``tlkv serve`` names it to
uvicorn by class path. None of that is uvicorn's public API, so ``tlkv serve`` asks
:func:`fast_path_problem` first: when the installed uvicorn lacks any of it, the service
runs on uvicorn's own protocol (``http="auto"``: httptools when installed; every request
through the app, the same answers, without the in-protocol block read) and says so once.

Instance attributes are set in methods, not on the class: a name counts as present when
the class defines it or its methods' code assigns it (``self.name = ...``), which is what
a rename or removal in uvicorn changes.
"""

from __future__ import annotations

import dis
import importlib
import types
from collections.abc import Iterator

FAST_PATH = "api.http_protocol:TlkvHttpProtocol"  # what `tlkv serve` gives uvicorn's `http=`
STANDARD = "auto"  # uvicorn's own choice (httptools when installed, else h11)

# (module, class or None for a module attribute, names): everything TlkvHttpProtocol
# reads, writes, overrides or calls in uvicorn.
RELIED_ON: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("uvicorn.protocols.http.httptools_impl", None, ("HttpToolsProtocol", "STATUS_LINE")),
    ("uvicorn.protocols.utils", None, ("get_client_addr",)),
    (
        "uvicorn.protocols.http.httptools_impl",
        "HttpToolsProtocol",
        (
            "connection_made",
            "on_headers_complete",
            "on_body",
            "_unset_keepalive_if_required",
            "timeout_keep_alive_handler",
            "app",
            "url",
            "headers",
            "cycle",
            "pipeline",
            "flow",
            "parser",
            "transport",
            "expect_100_continue",
            "limit_concurrency",
            "root_path",
            "server_state",
            "scope",
            "loop",
            "access_log",
            "access_logger",
            "timeout_keep_alive",
            "timeout_keep_alive_task",
        ),
    ),
    (
        "uvicorn.protocols.http.httptools_impl",
        "RequestResponseCycle",
        ("body", "response_complete", "more_body", "message_event"),
    ),
    ("uvicorn.protocols.http.flow_control", "FlowControl", ("write_paused",)),
    ("uvicorn.server", "ServerState", ("default_headers", "total_requests")),
)


def _assigned_names(cls: type) -> set[str]:
    """Every attribute name the code of ``cls``'s functions assigns (``x.name = ...``)."""
    names: set[str] = set()

    def walk(code: types.CodeType) -> Iterator[types.CodeType]:
        yield code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from walk(const)

    for value in vars(cls).values():
        func = getattr(value, "__func__", value)
        code = getattr(func, "__code__", None)
        if isinstance(code, types.CodeType):
            for inner in walk(code):
                names.update(
                    str(op.argval)
                    for op in dis.get_instructions(inner)
                    if op.opname == "STORE_ATTR"
                )
    return names


def _missing() -> list[str]:
    """The names of :data:`RELIED_ON` the installed uvicorn lacks, as ``module[.class].name``."""
    missing: list[str] = []
    for module_name, class_name, names in RELIED_ON:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        if class_name is None:
            missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
            continue
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            missing.append(f"{module_name}.{class_name}")
            continue
        known = _assigned_names(cls)
        missing += [
            f"{module_name}.{class_name}.{n}"
            for n in names
            if not hasattr(cls, n) and n not in known
        ]
    return missing


def fast_path_problem() -> str | None:
    """Why the installed uvicorn cannot run :data:`FAST_PATH`, or None when it can.

    Checks each name of :data:`RELIED_ON`, then that uvicorn takes a class path for
    ``http=`` (older releases only take the names of their own protocols).
    """
    import uvicorn

    version = getattr(uvicorn, "__version__", "?")
    missing = _missing()
    if missing:
        return f"uvicorn {version} lacks {', '.join(missing)}"
    config = uvicorn.Config(_no_app, http=FAST_PATH, log_config=None)
    try:
        config.load()
    except Exception as exc:  # whatever keeps this uvicorn from loading it: fall back
        return f"uvicorn {version} cannot load http={FAST_PATH!r} ({type(exc).__name__}: {exc})"
    loaded = getattr(config, "http_protocol_class", None)
    if getattr(loaded, "__name__", None) != FAST_PATH.rpartition(":")[2]:
        return f"uvicorn {version} did not take http={FAST_PATH!r}"
    return None


def http_protocol() -> tuple[str, str | None]:
    """The ``http=`` value for ``uvicorn.run`` and a warning when it is not the fast path."""
    problem = fast_path_problem()
    if problem is None:
        return FAST_PATH, None
    return STANDARD, (
        f"{problem}: serving through uvicorn's {STANDARD!r} protocol "
        "(block reads go through the app; the answers are the same)"
    )


async def _no_app(scope: object, receive: object, send: object) -> None:
    """An ASGI app for loading a ``uvicorn.Config`` (never called)."""
