"""A lock that code run by finalizers may want, on the thread that holds it.

A weak reference's callback (:class:`~actoffload.hostmem.Finalizers`) runs wherever what it
watches is freed, and an object in a reference cycle is freed by a garbage-collection pass,
which starts at whichever allocation of a tracked object comes next: possibly inside a
section that holds the very lock the callback takes. A plain lock would then wait for
itself. :class:`OwnedLock` knows its holder: a callback that finds the lock held by its own
thread hands its work over (:meth:`OwnedLock.later`), and the holder runs it, still holding
the lock, just before letting go.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable


class OwnedLock:
    """A non-reentrant lock that runs, as its holder lets go, what was handed to it meanwhile.

    Example::

        lock = OwnedLock()

        def freed(item):                    # a finalizer's callback
            if lock.held_here():
                lock.later(give_back, item)  # the holder runs it before it lets go
                return
            with lock:
                give_back(item)
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

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Have the holder run ``fn(*args)``, still holding the lock, before it lets go (call
        only where :meth:`held_here`)."""
        self._later.append((fn, args))
