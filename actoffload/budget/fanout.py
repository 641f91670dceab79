"""Pieces of one search run side by side in forked processes (docs/budgets.md, "What planning
costs").

The search's greedy paths share nothing across copy windows but what they could score for one
another, so the paths of different windows can run in different processes and give the same
plans. A child is forked (it has the profile and the code already, nothing is sent to it),
runs its piece, and sends the plans back pickled over a pipe; this process runs the first
piece meanwhile. Spare pieces (the search's hand-written families) go to whichever process is
done with its piece first: which share of the paths takes longest depends on the profile.
Forking is safe where no other thread may hold a lock the child would need: the planning
process (:mod:`~.worker`), which imports neither torch nor the training program's modules, and
whose numerical libraries' thread pools are held to one thread (numpy's BLAS, which the search
does not call, would start one a core), and a script that asks for it. A controller in the
training process never asks, and a process running Python threads besides the caller's runs
every piece itself (the guard sees Python's threads only). Where a child cannot be
forked, dies or fails, its pieces run in this process: the plans are the same either way, only
later.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")

_Child = tuple[int, int]  # process id, the read end of its pipe


def run(pieces: Sequence[Callable[[], T]], spare: Sequence[Callable[[], T]] = ()) -> list[T]:
    """Each of ``pieces`` called, all but the first in forked children, the first here, and each
    of ``spare`` by whichever process is done with its piece first; the results of ``pieces``
    then of ``spare``, in order. Without ``os.fork`` (Windows), or with other Python threads
    running (a child would have only the caller's, and any lock another held stays held), they
    all run here, one after the other.

    Example::

        evens, odds, total = run([lambda: sum(range(0, 10**6, 2)), lambda: sum(range(1, 10**6, 2))],
                                 spare=[lambda: sum(range(10**6))])
    """
    if not (hasattr(os, "fork") and threading.active_count() == 1 and len(pieces) > 1):
        return [piece() for piece in pieces] + [piece() for piece in spare]
    if len(spare) > 256:
        raise ValueError(f"at most 256 spare pieces (one byte each), got {len(spare)}")
    claims = _claims(len(spare))
    pending: list[_Child | None] = []  # forked, not yet collected
    try:
        for piece in pieces[1:]:
            with _signals_held() as mask:  # no interruption between the fork and the child's record
                pending.append(_fork(piece, spare, claims, mask))
        results = [pieces[0]()]
        spares = _claimed(spare, claims)
        for piece in pieces[1:]:
            result, theirs = _collect(pending.pop(0), piece)
            results.append(result)
            spares.update(theirs)
    except BaseException:  # no child left behind, running or unreaped
        for child in pending:
            _abandon(child)
        raise
    finally:
        if claims is not None:
            os.close(claims)
    # a spare piece a child claimed and did not send back (it died) runs here
    return results + [spares[i] if i in spares else piece() for i, piece in enumerate(spare)]


def _claims(n: int) -> int | None:
    """The read end of a pipe holding ``n`` bytes, one per spare piece, its write end closed: a
    process claims a piece by reading its byte (a pipe's read of one byte is atomic), and finds
    none left when the read returns nothing. None where there are no spare pieces."""
    if not n:
        return None
    read, write = os.pipe()
    try:
        os.write(write, bytes(range(n)))
    finally:
        os.close(write)
    os.set_blocking(read, False)
    return read


def _claimed(spare: Sequence[Callable[[], T]], claims: int | None) -> dict[int, T]:
    """The spare pieces this process claims, one after another until none is left, run."""
    done: dict[int, T] = {}
    while claims is not None:
        try:
            byte = os.read(claims, 1)
        except BlockingIOError:
            break
        if not byte:
            break
        done[byte[0]] = spare[byte[0]]()
    return done


def _fork(piece: Callable[[], object], spare: Sequence[Callable[[], object]], claims: int | None,
          mask: set[int | signal.Signals]) -> _Child | None:
    """A child running ``piece`` and then the spare pieces it claims, writing its pickled results
    (or a failure, where one raised) to a pipe, with the signal ``mask`` the caller had; None
    where it could not be forked."""
    try:
        read, write = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the child: never returns into the caller's code, nor runs its exit handlers
        status = 1
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(read)
            try:
                result = piece()
                data = pickle.dumps((True, result, _claimed(spare, claims)), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException:  # this process runs its pieces again and raises it there
                data = pickle.dumps((False, None, {}))
            view = memoryview(data)
            while view:
                view = view[os.write(write, view):]
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    return pid, read


_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGHUP}


@contextmanager
def _signals_held() -> Iterator[set[int | signal.Signals]]:
    """The signals a program interrupts with, held back (delivered when the block ends) while a
    child is forked and recorded: interrupted between the two, it would be left running. Gives
    the mask before, the child's to restore."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield before
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _abandon(child: _Child | None) -> None:
    """A child whose results are no longer wanted: ended, its pipe closed, reaped."""
    if child is None:
        return
    pid, read = child
    os.close(read)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _collect(child: _Child | None, piece: Callable[[], T]) -> tuple[T, dict[int, T]]:
    """The child's result and the spare pieces' it ran, read off its pipe; ``piece`` run here
    where there is none (not forked, died, or raised)."""
    if child is None:
        return piece(), {}
    pid, read = child
    chunks = []
    try:
        while True:
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        chunks = []
    except BaseException:  # interrupted while the child runs: it is ended, not waited for
        _abandon(child)
        raise
    os.close(read)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped by the caller's own handler
        pass
    try:
        done, result, spares = pickle.loads(b"".join(chunks))
    except Exception:  # cut short: the child died
        done, result, spares = False, None, {}
    return (result, spares) if done else (piece(), spares)
