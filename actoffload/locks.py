"""A lock that code run by finalizers may want, on the thread that holds it.

A weak reference's callback (:class:`~actoffload.hostmem.Finalizers`) runs wherever what it
watches is freed, and an object in a reference cycle is freed by a garbage-collection pass,
which starts at whichever allocation of a tracked object comes next: possibly inside a
section that holds the very lock the callback takes. A plain lock would then wait for
itself. :class:`OwnedLock` knows its holder: work a callback runs under it
(:meth:`OwnedLock.run`) on the thread holding it is handed over, and the holder runs it, still
holding the lock, just before letting go.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable


class OwnedLock:
    """A non-reentrant lock that runs, as its holder lets go, what was handed to it meanwhile.

    Example::

        lock = OwnedLock()

        def freed(item):                   # a finalizer's callback: may run inside `with lock:`
            lock.run(give_back, item)      # under the lock, now or as this thread's section ends
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._later: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            while self._later:  # (running one may free more: they queue here too)
                fn, args = self._later.popleft()
                fn(*args)
        finally:
            self._owner = None
            self._lock.release()

    def held_here(self) -> bool:
        """Whether this thread holds the lock (a callback run inside a section that holds it)."""
        return self._owner == threading.get_ident()

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` under the lock: at once, or, where this thread holds it already (a
        finalizer run inside a section), by the holder as it lets go."""
        if self.held_here():
            self._later.append((fn, args))
            return
        with self:
            fn(*args)
