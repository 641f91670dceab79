"""Predictions shared by the lengths of a bucket: one search for every length in it.

Batches padded to their longest sequence (a data collator's dynamic padding) give a step
length that rarely recurs, so nearly every step is a signature never seen, whose plan is
predicted (:mod:`~.predict`) and searched for on the step's path: on an H200 the loop sweep's
decoder, at any multiple of 8 tokens from 512 to 2048, spent 23-33 ms of each 60-150 ms step in
that search. So a signature is predicted at its **bucket**'s tokens, the least at or above its
own with at most four significant bits (``m * 2**e``, ``m`` in 8..15: eight buckets an octave,
each within 12.5% of the next; a power of two, and three quarters of one, are their own), and
the lengths of a bucket share the predicted profile and its search: a plan made for the
bucket's tokens saves no fewer bytes at fewer tokens, so it fits every length in it, the
longer ones keeping a little more than they need.

Each signature keeps its own controller: its plan's peaks and times are measured at its own
length, as before.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable, Sequence, TypeVar

from .costmodel import MemoryPlan, Profile

KEPT = 32  # predicted profiles (and searches) kept, the least recently used dropped
P = TypeVar("P")


def bucket(tokens: int) -> int:
    """The least count at or above ``tokens`` with at most four significant bits.

    >>> [bucket(n) for n in (15, 2048, 2049, 6144, 6145, 8100)]
    [15, 2048, 2304, 6144, 6656, 8192]
    """
    shift = max(0, tokens.bit_length() - 4)
    top = -(-tokens >> shift)  # the top four bits, rounded up
    return top << shift


class SharedPredictions:
    """Predictions by key (the profiles they come from, the bucket's tokens), and the search
    made for each predicted profile (by copy windows and the peaks the budget allowed), the
    least recently used dropped beyond :data:`KEPT`. A prediction is handed out as the same
    object for as long as it is kept, so its profile's search is found by it.

    Example::

        shared = SharedPredictions()
        profile = shared.prediction(key, (ref,), lambda: predict.predicted(ref, t_ref, bucket(t), base))
        plans = shared.search(profile, windows, limits, lambda: search.candidates(profile, windows, limits=limits))
    """

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._predictions: collections.OrderedDict[Hashable, tuple[tuple[Any, ...], Any]] = collections.OrderedDict()
        self._searches: collections.OrderedDict[tuple[Any, ...], tuple[Profile, list[MemoryPlan]]] = \
            collections.OrderedDict()
        self.searched = 0  # searches made (not found here)

    def prediction(self, key: Hashable, sources: tuple[Any, ...], make: Callable[[], P]) -> P:
        """What is predicted under ``key`` from ``sources`` (the objects it is made from, checked
        by identity: a profile replaced since makes it again), made by ``make()`` if not kept."""
        kept = self._predictions.get(key)
        if kept is not None and len(kept[0]) == len(sources) and all(a is b for a, b in zip(kept[0], sources)):
            self._predictions.move_to_end(key)
            return kept[1]
        made = make()
        self._predictions[key] = (sources, made)
        self._trim(self._predictions)
        return made

    def search(self, profile: Profile, windows: Sequence[tuple[int, int]] | None, limits: Sequence[int] | None,
               make: Callable[[], list[MemoryPlan]]) -> list[MemoryPlan]:
        """The plans searched for ``profile``, made by ``make()`` where no search with these
        ``windows`` and ``limits`` (the peaks the budget allowed; ``None``: a quick search, which
        takes none) is kept."""
        key = (id(profile), None if windows is None else tuple(windows), None if limits is None else tuple(limits))
        kept = self._searches.get(key)
        if kept is not None and kept[0] is profile:
            self._searches.move_to_end(key)
            return kept[1]
        plans = make()
        self.searched += 1
        self._searches[key] = (profile, plans)
        self._trim(self._searches)
        return plans

    def _trim(self, kept: collections.OrderedDict) -> None:
        while len(kept) > self.kept:
            kept.popitem(last=False)
