"""A one-line progress bar on stderr, redrawn in place; silent when disabled or not on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30


class ProgressBar:
    def __init__(self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        # A redrawn line in a log file or a pipe is just noise: draw only on a terminal.
        self.enabled = enabled and self.stream.isatty()
        self.total = total
        self.label = label
        self.done = 0
        self.failed = 0
        self.started = time.perf_counter()

    def advance(self, success: bool) -> None:
        self.done += 1
        self.failed += 0 if success else 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                          f"failed={self.failed} {elapsed:.1f}s")
        self.stream.flush()
