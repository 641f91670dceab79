"""Pieces of one search run side by side in forked processes (docs/budgets.md, "What planning
costs").

The search's greedy paths share nothing across copy windows but what they could score for one
another, so the paths of different windows can run in different processes and give the same
plans. A child is forked (it has the profile and the code already, nothing is sent to it),
runs its piece, and sends the plans back pickled over a pipe; this process runs the first
piece meanwhile. Forking is safe where no other thread may hold a lock the child would need:
the planning process (:mod:`~.worker`), which imports neither torch nor anything that starts
threads, and a script that asks for it. A controller in the training process never asks, and
a process running Python threads besides the caller's runs every piece itself. Where a child
cannot be forked, dies or fails, its piece runs in this process: the plans are the same either
way, only later.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def run(pieces: Sequence[Callable[[], T]]) -> list[T]:
    """Each of ``pieces`` called, all but the first in forked children, the first here; their
    results in order. Without ``os.fork`` (Windows), or with other Python threads running (a
    child would have only the caller's, and any lock another held stays held), they all run
    here, one after the other.

    Example::

        evens, odds = run([lambda: sum(range(0, 10**6, 2)), lambda: sum(range(1, 10**6, 2))])
    """
    apart = hasattr(os, "fork") and threading.active_count() == 1
    children = [_fork(piece) if apart else None for piece in pieces[1:]]
    try:
        results = [pieces[0]()] if pieces else []
    except BaseException:  # no child left behind, running or unreaped
        for child in children:
            _abandon(child)
        raise
    for k, (piece, child) in enumerate(zip(pieces[1:], children)):
        try:
            results.append(_collect(child, piece))
        except BaseException:
            for later in children[k + 1:]:
                _abandon(later)
            raise
    return results


_Child = tuple[int, int]  # process id, the read end of its pipe


def _fork(piece: Callable[[], object]) -> _Child | None:
    """A child running ``piece`` and writing its pickled result (or None where it raised) to a
    pipe; None where it could not be forked."""
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
            os.close(read)
            try:
                data = pickle.dumps((True, piece()), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException:  # this process runs the piece again and raises it there
                data = pickle.dumps((False, None))
            view = memoryview(data)
            while view:
                view = view[os.write(write, view):]
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    return pid, read


def _abandon(child: _Child | None) -> None:
    """A child whose result is no longer wanted: ended, its pipe closed, reaped."""
    if child is None:
        return
    pid, read = child
    os.close(read)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _collect(child: _Child | None, piece: Callable[[], T]) -> T:
    """The child's result, read off its pipe; ``piece`` run here where there is none (not forked,
    died, or raised)."""
    if child is None:
        return piece()
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
    finally:
        os.close(read)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # reaped by the caller's own handler
            pass
    try:
        done, result = pickle.loads(b"".join(chunks))
    except Exception:  # cut short: the child died
        done, result = False, None
    return result if done else piece()
