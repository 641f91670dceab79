"""Watching an offloader work: subclass :class:`Observer`, override what you need.

Benchmarks and tools read what an offloader does through this interface (never by
patching it): every tensor handed to it inside a group, every commit, and, on CUDA,
the timing of every batch of copies on the copy streams.
"""

from __future__ import annotations

from typing import Any

import torch


class Observer:
    """Receives an offloader's events; every method does nothing unless overridden.

    Example::

        class CountSaves(ao.Observer):
            n = 0
            def on_save(self, group, tensor):
                self.n += 1

        counter = CountSaves()
        handle = off.add_observer(counter)
        ...                                   # forward inside groups
        handle.remove()
    """

    def on_save(self, group: str, tensor: torch.Tensor) -> None:
        """A tensor saved for backward inside ``group`` (each buffer of a multi-buffer tensor)."""

    def on_commit(self, group: str, summary: dict[str, Any]) -> None:
        """``group`` was decided; ``summary`` is what ``stats()`` reports for it."""

    def on_copy(self, direction: str, nbytes: int, start: Any, end: Any) -> None:
        """A batch of copies of ``nbytes`` (``"d2h"`` or ``"h2d"``) ran between two CUDA events
        recorded with timing on the copy stream (``start.elapsed_time(end)`` is its time).
        Only ``fast`` on CUDA reports copies, and only to observers that override this."""


def wants_copies(observer: Observer) -> bool:
    """Whether ``observer`` overrides :meth:`Observer.on_copy` (timing events cost a little)."""
    return type(observer).on_copy is not Observer.on_copy
