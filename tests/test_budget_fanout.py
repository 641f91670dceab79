"""Pieces of a search run side by side in forked processes: their results come back in order,
and a child that fails or dies leaves its piece to this process, so the result is the same
(CPU only)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actoffload.budget import fanout

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="pieces run in forked children only where os.fork is")


def in_a_fresh_process(*code: str) -> None:
    """``code``'s parts, one after the other, run in a Python of its own: no thread another test
    left running keeps it from forking."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", "\n".join(textwrap.dedent(c) for c in code)], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert done.returncode == 0, done.stderr


# code for in_a_fresh_process: ``watched``, fanout.run recording in ``forked`` the processes its
# pieces ran in (``run``: fanout.run itself)
WATCH_FORKS = """
    import os
    from actoffload.budget import fanout
    forked, run = set(), fanout.run
    def watched(pieces, spare=()):  # each piece's result, and the process that made it
        results = run(*([lambda piece=piece: (os.getpid(), piece()) for piece in some] for some in (pieces, spare)))
        forked.update(pid for pid, _ in results)
        return [result for _, result in results]
"""


def test_pieces_run_in_children_and_their_results_come_back_in_order():
    in_a_fresh_process("""
        import os
        from actoffload.budget import fanout
        here = os.getpid()
        results = fanout.run([lambda k=k: (k, os.getpid()) for k in range(4)])
        assert [k for k, _ in results] == [0, 1, 2, 3]
        assert results[0][1] == here and all(pid != here for _, pid in results[1:])
        assert len({pid for _, pid in results}) == 4
        assert fanout.run([]) == []
    """)


def test_a_large_result_comes_back_whole():
    big = list(range(2_000_000))  # far beyond a pipe's buffer
    assert fanout.run([lambda: 0, lambda: big]) == [0, big]


def test_a_piece_that_raises_in_its_child_raises_here():
    def piece():
        raise KeyError("no such group")
    with pytest.raises(KeyError, match="no such group"):
        fanout.run([lambda: 0, piece])


def test_a_child_that_dies_leaves_its_piece_to_this_process():
    here = os.getpid()

    def piece():
        if os.getpid() != here:
            os._exit(3)  # the child dies without a word
        return "made here"
    assert fanout.run([lambda: 0, piece]) == [0, "made here"]


def test_without_fork_every_piece_runs_here(monkeypatch):
    here = os.getpid()
    monkeypatch.delattr(os, "fork")
    assert fanout.run([os.getpid, os.getpid]) == [here, here]


def test_a_fork_that_fails_leaves_the_piece_to_this_process(monkeypatch):
    def refused():
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(os, "fork", refused)
    here = os.getpid()
    assert fanout.run([os.getpid, os.getpid]) == [here, here]


def test_with_another_thread_running_every_piece_runs_here():
    import threading
    here, stop = os.getpid(), threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert fanout.run([os.getpid, os.getpid]) == [here, here]
    finally:
        stop.set()
        other.join()


def test_a_piece_that_raises_here_leaves_no_child_behind():
    in_a_fresh_process("""
        import os, time
        from actoffload.budget import fanout
        def here():
            raise ValueError("the first piece failed")
        try:
            fanout.run([here, lambda: time.sleep(60)])
        except ValueError:
            pass
        else:
            raise AssertionError("the first piece's error was not raised")
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left: the sleeping child was ended and reaped
            pass
        else:
            raise AssertionError("a child was left behind")
    """)


def test_a_spare_piece_goes_to_the_process_done_first_and_comes_back_after_the_pieces():
    in_a_fresh_process("""
        import os, time
        from actoffload.budget import fanout
        here = os.getpid()
        def slow():
            time.sleep(1.0)  # the child is done first, and claims the spare piece
            return ("piece", os.getpid())
        results = fanout.run([slow, lambda: ("piece", os.getpid())], spare=[lambda: ("spare", os.getpid())])
        assert [kind for kind, _ in results] == ["piece", "piece", "spare"]
        (_, first), (_, child), (_, spare) = results
        assert first == here and child != here and spare == child
        def quick():
            return ("piece", os.getpid())
        def late():
            time.sleep(1.0)
            return ("piece", os.getpid())
        results = fanout.run([quick, late], spare=[lambda: ("spare", os.getpid())])
        assert results[2] == ("spare", here)  # this process was done first
    """)


def test_a_spare_piece_a_child_claimed_and_died_in_runs_here():
    in_a_fresh_process("""
        import os, time
        from actoffload.budget import fanout
        here = os.getpid()
        def slow():
            time.sleep(1.0)
            return 0
        def spare():
            if os.getpid() != here:
                os._exit(3)  # the child claimed it, and dies
            return "made here"
        assert fanout.run([slow, lambda: 1], spare=[spare, lambda: 2]) == [0, 1, "made here", 2]
    """)


def test_without_fork_the_spare_pieces_run_here_after_the_pieces(monkeypatch):
    monkeypatch.delattr(os, "fork")
    order = []
    pieces = [lambda k=k: order.append(k) or k for k in range(4)]
    assert fanout.run(pieces[:2], spare=pieces[2:]) == [0, 1, 2, 3] and order == [0, 1, 2, 3]


def test_interrupted_while_a_child_runs_the_child_is_ended_at_once():
    in_a_fresh_process("""
        import os, signal, time
        from actoffload.budget import fanout
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        started = time.monotonic()
        try:
            fanout.run([lambda: 0, lambda: time.sleep(30)])
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("not interrupted")
        assert time.monotonic() - started < 10, "the child was waited for"
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        else:
            raise AssertionError("a child was left behind")
    """)


def test_the_planning_process_searches_side_by_side_where_it_has_the_cores():
    in_a_fresh_process(WATCH_FORKS, """
        import os, pickle, sys
        os.sched_getaffinity = lambda pid: set(range(8))  # as on a GPU machine's host
        sys.path[:0] = ["tests"]
        from actoffload.budget import search, worker
        from test_budget_search import PROFILES
        fanout.run = watched
        requests_in, requests_out = os.pipe()
        answers_in, answers_out = os.pipe()
        with os.fdopen(requests_out, "wb") as out:
            pickle.dump((7, PROFILES[3], None, ()), out)
        with os.fdopen(requests_in, "rb") as requests:
            worker.serve(requests, answers_out)
        data = b""
        while chunk := os.read(answers_in, 1 << 20):
            data += chunk
        ticket, plans, seconds = pickle.loads(data[worker._HEADER.size:])
        fanout.run = run
        alone = search.candidates(PROFILES[3])
        assert ticket == 7 and [(p.key, p.peak, p.step_s) for p in plans] == [(p.key, p.peak, p.step_s) for p in alone]
        assert len(forked - {os.getpid()}) == worker.search_processes() - 1 == 2, forked
    """)
