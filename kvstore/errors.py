"""The exception tree of tlkv: every error the codec, the store and the archive raise.

Each class has a ``kind`` and an ``http_status`` (the HTTP layer's single error shape) and
a ``grpc_status``: the name of the ``grpc.StatusCode`` tl.kv.v1 answers it with, as a
string, so this module imports no gRPC (``kvstore.transfer.status`` turns the names into
codes). A class may also name the statuses a client reads as it when a failed call carries
no error kind (``grpc_default_for``: declared on the class itself, never inherited). The
messages name the rule, the expected value and the found value.
"""

from __future__ import annotations


class TlkvError(Exception):
    """Base of every error tlkv raises on purpose."""

    kind = "error"
    http_status = 500
    grpc_status = "INTERNAL"
    grpc_default_for: tuple[str, ...] = ()


class EnvelopeError(TlkvError, ValueError):
    """An export envelope breaks a rule of the spec (base of the codec's errors)."""

    kind = "format"
    http_status = 422
    grpc_status = "DATA_LOSS"


class FormatError(EnvelopeError):
    """The envelope's bytes are malformed (length, magic, CRC, dtype, fill, hash rule)."""

    grpc_default_for = ("DATA_LOSS",)


class TruncatedError(FormatError):
    """The buffer's length disagrees with the length the header implies."""


class BadMagicError(FormatError):
    """The first four bytes are not the magic ``TLKV``."""


class ChecksumError(FormatError):
    """The trailing CRC-32C does not match the bytes before it."""


class ShapeError(EnvelopeError):
    """The envelope's geometry differs from the reader's (or the store's)."""

    kind = "shape"
    http_status = 422


class UnsupportedVersionError(EnvelopeError):
    """The envelope's format version is not one this reader accepts."""

    kind = "version"
    http_status = 415
    grpc_status = "FAILED_PRECONDITION"
    grpc_default_for = ("FAILED_PRECONDITION",)


class StoreError(TlkvError):
    """Base of the block store's errors."""

    kind = "store"
    http_status = 500


class StoreFullError(StoreError):
    """A put cannot fit in the store even after evicting every unpinned block."""

    kind = "store_full"
    http_status = 507
    grpc_status = "RESOURCE_EXHAUSTED"


class ModelLimitError(StoreFullError):
    """A write would register a model beyond the models the store admits (``max_models``)."""

    kind = "model_limit"
    http_status = 507


class PinnedError(StoreError):
    """The block is referenced by a sequence and cannot be deleted."""

    kind = "pinned"
    http_status = 409


class UnconvertibleError(StoreError):
    """A stored block cannot be transcoded to the asked format (non-finite values stored
    with ``allow_nonfinite``, or values beyond the target's range)."""

    kind = "unconvertible"
    http_status = 409


class ViewClosedError(StoreError):
    """A zero-copy view was used after its reader (LMDB read transaction) closed."""

    kind = "view_closed"


class ArchiveError(TlkvError):
    """An archive is malformed, truncated, or fails validation."""

    kind = "archive"
    http_status = 422


class UnsafeArchiveError(ArchiveError):
    """An archive member would escape its destination or exceed the allowed sizes."""


class IncompleteArchiveError(ArchiveError):
    """``archive create`` would leave something out (a sequence, a corrupt block), and was
    not allowed to (``--allow-skipped``)."""


class TierError(StoreError):
    """The object-store tier could not be reached or refused a request (local data is
    unaffected; the operation that needed the tier can be retried)."""

    kind = "tier"
    http_status = 503


# --- errors of the HTTP service and its client ---------------------------------------


class NotFoundError(TlkvError, LookupError):
    """The block, sequence or route does not exist."""

    kind = "not_found"
    http_status = 404
    grpc_status = "FAILED_PRECONDITION"
    grpc_default_for = ("NOT_FOUND",)


class TooLargeError(TlkvError):
    """The request body exceeds the server's limit (``--max-body``)."""

    kind = "too_large"
    http_status = 413
    grpc_status = "RESOURCE_EXHAUSTED"
    grpc_default_for = ("RESOURCE_EXHAUSTED",)


class UnauthorizedError(TlkvError):
    """The request lacks the server's bearer token, or carries a wrong one."""

    kind = "unauthorized"
    http_status = 401
    grpc_status = "UNAUTHENTICATED"
    grpc_default_for = ("UNAUTHENTICATED",)


class ForbiddenError(TlkvError):
    """The token may read this model but not write it."""

    kind = "forbidden"
    http_status = 403
    grpc_status = "PERMISSION_DENIED"
    grpc_default_for = ("PERMISSION_DENIED",)


class InvalidRequestError(TlkvError, ValueError):
    """A request is malformed: bad hash, bad JSON, wrong content type, bad parameter."""

    kind = "invalid_request"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"
    grpc_default_for = ("INVALID_ARGUMENT",)


class MethodNotAllowedError(InvalidRequestError):
    """The route exists but does not take this HTTP method."""

    kind = "method_not_allowed"
    http_status = 405


class BusyError(TlkvError):
    """The worker holds as many request-body bytes as it may (``--max-inflight``): retry."""

    kind = "busy"
    http_status = 503
    grpc_status = "UNAVAILABLE"


class StoreBusyError(BusyError, StoreError):
    """The map cannot be remapped now: zero-copy bodies still hold snapshots; retry."""


class ServiceError(TlkvError):
    """The service failed in a way no other error describes (an unexpected server error)."""

    kind = "internal"
    http_status = 500


# --- errors of the archive format -----------------------------------------------------


class TruncatedArchiveError(ArchiveError):
    """The archive file ends early: a frame or the seek index at its end is cut off."""


# --- errors of the engine bridges -----------------------------------------------------


class CacheLayoutError(TlkvError, ValueError):
    """An engine's KV cache is laid out in a way the bridge cannot show it reads or fills
    exactly (a quantized, offloaded, encoder-decoder or MLA cache, a batch without ``row=``,
    a layer kind it does not know): refused by name, nothing stored or loaded."""

    kind = "cache_layout"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"


class SlidingWindowError(CacheLayoutError):
    """A sliding-window layer does not hold (or could not hold) every position of the
    prefix; ``layer`` and ``window`` name the layer and its window size."""

    def __init__(self, message: str, *, layer: int, window: int | None) -> None:
        super().__init__(message)
        self.layer = layer
        self.window = window


class PageKeyError(TlkvError, ValueError):
    """An engine's page key cannot be mapped to a block name (SGLang's HiCache keys are
    SHA-256 hex strings, ``kvstore.engines.sglang.block_name``): refused, nothing stored
    or loaded under it."""

    kind = "page_key"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"
