"""Where the SGLang backend keeps pages: one namespace of an engine target (a store
directory, ``http://`` or ``grpc://``), through the engines' shared target set, plus the
one call only this backend makes (``clear``)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress

from ..codec.geometry import Geometry
from ..errors import PinnedError
from .targets import BlockSlots, StoreTarget, Target, open_target

__all__ = ["PageTarget", "open_page_target"]


class PageTarget:
    """One namespace of a target: each call one round trip (a store's: one transaction).

    Transport and service errors are raised to the backend, which counts them and answers
    SGLang with misses.
    """

    def __init__(self, target: Target) -> None:
        self._target = target
        self.local = isinstance(target, StoreTarget)  # a store directory: no round trips

    def geometry(self) -> Geometry | None:
        """The namespace's block geometry; None when it holds none (or cannot tell)."""
        return self._target.geometry()

    def longest_prefix(self, names: Sequence[int]) -> int:
        """How many leading blocks of ``names`` are held."""
        return self._target.longest_prefix(names)

    def holds(self, name: int) -> bool:
        """Whether the one block ``name`` is held (a first page asked alone)."""
        return self._target.longest_prefix([name]) == 1

    def has(self, names: Sequence[int]) -> list[bool]:
        """Whether each block is held."""
        return self._target.has(names)

    def put(self, envelope: bytes) -> int:
        """Store an envelope's blocks."""
        return self._target.put(envelope)

    def load(self, names: Sequence[int], slots: BlockSlots) -> int:
        """Copy the longest held prefix of ``names`` into slots ``0, 1, ...`` of ``slots``,
        each block checked (reader rules, CRC-32C, its name; a store's corrupt block is
        quarantined) before it counts; returns how many leading blocks are in place."""
        return self._target.load(names, slots, range(len(names)))[0]

    def clear(self) -> bool:
        """Delete every block of the namespace of a store directory (blocks a sequence
        pins stay); False for a server, which has no bulk delete."""
        store = getattr(self._target, "store", None)
        if store is None:
            return False
        with store.reader() as reader:
            names = [h for h, _ in reader.iter_blocks()]
        for h in names:
            with suppress(PinnedError):
                store.delete(h)
        return True

    def close(self) -> None:
        """Release connections (a shared store stays open for the process)."""
        self._target.close()


def open_page_target(
    spec: str,
    namespace: str,
    token: str | None,
    timeout: float,
    sync: bool = True,
    preallocate: int = 0,
) -> PageTarget:
    """Namespace ``namespace`` of the target ``spec`` (``sync``, ``preallocate``: a store
    directory's)."""
    return PageTarget(
        open_target(
            spec,
            model=namespace,
            token=token,
            timeout=timeout,
            sync=sync,
            preallocate=preallocate,
        )
    )
