"""Storages shared between groups (R5): a span moved out by one group serves a later group
that saves the same storage, instead of moving the bytes again."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import compat
from .policy import SavedFact
from .records import Moved


class SharedStorages:
    """Spans moved out and still alive, by storage key.

    An entry lives while both its span and the storage it was copied from live: a dead
    storage's key may be reused by a new storage, whose bytes the copy does not hold.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[int, list[tuple[weakref.ref[Moved], StorageWeakRef]]] = {}

    def remember(self, key: int, m: Moved, t: torch.Tensor) -> None:
        """``m`` holds a copy of ``t``'s storage (key ``key``)."""
        entry = (weakref.ref(m), compat.storage_weakref(t))
        with self._lock:
            self._by_key[key] = self._live(key) + [entry]
        weakref.finalize(m, self._forget, key)

    def copy_of(self, key: int, aliases: list[SavedFact]) -> Moved | None:
        """A live copy of this very storage that holds every byte of ``aliases`` at a
        whole-element offset, with no in-place write since it was made."""
        with self._lock:
            entries = list(self._by_key.get(key, ()))
        for ref, storage in entries:
            m = ref()
            if m is None or storage.expired() or not m.unchanged_since_copy():
                continue
            lo, hi = m.span.start, m.span.start + m.nbytes
            if all(lo <= f.start and f.end <= hi and (f.start - lo) % f.element_size == 0 for f in aliases):
                return m
        return None

    def _forget(self, key: int) -> None:
        with self._lock:
            live = self._live(key)
            if live:
                self._by_key[key] = live
            else:
                self._by_key.pop(key, None)

    def _live(self, key: int) -> list[tuple[weakref.ref[Moved], StorageWeakRef]]:
        """The entries of ``key`` whose span and storage both still live (caller holds the lock)."""
        return [e for e in self._by_key.get(key, ()) if e[0]() is not None and not e[1].expired()]
