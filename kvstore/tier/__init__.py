"""The object-store tier: block objects shared by every node through S3 or a directory.

``layout`` (object keys and URLs) -> ``objects`` (the object client over obstore) ->
``tier`` (batched block requests, counters, health) -> ``validate`` (read-through rules)
and ``uploader`` (the persistent pending set drained in the background).
"""

from __future__ import annotations

from .layout import DEFAULT_NAMESPACE, block_key, is_object_url, namespace_of, parse_url
from .objects import ObjectClient
from .tier import Tier
from .uploader import Uploader
from .validate import check_block_object

__all__ = [
    "DEFAULT_NAMESPACE",
    "ObjectClient",
    "Tier",
    "Uploader",
    "block_key",
    "check_block_object",
    "is_object_url",
    "namespace_of",
    "parse_url",
]
