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
import queue
import struct
import subprocess
import sys
import threading
import time
import warnings
from typing import IO, Any, Sequence

from . import search
from .costmodel import MemoryPlan, Profile

# The helper's first lines, run isolated (-I: no working directory, user site or PYTHON*
# variables on its path, so that no file of the caller's shadows the standard library): the
# parent's import path and this package's folder come next, so that the budget's modules (and
# pickled profiles' classes) import as in the parent, without running the package's
# __init__.py (which imports torch). Answers go to a pipe of their own (its descriptor is the
# argument): anything a site hook prints goes to the parent's standard output, not into them.
_BOOT = """
import pickle, signal, sys, types
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's: this ends with its pipe
path, name, package = pickle.load(sys.stdin.buffer)
sys.path[:] = path
module = types.ModuleType(name)
module.__path__ = [package]
sys.modules[name] = module
worker = __import__(name + ".budget.worker", fromlist=["serve"])
worker.serve(sys.stdin.buffer, int(sys.argv[1]))
"""

_HEADER = struct.Struct("<Q")  # an answer's length, before it
_PACKAGE = __name__.split(".")[0]


class WorkerFailed(RuntimeError):
    """The helper process cannot answer (it did not start, or died): search in this process."""


def serve(requests: IO[bytes], answers_fd: int) -> None:
    """The helper's loop: each request ``(ticket, profile, windows, limits)`` is answered with
    ``(ticket, plans, seconds)``, or ``(ticket, None, error)`` where the search raised, until
    the parent closes the pipe (or is gone)."""
    processes = search_processes()
    try:
        while True:
            try:
                ticket, profile, windows, limits = pickle.load(requests)
            except (EOFError, OSError):
                return
            started = time.perf_counter()
            try:
                answer: tuple[int, Any, Any] = (ticket, search.candidates(profile, windows, limits=limits,
                                                                          processes=processes),
                                                time.perf_counter() - started)
            except Exception as e:  # the parent searches itself, and raises it there
                answer = (ticket, None, repr(e))
            data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(_HEADER.pack(len(data)) + data)  # framed: read off the bare pipe
            try:
                while view:
                    view = view[os.write(answers_fd, view):]
            except OSError:  # the parent is gone
                return
    finally:
        try:
            os.close(answers_fd)
        except OSError:
            pass


def search_processes() -> int:
    """How many processes the helper searches in (:func:`~.search.candidates`): the cores this
    process may run on, less one for the training process's own host work, and no more than
    the search has pieces for (one per copy window's ``max_inflight``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores - 1, len(search.WINDOWS)))


class PlanWorker:
    """A helper process that makes plans (see the module). Two daemon threads of this process
    move the bytes (requests out, answers in), blocked in the pipes' system calls, which hold no
    interpreter lock: neither the step nor the helper ever waits on the other's pipe. Both pipes
    are bare descriptors (no buffered file object, whose lock a forked child would inherit held).

    Example::

        worker = PlanWorker()
        ticket = worker.submit(profile)
        ...                                 # steps run meanwhile
        answer = worker.result(ticket)      # (plans, seconds); None while it still searches
    """

    def __init__(self) -> None:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        requests_in, requests_out = os.pipe()
        answers_in, answers_out = os.pipe()
        try:
            # its numerical libraries on one thread: it forks to search side by side (fanout), and
            # numpy's BLAS, which the search does not call, would start a thread pool a core
            env = {**os.environ, **{v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
            # its standard output and error are this process's, so that anything it says shows
            self._proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, str(answers_out)], stdin=requests_in,
                                          pass_fds=(answers_out,), close_fds=True, env=env)
        except BaseException:
            os.close(requests_out)
            os.close(answers_in)
            raise
        finally:
            os.close(requests_in)
            os.close(answers_out)
        self._pid = os.getpid()  # the process whose helper it is (not a child forked since)
        self._requests_fd, self._answers_fd = requests_out, answers_in
        self._tickets = itertools.count(1)
        self._cond = threading.Condition()  # guards what follows, and the descriptors; notified as answers come
        self._answers: dict[int, tuple[Any, Any]] = {}  # answers not yet taken
        self._outstanding: set[int] = set()  # tickets asked for and not yet taken or forgotten
        self._forgotten: set[int] = set()  # outstanding tickets no longer wanted: not sent, or dropped as they come
        self._error: str | None = None  # why it can no longer answer
        self._requests: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self.seconds = 0.0  # the searches' time in the helper, all told
        self.answered = 0  # answers that came, those dropped among them
        self._requests.put((0, pickle.dumps((list(sys.path), _PACKAGE, package), protocol=pickle.HIGHEST_PROTOCOL)))
        threading.Thread(target=self._write, name="actoffload-plan-requests", daemon=True).start()
        threading.Thread(target=self._read, name="actoffload-plan-answers", daemon=True).start()

    # -------------------------------------------------------------- the threads
    def _write(self) -> None:
        try:
            while (request := self._requests.get()) is not None:
                ticket, data = request
                with self._cond:
                    if ticket in self._forgotten:  # replaced before it was sent: not searched at all
                        self._forgotten.discard(ticket)
                        self._outstanding.discard(ticket)
                        continue
                view = memoryview(data)
                while view:
                    view = view[os.write(self._requests_fd, view):]
        except OSError as e:
            self._fail(f"its request pipe failed: {e}")
        finally:
            self._close_fd("_requests_fd")  # the helper's end of input: it ends

    def _read(self) -> None:
        try:
            while True:
                (size,) = _HEADER.unpack(self._take(_HEADER.size))
                ticket, plans, extra = pickle.loads(self._take(size))
                with self._cond:
                    self.answered += 1
                    if ticket in self._forgotten:
                        self._forgotten.discard(ticket)
                        self._outstanding.discard(ticket)
                    elif ticket in self._outstanding:
                        self._answers[ticket] = (plans, extra)
                    self._cond.notify_all()
        except Exception as e:  # EOF, a broken or foreign stream: no more answers
            self._fail(f"it ended (exit code {self._proc.poll()}): {e!r}")
        finally:
            self._close_fd("_answers_fd")

    def _take(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = os.read(self._answers_fd, min(n, 1 << 20))
            if not chunk:
                raise EOFError("the answer pipe closed")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _close_fd(self, name: str) -> None:
        """Close one of the pipes' descriptors, forgetting its number first (under the lock):
        the number may go to another file at once, which a fork's hook must not touch."""
        with self._cond:
            fd = getattr(self, name)
            setattr(self, name, -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def _fail(self, error: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # -------------------------------------------------------------- the controllers' side
    def submit(self, profile: Profile, windows: Sequence[tuple[int, int]] | None = None,
               limits: Sequence[int] = ()) -> int:
        """Ask for :func:`~.search.candidates` of ``profile`` (and ``windows``, ``limits``);
        returns the ticket its answer comes under. Never waits for the helper."""
        ticket = next(self._tickets)
        data = pickle.dumps((ticket, profile, None if windows is None else list(windows), list(limits)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        with self._cond:
            if self._error is not None:
                raise WorkerFailed(f"the planning process cannot answer: {self._error}")
            self._outstanding.add(ticket)
        self._requests.put((ticket, data))
        return ticket

    def result(self, ticket: int, wait: bool = False) -> tuple[list[MemoryPlan], float] | None:
        """The plans asked for under ``ticket``, and the seconds the helper searched; ``None``
        while it still searches (with ``wait``: wait for them). Raises :class:`WorkerFailed`
        where it cannot answer, or its search raised (the caller searches itself, and sees the
        error there)."""
        with self._cond:
            while ticket not in self._answers:
                if self._error is not None:
                    raise WorkerFailed(f"the planning process cannot answer: {self._error}")
                if ticket not in self._outstanding or ticket in self._forgotten:
                    raise WorkerFailed(f"no request under ticket {ticket} is waiting")
                if not wait:
                    return None
                self._cond.wait()
            plans, extra = self._answers.pop(ticket)
            self._outstanding.discard(ticket)
            if plans is not None:
                self.seconds += extra
        if plans is None:
            raise WorkerFailed(f"the planning process's search raised {extra}")
        return plans, extra

    def forget(self, ticket: int) -> None:
        """An answer no longer wanted (its profile was replaced, its controller dropped): the
        request is not sent if it still waits to be, its answer let go of or dropped as it comes.
        A ticket already taken is no one's: nothing happens."""
        with self._cond:
            if ticket not in self._outstanding:
                return
            if self._answers.pop(ticket, None) is not None:
                self._outstanding.discard(ticket)
            else:
                self._forgotten.add(ticket)

    def close(self, wait_s: float = 1.0) -> None:
        """End the helper process: its input is closed, so it ends; one still running after
        ``wait_s`` (a process forked from this one keeps the pipe open) is killed. In a child
        forked from the process that started it, nothing is the child's to end."""
        self._fail("it was closed")
        if os.getpid() != self._pid:
            return
        self._requests.put(None)
        try:
            self._proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _forked(self) -> None:
        """In a child process forked from this one: its threads did not come along, and the
        helper is the parent's. The child lets go of its copies of the pipes, so that the helper
        still ends with the parent: each descriptor still open is pointed at the null device
        (closed, its number could go to a file the child opens, and be written by the pipe's
        thread's copy nowhere; the lock is not taken: its holder may not have come along)."""
        self._error = "this process was forked from the one that started it"
        for fd in (self._requests_fd, self._answers_fd):
            if fd >= 0:
                null = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(null, fd)
                finally:
                    os.close(null)


_shared: PlanWorker | None = None
_failed = False
_shared_lock = threading.Lock()


def shared() -> PlanWorker | None:
    """The process's planning worker, started on first use; ``None`` where none can run (it
    failed before; Windows, which passes no pipe but the standard ones; a frozen application,
    whose executable is not Python; the package vendored under another's name)."""
    global _shared, _failed
    with _shared_lock:
        if _shared is None and not _failed:
            if (sys.platform == "win32" or getattr(sys, "frozen", False) or not sys.executable
                    or __name__ != f"{_PACKAGE}.budget.worker"):
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
        worker.close(wait_s=0.0)
    except Exception:
        pass


def _after_fork_in_child() -> None:
    global _shared
    worker, _shared = _shared, None
    if worker is not None:
        worker._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
