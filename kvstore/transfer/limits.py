"""tl.kv.v1's limits, names and metadata keys (spec: "Transfer (tl.kv.v1)").

Each is declared here once and read by both sides: the chunk rules, the client, and the
server in ``api.grpc_service``.
"""

from __future__ import annotations

__all__ = [
    "ERROR_KIND_KEY",
    "FETCH_RESERVE_BYTES",
    "GRPC_SCHEME",
    "MAX_CHUNK_PAYLOAD",
    "MAX_MESSAGE_BYTES",
    "MISSING_BLOCK_KEY",
    "MODELS_SERVICE_NAME",
    "SERVICE_NAME",
]

# "Each KvChunk.payload is a whole envelope with n_blocks = 1, at most 4 MiB".
MAX_CHUNK_PAYLOAD = 4 * 1024 * 1024
# gRPC's own message limit on both sides: above the payload limit, so that a payload
# between the two is answered with our RESOURCE_EXHAUSTED message (naming v2), not gRPC's.
MAX_MESSAGE_BYTES = 2 * MAX_CHUNK_PAYLOAD + 64 * 1024

SERVICE_NAME = "tl.kv.v1.KvTransfer"  # the .proto's package and service
MODELS_SERVICE_NAME = "tlkv.v1.Models"  # tlkv's own service (api/proto/tlkv/v1/models.proto)
GRPC_SCHEME = "grpc://"  # a target spelled as a URL (the CLI, the engine bridges)
# FetchKv's envelope is reserved up front for every block asked for, up to this much
# (address space only: pages are taken as records arrive); a longer stream grows it.
FETCH_RESERVE_BYTES = 1 << 30
# Trailing metadata of a failed call: the tlkv error kind (the HTTP error shape's ``kind``),
# and for a referenced block the server does not hold, its hash (16 hex digits).
ERROR_KIND_KEY = "tlkv-error-kind"
MISSING_BLOCK_KEY = "tlkv-missing-block"
