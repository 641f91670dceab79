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

    An entry counts while both its span and the storage it was copied from live: a dead
    storage's key may be reused by a new storage, whose bytes the copy does not hold. Dead
    entries are dropped when their key is next used, and all of them whenever the table has
    doubled since the last sweep (no finalizer per span: a commit of many tiny spans paid
    more for those than for the copies).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[int, list[tuple[weakref.ref[Moved], StorageWeakRef]]] = {}
        self._sweep_at = 1024

    def remember(self, key: int, m: Moved, t: torch.Tensor) -> None:
        """``m`` holds a copy of ``t``'s storage (key ``key``)."""
        entry = (weakref.ref(m), compat.storage_weakref(t))
        with self._lock:
            live = self._live(key) if key in self._by_key else []
            live.append(entry)
            self._by_key[key] = live
            if len(self._by_key) > self._sweep_at:
                for k in list(self._by_key):
                    self._forget(k)
                self._sweep_at = max(1024, 2 * len(self._by_key))

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
        """Drop the dead entries of ``key`` (the caller holds the lock)."""
        live = self._live(key)
        if live:
            self._by_key[key] = live
        else:
            self._by_key.pop(key, None)

    def __len__(self) -> int:
        """Keys with entries, dead ones included until swept."""
        return len(self._by_key)

    def _live(self, key: int) -> list[tuple[weakref.ref[Moved], StorageWeakRef]]:
        """The entries of ``key`` whose span and storage both still live (caller holds the lock)."""
        return [e for e in self._by_key.get(key, ()) if e[0]() is not None and not e[1].expired()]
