"""The vLLM connector's counters, handed to vLLM's stats loggers (``KVConnectorStats``):
the "KV Transfer metrics" line of a server with stats logging."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["TlkvConnectorStats"]

_COUNTERS = (
    "blocks_loaded",
    "bytes_loaded",
    "blocks_saved",
    "bytes_saved",
    "blocks_present",
    "load_errors",
    "scale_misses",
    "save_errors",
)


@dataclass
class TlkvConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters of one interval: blocks and bytes loaded and saved, blocks the target
    already held, failed loads (blocks; ``scale_misses``: of them, blocks an fp8 cache
    did not load because their format or scales are not its own) and saves (attempts)."""

    def __post_init__(self) -> None:
        for k in _COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> TlkvConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"tlkv_{k}": v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())
