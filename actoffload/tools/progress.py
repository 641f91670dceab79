"""A one-line progress bar on stderr (no dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``[#####.....] 3/6 steps  label``: redrawn in place on a terminal; elsewhere (logs)
    written once, when closed.

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
        self.done = 0
        self.update(0)

    def _line(self) -> str:
        filled = self.width * self.done // max(1, self.total)
        return f"  [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} steps  {self.label}"

    def update(self, done: int) -> None:
        self.done = done
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def close(self, note: str = "") -> None:
        """End the line with the elapsed time (and ``note``)."""
        end = f"  {time.perf_counter() - self.t0:.1f} s{note}"
        self.stream.write(("\r" if self.tty else "") + self._line() + end + "\n")
        self.stream.flush()
