"""A one-line progress bar on stderr (no dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``[#####.....] 3/6 label``, redrawn in place on a terminal, one line per update elsewhere
    only at the end (logs stay short).

    Example::

        bar = Progress(6, "fast")
        for step in range(6):
            ...
            bar.update(step + 1)
        bar.close()
    """

    def __init__(self, total: int, label: str, width: int = 24, stream=None):
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.update(0)

    def _line(self, done: int) -> str:
        filled = self.width * done // max(1, self.total)
        return f"  [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} steps  {self.label}"

    def update(self, done: int) -> None:
        if self.tty:
            self.stream.write("\r" + self._line(done))
            self.stream.flush()

    def close(self, note: str = "") -> None:
        end = f"  {time.perf_counter() - self.t0:.1f} s{note}"
        self.stream.write(("\r" if self.tty else "") + self._line(self.total) + end + "\n")
        self.stream.flush()
