"""What a failed LMDB write means: a full disk (or a file-size limit) becomes
``StoreFullError``, anything else ``StoreError``, each naming the store."""

from __future__ import annotations

import os
import shutil

import lmdb

from ..errors import StoreError, StoreFullError

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    resource = None  # type: ignore[assignment]

_SPACE_SLACK = 16 << 20  # a failed write with less free disk than need + this: disk full


def failed_write(exc: lmdb.Error, path: str, need: int, psize: int) -> StoreError:
    """The store's error for LMDB's ``exc`` in a write of ``need`` bytes to the store in
    ``path`` (LMDB pages of ``psize`` bytes)."""
    if out_of_space(exc, path, need, psize):
        return StoreFullError(
            f"the disk holding {path} is full ({exc}); a write of {need} bytes "
            "did not fit and nothing was stored"
        )
    return StoreError(f"LMDB failed in {path}: {exc}")


def out_of_space(exc: lmdb.Error, path: str, need: int, psize: int) -> bool:
    """Whether ``exc`` is what a full disk or a file-size limit makes LMDB raise."""
    if isinstance(exc, lmdb.DiskError):
        return True
    text = str(exc)
    if any(s in text for s in ("No space left", "File too large", "quota exceeded")):
        return True
    if "Input/output error" not in text:
        return False
    # LMDB reports a short write -- what a full disk produces -- as EIO.
    try:
        if shutil.disk_usage(path).free < need + _SPACE_SLACK:
            return True
        size = os.path.getsize(os.path.join(path, "data.mdb"))
    except OSError:
        return False
    if resource is not None:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and size + need + psize > limit:
            return True
    return False
