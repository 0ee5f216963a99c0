"""The gRPC status of each tlkv error, both ways, derived from :mod:`kvstore.errors`.

Each error class names its status (``grpc_status``, a ``grpc.StatusCode`` name) beside its
``http_status``; :func:`grpc_status_of` reads it (the server's answer), and
:func:`error_from_status` turns a failed call back into the typed exception (the client):
by the error kind the server sent in its trailing metadata, else by the status alone, as
the classes that declare ``grpc_default_for`` read it.
"""

from __future__ import annotations

import grpc

from .. import errors
from ..errors import ServiceError, TlkvError
from ..protocol import ERROR_KINDS
from .limits import ERROR_KIND_KEY

__all__ = ["ERROR_FOR_CODE", "error_from_status", "grpc_status_of"]


def _error_classes() -> list[type[TlkvError]]:
    """Every class of :mod:`kvstore.errors`, bases first."""
    found: list[type[TlkvError]] = []
    todo: list[type[TlkvError]] = [TlkvError]
    while todo:
        cls = todo.pop(0)
        if cls.__module__ == errors.__name__ and cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


def _error_for_code() -> dict[grpc.StatusCode, type[TlkvError]]:
    table: dict[grpc.StatusCode, type[TlkvError]] = {}
    for cls in _error_classes():
        for name in vars(cls).get("grpc_default_for", ()):
            code = grpc.StatusCode[name]
            if code in table:
                raise RuntimeError(
                    f"{cls.__name__} and {table[code].__name__} both read status {name}"
                )
            table[code] = cls
    return table


# A status without an error kind (another server's answer) -> the exception raised for it;
# any status not here is a ServiceError.
ERROR_FOR_CODE: dict[grpc.StatusCode, type[TlkvError]] = _error_for_code()


def grpc_status_of(error: BaseException) -> grpc.StatusCode:
    """The spec's gRPC status of an error met while serving tl.kv.v1.

    A tlkv error's is its class's ``grpc_status``: reader-rule failures (format, shape, CRC)
    are DATA_LOSS, a version the server does not read and a referenced block it does not
    hold FAILED_PRECONDITION, a payload over 4 MiB and a full store RESOURCE_EXHAUSTED, a
    store busy remapping UNAVAILABLE (retry), a malformed request INVALID_ARGUMENT. Any
    other ``ValueError`` is INVALID_ARGUMENT too; anything else INTERNAL.
    """
    if isinstance(error, TlkvError):
        return grpc.StatusCode[type(error).grpc_status]
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def error_from_status(error: grpc.RpcError) -> TlkvError:
    """The typed tlkv exception of a failed call (by the server's error kind, else its code)."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    kind = dict(trailing or ()).get(ERROR_KIND_KEY)
    cls = ERROR_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        cls = ERROR_FOR_CODE.get(code, ServiceError) if code is not None else ServiceError
    exc = cls(f"{details}")
    exc.grpc_code = code  # type: ignore[attr-defined]
    return exc
