"""Token records in HTTP bodies: how many a request announces (the body is split into its
envelope and the records by ``kvstore.codec.tokens.split_records``).

A put (``PUT /v1/blocks``, ``PUT /v1/sequences/{name}``) with the header
``x-tlkv-token-records: n`` (``kvstore.protocol.TOKEN_RECORDS_HEADER``) carries, after
the envelope's exact bytes, one token record per full block of the envelope, in order:
``u64 parent ‖ B × u32 token ids``. The store checks every block's hash against its
record (``TokenMismatchError``, 422 ``token_mismatch``, nothing stored). Without the
header a body is the envelope alone, as it always was.
"""

from __future__ import annotations

from fastapi import Request

from kvstore.errors import InvalidRequestError
from kvstore.protocol import TOKEN_RECORDS_HEADER

__all__ = ["token_records_of"]

_MAX_RECORDS = 1 << 24  # far above any envelope within --max-body


def token_records_of(request: Request) -> int:
    """The number of token records the request's body carries after its envelope (0
    without the header).

    Raises:
        InvalidRequestError: the header is not a decimal count.
    """
    values = request.headers.getlist(TOKEN_RECORDS_HEADER)
    if not values:
        return 0
    text = values[0].strip()
    if len(values) > 1 or not text.isdigit() or int(text) > _MAX_RECORDS:
        raise InvalidRequestError(
            f"rule '{TOKEN_RECORDS_HEADER} is one decimal count of token records' failed: "
            f"found {', '.join(values)[:60]!r}"
        )
    return int(text)
