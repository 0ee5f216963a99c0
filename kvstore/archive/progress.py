"""What long archive operations report their progress to (the CLI's progress bar)."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """What long operations report to (the CLI's progress bar)."""

    def start(self, total_blocks: int, phase: str = "") -> None:
        """A (new) phase over ``total_blocks`` blocks begins: counts restart from 0."""

    def update(self, blocks: int, nbytes: int) -> None:
        """Blocks done in this phase (the bar's fraction and ETA) and bytes processed in it
        (its MB/s)."""
