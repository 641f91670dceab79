"""Planning off the critical path: the search (:func:`~.search.candidates`) runs in a helper
process while the step goes on (docs/budgets.md, "What planning costs").

A search takes tens to hundreds of milliseconds of host time, longer than a short training
step. Made at a step's beginning, it held up that step by as much. A thread does not help: the
search is pure Python and holds the interpreter lock, so the training loop's host work (which
drops and takes back the lock at every kernel launch) waited on it; on this project's test
machine a step of 2 ms took 68 with a search running beside it. So the search runs in a
process of its own, which imports only the budget's pure-Python modules (not torch: it starts
in about a tenth of a second) and answers requests, pickled over a pipe, one after another.
The controller asks, runs a quick search's plans meanwhile (:func:`~.search.quick_candidates`),
and takes the answer at a later step's beginning (:class:`~.controller.BudgetController`).

One worker serves every controller of the process (:func:`shared`), made on first use on a
CUDA device. Should it fail to start, die, or answer with an error, the controller searches
by itself from then on, and the worker is not used again in the process.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import warnings
from typing import IO, Any, Sequence

from .costmodel import MemoryPlan, Profile

# The helper's first lines: the parent's import path and this package's folder come first, so
# that the budget's modules (and pickled profiles' classes) import as in the parent, without
# running actoffload/__init__.py (which imports torch).
_BOOT = """
import pickle, sys, types
path, package = pickle.load(sys.stdin.buffer)
sys.path[:] = path
module = types.ModuleType("actoffload")
module.__path__ = [package]
sys.modules["actoffload"] = module
from actoffload.budget import worker
worker.serve(sys.stdin.buffer, sys.stdout.buffer)
"""


_HEADER = struct.Struct("<Q")  # an answer's length, before it
KEPT_ANSWERS = 32  # answers waiting to be taken: each controller waits for one at most


class WorkerFailed(RuntimeError):
    """The helper process cannot answer (it did not start, or died): search in this process."""


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The helper's loop: each request ``(ticket, profile, windows)`` is answered with
    ``(ticket, plans, seconds)``, or ``(ticket, None, error)`` where the search raised, until
    the parent closes the pipe."""
    from . import search

    while True:
        try:
            ticket, profile, windows = pickle.load(requests)
        except EOFError:
            return
        started = time.perf_counter()
        try:
            answer: tuple[int, Any, Any] = (ticket, search.candidates(profile, windows),
                                            time.perf_counter() - started)
        except Exception as e:  # the parent searches itself, and raises it there
            answer = (ticket, None, repr(e))
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        answers.write(_HEADER.pack(len(data)) + data)  # framed: the parent reads it off the bare pipe
        answers.flush()


class PlanWorker:
    """A helper process that makes plans (see the module).

    Example::

        worker = PlanWorker()
        ticket = worker.submit(profile)
        ...                                 # steps run meanwhile
        answer = worker.result(ticket)      # (plans, seconds); None while it still searches
    """

    def __init__(self) -> None:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # only the pipes are passed (close_fds); its standard error is this process's, so that a failure shows
        self._proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, close_fds=True)
        assert self._proc.stdout is not None
        self._fd = self._proc.stdout.fileno()
        self._tickets = itertools.count(1)
        self._answers: dict[int, tuple[Any, Any]] = {}  # answers not yet taken, oldest first
        self._forgotten: set[int] = set()  # tickets whose answers are dropped as they come
        self._lock = threading.Lock()  # controllers of several threads share the process's worker
        self.seconds = 0.0  # the searches' time in the helper, all told
        try:
            self._send((list(sys.path), package))
        except OSError as e:
            self.close()
            raise WorkerFailed(f"the planning process did not start: {e}") from e

    def _send(self, message: Any) -> None:
        assert self._proc.stdin is not None
        pickle.dump(message, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self._proc.stdin.flush()

    def submit(self, profile: Profile, windows: Sequence[tuple[int, int]] | None = None) -> int:
        """Ask for :func:`~.search.candidates` of ``profile`` (and ``windows``); returns the
        ticket its answer comes under."""
        with self._lock:
            ticket = next(self._tickets)
            try:
                self._send((ticket, profile, None if windows is None else list(windows)))
            except (OSError, ValueError) as e:
                raise WorkerFailed(f"the planning process is gone: {e}") from e
            return ticket

    def result(self, ticket: int, wait: bool = False) -> tuple[list[MemoryPlan], float] | None:
        """The plans asked for under ``ticket``, and the seconds the helper searched; ``None``
        while it still searches (with ``wait``: wait for them). Raises :class:`WorkerFailed`
        where it cannot answer, or its search raised (the caller searches itself, and sees the
        error there)."""
        with self._lock:
            while ticket not in self._answers:
                if not self._readable(None if wait else 0.0):
                    return None
                self._receive()
            plans, extra = self._answers.pop(ticket)
        if plans is None:
            raise WorkerFailed(f"the planning process's search raised {extra}")
        self.seconds += extra
        return plans, extra

    def forget(self, ticket: int) -> None:
        """An answer no longer wanted (its profile was replaced): dropped when it comes."""
        with self._lock:
            if self._answers.pop(ticket, None) is None:
                self._forgotten.add(ticket)

    def _readable(self, timeout: float | None) -> bool:
        try:
            ready, _, _ = select.select([self._fd], [], [], timeout)
        except (OSError, ValueError) as e:
            raise WorkerFailed(f"the planning process's pipe failed: {e}") from e
        return bool(ready)

    def _read(self, n: int) -> bytes:
        """Exactly ``n`` bytes off the pipe (read bare: a buffered reader could hold the next
        answer where ``select`` does not see it)."""
        chunks = []
        while n:
            chunk = os.read(self._fd, n)
            if not chunk:
                raise EOFError("the pipe closed")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _receive(self) -> None:
        try:
            (size,) = _HEADER.unpack(self._read(_HEADER.size))
            ticket, plans, extra = pickle.loads(self._read(size))
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            code = self._proc.poll()
            raise WorkerFailed(f"the planning process ended (exit code {code}): {e!r}") from e
        if ticket in self._forgotten:
            self._forgotten.discard(ticket)
            return
        self._answers[ticket] = (plans, extra)
        while len(self._answers) > KEPT_ANSWERS:  # a controller dropped while it waited never takes its own
            del self._answers[next(iter(self._answers))]

    def close(self) -> None:
        """End the helper process (it ends by itself once this process's end of the pipe closes)."""
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


_shared: PlanWorker | None = None
_failed = False
_shared_lock = threading.Lock()


def shared() -> PlanWorker | None:
    """The process's planning worker, started on first use; ``None`` where none can run (it
    failed before, or this platform cannot wait on its pipe)."""
    global _shared, _failed
    with _shared_lock:
        if _shared is None and not _failed:
            if not hasattr(select, "select") or sys.platform == "win32":
                _failed = True
                return None
            try:
                _shared = PlanWorker()
            except (WorkerFailed, OSError) as e:
                _failed = True
                warnings.warn(f"actoffload: memory-budget planning runs in the training process ({e})",
                              RuntimeWarning, stacklevel=2)
                return None
            atexit.register(_shared.close)
        return _shared


def failed(worker: PlanWorker, error: BaseException) -> None:
    """``worker`` could not answer: it is closed and not used again in this process."""
    global _shared, _failed
    with _shared_lock:
        _failed = True
        if _shared is worker:
            _shared = None
    warnings.warn(f"actoffload: memory-budget planning runs in the training process from now on ({error})",
                  RuntimeWarning, stacklevel=2)
    try:
        worker.close()
    except Exception:
        pass
