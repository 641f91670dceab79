"""Watching an offloader work: subclass :class:`Observer`, override what you need.

Benchmarks and tools read what an offloader does through this interface (never by
patching it): every tensor handed to it inside a group, every commit, and, on CUDA,
the timing of every batch of copies on the copy streams.
"""

from __future__ import annotations

from typing import Any, Iterator

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
        """``group`` was decided (R8): committed, or kept for ``keep_last`` (backward reached it
        first, or its commit found host memory short and raised); ``summary`` is what ``stats()``
        reports for it."""

    def on_copy(self, direction: str, nbytes: int, start: Any, end: Any) -> None:
        """A batch of copies of ``nbytes`` (``"d2h"`` or ``"h2d"``) ran between two CUDA events
        recorded with timing on the copy stream (``start.elapsed_time(end)`` is its time).
        Only ``fast`` on CUDA reports copies, and only to observers that override this."""


def wants_copies(observer: Observer) -> bool:
    """Whether ``observer`` overrides :meth:`Observer.on_copy` (timing events cost a little)."""
    return type(observer).on_copy is not Observer.on_copy


def listening(observers: list[Observer]) -> Iterator[Observer]:
    """Each of ``observers`` in turn that is still among them when its turn comes: one may
    remove itself or another as it hears an event, and the others still hear it.

    >>> heard, observers = [], [Observer(), Observer()]
    >>> for obs in listening(observers):
    ...     heard.append(obs)
    ...     observers.remove(observers[-1])  # the first to hear removes the last
    >>> len(heard)
    1
    """
    for obs in tuple(observers):
        if obs in observers:
            yield obs
