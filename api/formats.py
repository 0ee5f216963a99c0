"""The envelope versions a server reads (``tlkv serve --formats``), enforced on HTTP puts.

A v1-only server (drill ops.04, ``--formats 1``) refuses a v2 envelope with 415 ``version``
on ``PUT /v1/blocks`` and ``PUT /v1/sequences/{name}``, as its gRPC side answers
FAILED_PRECONDITION. The codec's reader order holds: a damaged v2 envelope is still a
``format`` error (its CRC is checked before its version is refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.codec.envelope import decode
from kvstore.codec.layout import SUPPORTED_VERSIONS
from kvstore.errors import EnvelopeError, UnsupportedVersionError


def require_formats(body: Any, formats: Sequence[int]) -> None:
    """Refuse an envelope whose version is not in ``formats`` (other rules: the store's).

    Raises:
        UnsupportedVersionError: the version is not read here (HTTP 415).
        FormatError: the envelope is damaged before its version could be refused.
    """
    if tuple(formats) == SUPPORTED_VERSIONS:
        return
    try:
        decode(body, versions=formats, verify_crc=False)
    except UnsupportedVersionError:
        decode(body, versions=formats)  # the CRC first, as every reader checks it
        raise
    except EnvelopeError:
        pass  # any other rule: the store's validation reports it
