"""The one progress bar of the project: a line on stderr (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``[#####.....] 3/6 steps  label``, with failures and a rate if asked: redrawn in
    place on a terminal; elsewhere (logs) written when closed and, with ``log_lines``,
    that many times on the way.

    Example::

        bar = Progress(6, "fast")
        for step in range(6):
            ...
            bar.update(step + 1)
        bar.close()

        bar = Progress(2000, "fast on cuda", unit="scenarios", failures=True, rate=True, log_lines=10)
        bar.update(10, failed=0)       # [..........] 10/2000 scenarios  fast on cuda  failed=0  9.8/s
    """

    def __init__(self, total: int, label: str = "", *, unit: str = "steps", width: int = 24,
                 failures: bool = False, rate: bool = False, log_lines: int = 0,
                 stream: TextIO | None = None):
        self.total, self.label, self.unit, self.width = total, label, unit, width
        self.rate, self.log_lines = rate, log_lines
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.done = 0
        self.failed: int | None = 0 if failures else None  # None: failures are not counted
        self._logged = 0  # parts of the way already written to a log
        self.update(0)

    def _line(self) -> str:
        filled = self.width * min(self.done, self.total) // max(1, self.total)
        parts = [f"  [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {self.unit}"]
        if self.label:
            parts.append(self.label)
        if self.failed is not None:
            parts.append(f"failed={self.failed}")
        if self.rate:
            parts.append(f"{self.done / max(time.perf_counter() - self.t0, 1e-9):.1f}/s")
        return "  ".join(parts)

    def update(self, done: int, failed: int | None = None) -> None:
        """``done`` of ``total`` finished (``failed`` of them failed, if failures are counted)."""
        self.done = done
        if failed is not None:
            self.failed = failed
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
        elif self.log_lines and done < self.total:
            part = done * self.log_lines // max(1, self.total)
            if part > self._logged:  # a log gets a line each time another 1/log_lines of the way is done
                self._logged = part
                self.stream.write(self._line() + "\n")
                self.stream.flush()

    def close(self, note: str = "") -> None:
        """End the line with the elapsed time (and ``note``)."""
        end = f"  {time.perf_counter() - self.t0:.1f} s{note}"
        self.stream.write(("\r" if self.tty else "") + self._line() + end + "\n")
        self.stream.flush()
