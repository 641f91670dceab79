"""Planning off the critical path: the helper process answers the search as the controller
would have made it, the controller runs a quick search's plans meanwhile and then chooses
among the answer's as after its own search, and a helper that fails leaves the controller
planning by itself (CPU; the probe is test_budget_controller's fake, made asynchronous like
CUDA)."""

import pickle
from dataclasses import replace
import subprocess
import sys
import time

import pytest

from actoffload.budget import controller as controller_module
from actoffload.budget import costmodel
from actoffload.budget import search
from actoffload.budget import worker as planning
from actoffload.budget.actions import Action
from actoffload.budget.controller import BudgetController, BudgetTooSmall, State
from actoffload.budget.reserve import AllocatorReserve
from actoffload.budget.tolerances import least_margin
from test_budget_controller import (BASE, CPU, TIMINGS, MiB, FakeProbe, _big_profile, _grow_shared_reserve, _profile,
                                    _run)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the planning process waits on its pipe with select")


def _keys(plans):
    return [(p.key, p.peak, p.step_s) for p in plans]


@pytest.fixture(scope="module")
def worker():
    w = planning.PlanWorker()
    yield w
    w.close()


def _served_by(monkeypatch, worker, asynchronous: bool = True) -> FakeProbe:
    """A probe of a device the host runs ahead of (``asynchronous``: as a GPU's), whose
    controllers get ``worker`` as their planning process (none where not ``asynchronous``)."""
    monkeypatch.setattr(controller_module, "_worker_for",
                        lambda probe: worker if getattr(probe, "asynchronous", False) else None)
    probe = FakeProbe()
    probe.asynchronous = asynchronous
    return probe


def test_the_planning_process_answers_what_the_search_makes_here(worker):
    profile = _profile()
    tickets = [worker.submit(profile), worker.submit(profile, [(1, 1)])]
    answers = [worker.result(t, wait=True) for t in reversed(tickets)]  # any order
    assert _keys(answers[1][0]) == _keys(search.candidates(profile))
    assert _keys(answers[0][0]) == _keys(search.candidates(profile, [(1, 1)]))
    assert all(seconds >= 0 for _, seconds in answers)
    from test_budget_search import PROFILES  # one whose fastest plan near the least memory is improved
    limit = sorted({p.peak for p in search.candidates(PROFILES[24])})[2]
    plans, _ = worker.result(worker.submit(PROFILES[24], None, [limit]), wait=True)
    assert _keys(plans) == _keys(search.candidates(PROFILES[24], limits=[limit])) != _keys(search.candidates(PROFILES[24]))


def test_answers_arriving_together_are_each_found_by_looking(worker):
    """Several answers in the pipe at once: each is found by a look that does not wait (none
    is held back where the next look would not see it)."""
    windows = [[(0, 0)], [(1, 1)], [(2, 2)], None]
    tickets = [worker.submit(_profile(), w) for w in windows]
    time.sleep(1.0)  # all answered by now, most likely in one read's reach
    got = {}
    deadline = time.monotonic() + 60
    while len(got) < len(tickets) and time.monotonic() < deadline:
        for t in tickets[::-1]:
            if t not in got:
                answer = worker.result(t)
                if answer is not None:
                    got[t] = answer[0]
    assert [_keys(got[t]) for t in tickets] == [_keys(search.candidates(_profile(), w)) for w in windows]


def test_the_planning_process_does_not_import_torch():
    """It imports the budget's pure-Python modules only: it starts in a fraction of a second
    and holds little memory, beside a training process."""
    import os

    check = planning._BOOT.replace("worker.serve(sys.stdin.buffer, int(sys.argv[1]))",
                                   "print('torch' in sys.modules, 'numpy' in sys.modules)")
    package = os.path.dirname(os.path.dirname(os.path.abspath(planning.__file__)))
    out = subprocess.run([sys.executable, "-I", "-c", check, "0"], input=pickle.dumps((sys.path, "actoffload", package)),
                         capture_output=True, check=True, timeout=60)
    assert out.stdout.split() == [b"False", b"True"]


def test_asking_never_waits_for_the_process_whatever_the_answers_size(worker):
    """Answers far larger than a pipe holds, none read while more are asked for: the asking
    returns at once (the requests and answers move on threads of their own), and every answer
    comes whole."""
    import threading

    profile = _big_profile(96)
    tickets = []
    asking = threading.Thread(target=lambda: tickets.extend(worker.submit(profile, [(w, 1)]) for w in (0, 1, 2, 0)))
    asking.start()
    asking.join(timeout=30)
    assert not asking.is_alive() and len(tickets) == 4
    answers = [worker.result(t, wait=True)[0] for t in tickets]
    assert _keys(answers[1]) == _keys(search.candidates(profile, [(1, 1)])) and _keys(answers[0]) == _keys(answers[3])


def test_a_dropped_controller_lets_go_of_its_answer_and_a_dead_process_fails_every_request(monkeypatch):
    import gc

    w = planning.PlanWorker()
    try:
        probe = _served_by(monkeypatch, w)
        c = BudgetController(1 << 40, CPU, probe=probe)
        c.adopt_profile(_big_profile(24), None)
        ticket = c._pending[0]
        del c
        gc.collect()
        assert w.result(w.submit(_profile()), wait=True) is not None  # answered after the dropped one
        assert ticket not in w._outstanding and ticket not in w._answers and not w._forgotten
        waiting = w.submit(_big_profile(96))
        w._proc.kill()
        with pytest.raises(planning.WorkerFailed, match="cannot answer"):
            w.result(waiting, wait=True)
        with pytest.raises(planning.WorkerFailed):
            w.submit(_profile())
    finally:
        w.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_process_forked_from_the_trainer_does_not_keep_the_planning_process_alive():
    """A child forked after the helper started (a data loader's worker) lets go of the pipes:
    the helper still ends as soon as the trainer closes it, not when the child ends."""
    import os

    w = planning.PlanWorker()
    planning_shared, planning._shared = planning._shared, w
    try:
        pid = os.fork()
        if pid == 0:  # the child: alive longer than the parent waits
            time.sleep(5)
            os._exit(0)
        started = time.monotonic()
        w.close(wait_s=4.0)
        assert w._proc.returncode == 0 and time.monotonic() - started < 3.0  # ended, not killed
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    finally:
        planning._shared = planning_shared


def test_a_search_that_raises_in_the_process_raises_where_it_is_collected(worker):
    ticket = worker.submit("not a profile")  # type: ignore[arg-type]
    with pytest.raises(planning.WorkerFailed, match="search raised"):
        worker.result(ticket, wait=True)
    assert worker.result(worker.submit(_profile()), wait=True) is not None  # it serves on


class _Worker:
    """A planning process the test answers: each request is searched here, and its answer
    comes at the ``after``-th look."""

    def __init__(self, after: int = 2, fail: bool = False):
        self.after, self.fail = after, fail
        self.asked: dict[int, tuple] = {}
        self.limits: dict[int, tuple] = {}
        self.looks = 0

    def submit(self, profile, windows=None, limits=()):
        ticket = len(self.asked) + 1
        self.asked[ticket] = (profile, windows)
        self.limits[ticket] = limits
        return ticket

    def result(self, ticket, wait=False):
        self.looks += 1
        if self.fail:
            raise planning.WorkerFailed("the test's worker failed")
        if not wait and self.looks < self.after:
            return None
        return search.candidates(*self.asked[ticket], limits=self.limits[ticket]), 0.5

    def forget(self, ticket):
        pass


def _asynchronous(worker, monkeypatch, budget=1 << 40):
    probe = _served_by(monkeypatch, worker)
    c = BudgetController(budget, CPU, probe=probe)
    c.adopt_profile(_profile(), BASE + 100 * MiB)
    return c


def _synchronous(budget=1 << 40):
    c = BudgetController(budget, CPU, probe=FakeProbe())
    c.adopt_profile(_profile(), BASE + 100 * MiB)
    return c


def test_the_controller_runs_a_quick_searchs_plan_until_the_whole_search_answers(monkeypatch):
    w = _Worker(after=6)
    c = _asynchronous(w, monkeypatch)
    sync = _synchronous()
    quick = search.quick_candidates(_profile())
    assert _keys(c.plans[:-1]) == _keys(quick) and c.plans[-1].key == sync.plans[-1].key  # the profiled plan last
    assert c.plan.key == sync.plan.key  # keeping everything fits: the quick search has it too
    assert c.stats()["planning_in_background"] and not c.settled
    _run(c, 5, lambda p: p.step_s)
    # measured by now, but not final: the whole search's plans are still to come
    assert not c.settled and c.stats()["state"] == "exploring" and c.stats()["planning_in_background"]
    _run(c, 1, lambda p: p.step_s)  # answered at the sixth look
    assert not c.stats()["planning_in_background"] and c.background_planning_s == 0.5
    assert _keys(c.plans) == _keys(sync.plans)
    _run(c, 8, lambda p: p.step_s)
    _run(sync, 8, lambda p: p.step_s)
    assert c.settled and sync.settled and c.plan.key == sync.plan.key


@pytest.mark.parametrize("after", [1, 100])
def test_a_profile_made_as_another_workloads_step_begins_chooses_as_its_own_next_step_begins(monkeypatch, after):
    """Profiling ends as the next step begins, of whatever workload: this workload's quick search
    waits for its own next step, and where the planning process has answered by then, none runs
    (on an H200 the loop sweep's decoder, profiled at full length, spent 25 ms of the 512-token
    step that began next on quick plans the answer replaced before any ran)."""
    w = _Worker(after=after)
    probe = _served_by(monkeypatch, w)
    c = BudgetController(1 << 40, CPU, probe=probe)
    c._adopt_measured(_profile(), BASE + 100 * MiB, defer=True)
    assert c.plan is None and c._pending is not None and "quick search" not in c.planning_by
    c.step_begins()
    sync = _synchronous()
    if after == 1:  # answered by the time it looks
        assert "quick search" not in c.planning_by and _keys(c.plans) == _keys(sync.plans)
    else:
        assert c.planning_by["quick search"] > 0 and c._pending is not None
        assert _keys(c.plans[:-1]) == _keys(search.quick_candidates(_profile()))
    assert c.plan.key == sync.plan.key


def test_a_budget_the_known_plans_miss_waits_for_the_search_to_say_it_is_too_small(monkeypatch):
    """Only the search knows whether any plan fits: where the plans that ran do not, the
    controller waits for its answer, and raises BudgetTooSmall as it would have, naming the
    same smallest peak."""
    too_small = min(p.peak for p in _synchronous().plans) - 64 * MiB
    with pytest.raises(BudgetTooSmall) as sync:
        _synchronous(too_small)
    w = _Worker(after=100)
    with pytest.raises(BudgetTooSmall) as waited:
        _asynchronous(w, monkeypatch, budget=too_small)
    assert w.looks == 1 and str(waited.value) == str(sync.value)


@pytest.mark.parametrize("after", [1, 100])
def test_a_reserve_grown_past_every_plan_while_the_search_answers_raises_then_runs_the_least_memory(monkeypatch, after):
    """The plan chosen from the quick search's plans (keeping everything) no longer fits once
    another workload's step grew the shared reserve past every plan; the whole search answers as
    the next step begins (``after=1``: found there; else waited for). The step raises
    BudgetTooSmall, and the step begun again runs the least memory, not the plan that no longer
    fits (raised as the answer was taken, the error had left it running: on an H200 the loop
    decoder's first full-length plan then reserved 10 MiB over its budget)."""
    w = _Worker(after=after)
    probe, reserve = FakeProbe(), AllocatorReserve()
    probe.asynchronous = True
    monkeypatch.setattr(controller_module, "_worker_for", lambda p: w)
    keep_all = next(p for p in _synchronous().plans if all(g.action.value == "keep" for g in p.groups))
    c = BudgetController(keep_all.peak + least_margin(keep_all.peak) + 30 * MiB, CPU, probe=probe, reserve=reserve)
    c.adopt_profile(_profile())
    assert c.plan.key == keep_all.key and c.stats()["planning_in_background"]
    least = min(p.peak for p in c.plans)
    _grow_shared_reserve(probe, reserve, c.budget, c.budget - least + 10 * MiB, keep_all.peak)
    with pytest.raises(BudgetTooSmall):
        c.step_begins()
    assert c.plan.peak == min(p.peak for p in c.plans)  # chosen before the raise
    c.step_begins()  # the engine begins the step again at its next group
    assert c.plan.peak == min(p.peak for p in c.plans) and c.too_small is not None


def test_a_failed_planning_process_leaves_the_controller_planning_by_itself(monkeypatch):
    failed = []
    monkeypatch.setattr(planning, "failed", lambda worker, error: failed.append(error))
    w = _Worker(fail=True)
    c = _asynchronous(w, monkeypatch)
    _run(c, 1, lambda p: p.step_s)
    sync = _synchronous()
    assert len(failed) == 1 and c._worker is None
    assert _keys(c.plans) == _keys(sync.plans) and c.state is State.EXPLORING


def test_the_quick_searchs_plans_are_tried_as_the_whole_searchs_would_be(monkeypatch):
    """Where the model's first choice runs slower than promised, the controller tries one plan
    more (EXPLORE): with the whole search's answer late, the quick search's plans that ran
    meanwhile take none of those tries, and the same plan settles."""
    least, keep = min(_synchronous().plans, key=lambda p: p.peak), max(_synchronous().plans, key=lambda p: p.peak)
    budget = least.peak + (keep.peak - least.peak) // 2
    sync = _synchronous(budget)
    first = sync.plan.key
    slow_first = lambda p: p.step_s * (2.0 if p.key == first else 1.0)  # noqa: E731
    _run(sync, 14, slow_first)
    c = _asynchronous(_Worker(after=3), monkeypatch, budget=budget)
    _run(c, 14, slow_first)
    tried = [m.plan.key for m in sync.measured_plans()]
    assert len(tried) == 2 and sync.settled and c.settled
    assert set(tried) <= {m.plan.key for m in c.measured_plans()} and c.plan.key == sync.plan.key


def test_a_predicted_workload_runs_the_quick_plans_and_asks_for_its_sources_window(monkeypatch):
    """A workload never seen, predicted from another: its first step cannot wait for a search,
    so it plans quickly under the window its source settled on, and the planning process adds
    the rest of that window's search (the hand-written families)."""
    w = _Worker(after=2)
    probe = _served_by(monkeypatch, w)
    c = BudgetController(_under_keeping_everything(), CPU, probe=probe)
    assert c.adopt_prediction(_profile(), (2, 1))
    assert _keys(c.plans[:-1]) == _keys(search.quick_candidates(_profile(), (2, 1)))
    assert list(w.asked.values()) == [(c.profile, [(2, 1)])]
    _run(c, 2, lambda p: p.step_s)
    assert _keys(c.plans[:-1]) == _keys(search.candidates(_profile(), [(2, 1)]))


def test_a_planning_process_that_cannot_start_leaves_planning_in_the_training_process(monkeypatch, tmp_path):
    monkeypatch.setattr(planning, "_shared", None)
    monkeypatch.setattr(planning, "_failed", False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    with pytest.warns(RuntimeWarning, match="planning runs in the training process"):
        assert planning.shared() is None
    assert planning.shared() is None  # not tried again
    probe = FakeProbe()
    probe.asynchronous = True
    c = BudgetController(1 << 40, CPU, probe=probe)
    c.adopt_profile(_profile(), BASE + 100 * MiB)
    assert _keys(c.plans) == _keys(_synchronous().plans) and not c.stats()["planning_in_background"]


def test_answers_to_a_calibrations_requests_grant_no_more_tries(monkeypatch):
    """Each calibration asks the planning process again: its answer replaces the candidates,
    and tries no more plans than a controller searching by itself; it settles as soon, or, where
    the calibration's answer is the last thing to wait for, the one step later that it comes."""
    from actoffload.budget.costmodel import moves_bytes

    profile = _big_profile(8)
    plans = search.candidates(profile)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    budget = least + (most - least) // 2
    seconds = lambda p: p.step_s * (1.6 if moves_bytes(profile, p.groups) else 0.9)  # noqa: E731
    runs = []
    for asynchronous in (False, True):
        probe = _served_by(monkeypatch, _Worker(after=1), asynchronous=asynchronous)
        c = BudgetController(budget, CPU, probe=probe)
        c.adopt_profile(profile, None)
        settled_at = None
        for step in range(1, 41):
            _run(c, 1, seconds)
            settled_at = settled_at or (step if c.settled else None)
        runs.append((len(c.measured_plans()), settled_at, c._calibrated))
    (tried, settled, calibrated), (tried_async, settled_async, calibrated_async) = runs
    assert (tried, calibrated) == (tried_async, calibrated_async) and calibrated > 0  # its requests were asked again
    assert settled <= settled_async <= settled + 1  # the answer comes a step after its request


def test_a_predicted_workload_is_refused_only_where_the_whole_search_fits_nothing(monkeypatch):
    """The quick search lacks the lowest plans: whether a prediction fits is the whole
    search's to say, as without the planning process."""
    from actoffload.budget.tolerances import least_margin

    w = _Worker(after=2)
    monkeypatch.setattr(controller_module, "_worker_for",
                        lambda probe: w if getattr(probe, "asynchronous", False) else None)
    for window in (None, (2, 1)):
        least = min(p.peak for p in search.candidates(_profile(), None if window is None else [window]))
        assert least < min(p.peak for p in search.quick_candidates(_profile(), window))
        for budget in (least + 2 * MiB, least - 2 * MiB):
            while budget > least and least + least_margin(budget) > budget:
                budget += MiB
            answers = []
            for asynchronous in (False, True):
                probe = FakeProbe()
                probe.asynchronous = asynchronous
                answers.append(BudgetController(budget, CPU, probe=probe).adopt_prediction(_profile(), window))
            assert answers[0] == answers[1] == (budget > least), (window, budget)


def _under_keeping_everything() -> int:
    """A budget that keeping everything does not fit (so a prediction searches), bytes."""
    return search.keeping_everything(_profile()).peak


def test_a_predicted_workload_that_keeps_everything_searches_only_once_that_no_longer_fits(monkeypatch):
    """Keeping everything is the fastest plan there is: where a prediction's fits, it runs with
    no search made and nothing asked of the planning process; once the allocator's reserve grows
    past what it leaves, the search is made (its quick part here, the whole asked), and a plan
    within the budget chosen."""
    from actoffload.budget.buckets import SharedPredictions

    w = _Worker(after=99)
    probe = _served_by(monkeypatch, w)
    profile, shared, reserve = _profile(), SharedPredictions(), AllocatorReserve()
    keeping = search.keeping_everything(profile)
    budget = keeping.peak + least_margin(keeping.peak) + 64 * MiB
    c = BudgetController(budget, CPU, probe=probe, reserve=reserve)
    assert c.adopt_prediction(profile, (1, 1), shared=shared)
    assert c.plan.key == keeping.key and all(g.action is Action.KEEP for g in c.plan.groups)
    assert shared.searched == 0 and not w.asked and "prediction's search" not in c.planning_by
    probe.peak_bytes = keeping.peak  # it ran as modelled
    _run(c, 1, lambda p: p.step_s)
    assert c.plan.key == keeping.key and shared.searched == 0
    reserve.bytes += 128 * MiB  # another workload's step measured more of the allocator's share
    _run(c, 1, lambda p: p.step_s)
    assert shared.searched == 1 and len(w.asked) == 1 and "prediction's search" in c.planning_by
    assert c.plan.key != keeping.key and c.plan.peak + reserve.bytes <= budget
    assert _keys(c.plans[:-1]) == _keys(search.quick_candidates(profile, (1, 1)))


def test_a_prediction_keeping_everything_that_goes_over_searches_what_fits_after_the_overshoot(monkeypatch):
    """Keeping everything ran over the budget (the model was short): the search made then judges
    the quick plans as every candidate is judged, by the margin the overshoot raised and the
    measured peak. Where none of them fits so, the whole search is made in the step, and the plan
    chosen is the one a search made as the prediction was adopted chooses (the two-group random
    profile below, whose quick search finds keeping everything alone: judged by the model alone,
    it passed for fitting, and the profiled plan ran for good)."""
    import random

    from test_budget_search import _profile as random_profile

    profile = random_profile(random.Random(46))
    keeping = search.keeping_everything(profile)
    budget = keeping.peak + least_margin(keeping.peak) + MiB
    budget += least_margin(budget)
    over = 47 * MiB

    def run(keep_all_fits: bool) -> list:
        w = _Worker(after=2)
        monkeypatch.setattr(controller_module, "_worker_for", lambda probe: w)
        if not keep_all_fits:  # as before the shortcut: the search made as the prediction is adopted
            monkeypatch.setattr(search, "keeping_everything", lambda p: replace(keeping, peak=1 << 62))
        probe = FakeProbe(allocated=profile.base)
        probe.asynchronous, probe.host_count = True, 0
        c = BudgetController(budget, CPU, probe=probe)
        assert c.adopt_prediction(profile, (1, 1))
        ran = []
        for _ in range(8):
            c.step_begins()
            ran.append(c.plan.key)
            probe.peak_bytes = c.plan.peak + (over if c.plan.key == keeping.key else 0)
            probe.advance(c.plan.step_s)
            c.backward_ends()
        monkeypatch.undo()
        return ran

    shortcut, searched_first = run(True), run(False)
    assert shortcut[0] == keeping.key and shortcut[1:] == searched_first[1:]
    assert shortcut[-1][0] != costmodel.profiled_plan(profile)


def test_a_predicted_workload_whose_request_is_refused_plans_by_the_whole_search(monkeypatch):
    class Refusing(_Worker):
        def submit(self, profile, windows=None, limits=()):
            raise planning.WorkerFailed("the test's worker refuses")

    monkeypatch.setattr(planning, "failed", lambda worker, error: None)
    probe = _served_by(monkeypatch, Refusing())
    budget = _under_keeping_everything()
    c = BudgetController(budget, CPU, probe=probe)
    assert c.adopt_prediction(_profile(), (2, 1))
    assert _keys(c.plans[:-1]) == _keys(search.candidates(_profile(), [(2, 1)], limits=c._limits())) and c._worker is None


def test_a_request_forgotten_before_it_is_sent_is_not_searched():
    """A calibration or a new profile replaces a request: where it was not sent yet, the helper
    never searches it, and the requests that are wanted do not wait behind it."""
    w = planning.PlanWorker()
    try:
        with w._cond:  # the writer waits for this lock before it sends each request
            tickets = [w.submit(_big_profile(48)) for _ in range(4)] + [w.submit(_profile())]
            for t in tickets[:-1]:
                w.forget(t)
        assert w.result(tickets[-1], wait=True) is not None
        assert w.answered == 1 and not w._outstanding and not w._forgotten
    finally:
        w.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_fork_after_the_process_died_touches_no_file_of_the_trainers():
    """The pipes' descriptors are forgotten as they are closed: a number the trainer's next
    file gets is not redirected in a forked child, and the fork's hook does not raise."""
    import os

    w = planning.PlanWorker()
    planning_shared, planning._shared = planning._shared, w
    try:
        w._proc.kill()
        w.close(wait_s=0.0)  # as planning.failed does
        with pytest.raises(planning.WorkerFailed):
            w.submit(_profile())
        deadline = time.monotonic() + 30
        while (w._answers_fd >= 0 or w._requests_fd >= 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w._answers_fd == -1 and w._requests_fd == -1
        read, write = os.pipe()
        os.write(write, b"the trainer's bytes")
        pid = os.fork()
        if pid == 0:
            os._exit(0 if os.read(read, 64) == b"the trainer's bytes" and planning._shared is None else 1)
        assert os.waitpid(pid, 0)[1] == 0
        os.close(read)
        os.close(write)
    finally:
        planning._shared = planning_shared
        w.close()


class _Late:
    """A planning process whose answer to each request comes at its ``delay``+1-th look."""

    def __init__(self, delay):
        self.delay, self.asked, self.looks = delay, {}, {}

    def submit(self, profile, windows=None, limits=()):
        ticket = len(self.asked) + 1
        self.asked[ticket], self.looks[ticket] = (profile, windows, limits), 0
        return ticket

    def result(self, ticket, wait=False):
        self.looks[ticket] += 1
        if not wait and self.looks[ticket] <= self.delay:
            return None
        profile, windows, limits = self.asked[ticket]
        return search.candidates(profile, windows, limits=limits), 0.1

    def forget(self, ticket):
        pass


def test_an_answer_later_than_the_quick_plans_calibration_still_settles_on_the_synchronous_plan(monkeypatch):
    """The quick plan is measured and calibrates the model before the whole search answers:
    the calibration's request replaces the first one, and answers for the quick plans' tries
    as the first would have. Late or not, the plan settled on is the one a controller searching
    by itself settles on."""
    from actoffload.budget.costmodel import moves_bytes

    profile = _big_profile(8)
    plans = search.candidates(profile)
    budget = min(p.peak for p in plans) + (max(p.peak for p in plans) - min(p.peak for p in plans)) // 2
    seconds = lambda p: p.step_s * (1.6 if moves_bytes(profile, p.groups) else 0.9)  # noqa: E731
    settled = []
    for delay in (None, 4, 8):
        late = None if delay is None else _Late(delay)
        probe = _served_by(monkeypatch, late, asynchronous=late is not None)
        c = BudgetController(budget, CPU, probe=probe)
        c.adopt_profile(profile, None)
        _run(c, 60, seconds)
        assert c.settled, delay
        settled.append(c.plan.key)
    assert settled[1] == settled[0] and settled[2] == settled[0]


def test_a_quick_plan_that_is_the_whole_searchs_first_choice_counts_as_its_try(monkeypatch):
    """Where the quick search chose what the whole search chooses first, that plan's steps are
    its first choice's: one more plan may be tried after it, as without the planning process."""
    profile = _big_profile(8)
    plans = search.candidates(profile)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    budget = least + int((most - least) * 0.8)
    tried = []
    for asynchronous in (False, True):
        w = _Worker(after=2)
        probe = _served_by(monkeypatch, w, asynchronous=asynchronous)
        c = BudgetController(budget, CPU, probe=probe)
        c.adopt_profile(profile, None)
        first = c.plan.key
        _run(c, 30, lambda p, first=first: p.step_s * (2.0 if p.key == first else 1.0))
        tried.append(([m.plan.key for m in c.measured_plans()], first, c.settled))
    (sync, sync_first, sync_settled), (late, quick_first, late_settled) = tried
    assert quick_first == sync_first and sync_settled and late_settled
    assert late == sync and len(sync) == 2


def test_a_plan_measured_while_the_whole_search_is_still_to_answer_corrects_the_model(monkeypatch):
    """The quick search's plans run while the planning process searches. Where every plan that
    may run has run, a measurement corrects the model only while that answer is still to come:
    it may let more plans run (the quick ones that ran are no tries of the whole search's
    model), and those are chosen by the corrected model."""
    from actoffload.budget.costmodel import moves_bytes, simulate

    profile = _big_profile(8)
    plans = search.candidates(profile)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    budget = int(least + (most - least) * 0.7)

    def true_s(p):  # the bus faster than modelled, recomputation slower
        modelled = simulate(profile, p.groups, p.max_inflight, p.prefetch)[1]
        return modelled * (0.7 if moves_bytes(profile, p.groups) else 1.2)

    w = _Worker(after=30)
    probe = _served_by(monkeypatch, w)
    c = BudgetController(budget, CPU, probe=probe)
    c.adopt_profile(profile, None)
    _run(c, 80, true_s)
    assert c.settled and c._calibrated >= 1
    assert min(true_s(m.plan) for m in c.measured_plans()) == true_s(c.plan)


def _predicted_controllers(monkeypatch, profiles: int, budgets: int, after: int):
    """For the first ``profiles`` of the search's test profiles, at about ``budgets`` of their
    candidates' peaks: ``(profile, controller)``, the controller having adopted the profile as a
    prediction (under window (1, 1)) where one fits, its planning process answering at the
    ``after``-th look."""
    from test_budget_search import PROFILES
    from actoffload.budget.tolerances import least_margin

    for profile in PROFILES[:profiles]:
        peaks = sorted({p.peak for p in search.candidates(profile)})
        for peak in peaks[1::max(1, len(peaks) // budgets)]:
            w = _Worker(after=after)
            monkeypatch.setattr(controller_module, "_worker_for", lambda probe: w)
            probe = FakeProbe(allocated=profile.base)
            probe.asynchronous = True
            c = BudgetController(peak + least_margin(peak) + 1, CPU, probe=probe)
            if c.adopt_prediction(profile, (1, 1)):
                yield profile, c


def _steps_until_answered(c: BudgetController, steps: int, pace) -> tuple[list, int | None]:
    """Run ``steps`` steps, each ``pace(plan)`` times its plan's modelled time: the plans they ran,
    and the first step that began with the planning process's answer taken (``None``: none did)."""
    ran, answered = [], None
    for step in range(steps):
        c.step_begins()
        if answered is None and c._pending is None:
            answered = step
        ran.append(c.plan.key)
        c.probe.advance(c.plan.step_s * pace(c.plan))
        c.backward_ends()
    return ran, answered


def test_a_predicted_profile_runs_the_whole_searchs_first_choice_when_it_answers(monkeypatch):
    """A predicted profile's quick plan runs until the planning process answers; where the whole
    search's first choice is another plan, that plan runs then (the quick one is not held until
    it is timed)."""
    differing = 0
    for _, c in _predicted_controllers(monkeypatch, 12, 4, after=2):
        quick, whole = c.plan.key, None
        for _ in range(6 * TIMINGS):
            c.step_begins()
            if whole is None and c._pending is None:
                whole = c._first_choice(c._fitting()).key
            c.probe.advance(c.plan.step_s)
            c.backward_ends()
        if whole is not None and whole != quick:
            differing += 1
            assert whole in {m.plan.key for m in c.measured_plans()}
    assert differing > 5


def test_a_predicted_profile_runs_the_whole_searchs_plan_moving_none_before_its_first_choice(monkeypatch):
    """A predicted profile runs its quick search's plans until the planning process answers;
    then, where the whole search's first choice moves bytes, the whole search's fastest plan
    moving none first (a quick plan is no try of the whole search's model), and the first choice
    only where the model rates it faster than that plan ran, and no other. Here the bus runs
    three times slower than modelled: every such profile settles on a plan moving nothing."""
    from actoffload.budget.costmodel import moves_bytes

    cases = quick_was_first = 0
    for profile, c in _predicted_controllers(monkeypatch, 16, 6, after=2):
        # the bus slower than modelled
        ran, answered = _steps_until_answered(c, 8 * TIMINGS, lambda p: 3.0 if moves_bytes(profile, p.groups) else 1.0)
        fitting = c._fitting()
        first = c._first_choice(fitting)
        still = c._still_to_try(fitting, first, None)
        if answered is None or still is None:
            continue  # not the case: the first choice moves nothing, or no plan moving nothing fits
        cases += 1
        after = list(dict.fromkeys(ran[answered:]))
        assert after[0] == still.key, after  # (also where the quick plan was the first choice)
        assert set(after) <= set(ran[:answered]) | {still.key, first.key}
        quick_was_first += first.key in ran[:answered]
        assert still.key in {m.plan.key for m in c.measured_plans()}
        assert not moves_bytes(profile, c.plan.groups) and c.settled
    assert cases >= 3 and quick_was_first >= 1


def test_a_predicted_profile_runs_no_plan_but_its_quick_plans_its_plan_moving_none_and_its_first_choice(monkeypatch):
    """Whatever the quick plans were, once the planning process answered a predicted profile runs
    no plan but those, the whole search's first choice and, where that moves bytes, its plan
    moving nothing: here the recomputation runs slower than modelled, so a first choice moving
    bytes is tried after the plan moving nothing (a quick plan that the whole search opens with
    stays held until timed, else a third plan would be tried)."""
    from actoffload.budget.costmodel import moves_bytes

    cases = 0
    for profile, c in _predicted_controllers(monkeypatch, 16, 6, after=2):
        ran, answered = _steps_until_answered(c, 10 * TIMINGS, lambda p: 1.0 if moves_bytes(profile, p.groups) else 1.3)
        if answered is None:
            continue
        fitting = c._fitting()
        first = c._first_choice(fitting)
        still = c._still_to_try(fitting, first, None)
        cases += 1
        assert set(ran[answered:]) <= set(ran[:answered]) | {first.key} | ({still.key} if still else set())
    assert cases >= 5


def test_a_predicted_profile_whose_quick_plan_was_timed_before_the_answer_still_runs_its_first_choice(monkeypatch):
    """The planning process answered late: the predicted profile's quick plan (moving bytes)
    was timed already, so the plan moving nothing ran next; the whole search's first choice,
    rated faster than both as they ran, runs then too (else the workload settled on the quick
    plan, its first choice never tried), and no other plan does."""
    from actoffload.budget.costmodel import moves_bytes

    cases = 0
    for profile, c in _predicted_controllers(monkeypatch, 16, 6, after=8):
        quick, first, ran = c.plan.key, None, []
        for _ in range(10 * TIMINGS):
            c.step_begins()
            if first is None and c._pending is None:
                first = c._first_choice(c._fitting()).key
            ran.append(c.plan.key)
            slow = 1.0 if moves_bytes(profile, c.plan.groups) else 1.3  # the recomputation slower than modelled
            c.probe.advance(c.plan.step_s * slow)
            c.backward_ends()
        tried = list(dict.fromkeys(ran))
        if first is None or first == quick or not moves_bytes(profile, quick[0]):
            continue
        if len(tried) < 2 or moves_bytes(profile, tried[1][0]):
            continue  # not the case: the plan moving nothing did not run second
        cases += 1
        assert first in tried and len(tried) == 3, (tried, first)
    assert cases >= 3


@pytest.mark.parametrize("cores,processes", [(1, 1), (2, 1), (3, 2), (4, 3), (64, 3)])
def test_the_planning_process_searches_in_its_cores_less_one_at_most_one_per_max_inflight(monkeypatch, cores,
                                                                                         processes):
    monkeypatch.setattr(planning.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert planning.search_processes() == processes


def test_signatures_of_one_bucket_share_the_quick_search_whatever_the_reserve_and_each_asks_for_its_whole_one(
        monkeypatch):
    """Where the planning process serves, a predicted profile's quick search is made once for
    every controller handed that profile (a length bucket's, :mod:`~actoffload.budget.buckets`),
    also after the shared reserve grew (the quick search takes no limits); each controller asks
    the process for the whole search of its own. Where the quick plans no longer fit, the
    whole search is made here, once per limits."""
    from actoffload.budget.buckets import SharedPredictions

    w = _Worker(after=99)
    probe = _served_by(monkeypatch, w)
    reserve, shared, profile = AllocatorReserve(), SharedPredictions(), _profile()
    budget = _under_keeping_everything() - 64 * MiB  # (the quick plans fit it with the reserve grown)

    def predicted():
        c = BudgetController(budget, CPU, probe=probe, reserve=reserve)
        assert c.adopt_prediction(profile, shared=shared)
        return c

    first = predicted()
    then = first._limits()
    reserve.bytes += 64 * MiB  # another workload's step measured more of the allocator's share
    second = predicted()
    assert second._limits() != then
    assert shared.searched == 1 and len(w.asked) == 2
    assert _keys(first.plans) == _keys(second.plans)
    assert "prediction's search" in first.planning_by and "prediction's search" not in second.planning_by
    # a budget the quick plans do not fit (but the whole search's least memory): the quick
    # search found as kept, the whole one made once for both controllers (the same limits)
    tight = min(p.peak for p in search.candidates(profile)) + least_margin(1 << 30) + 1
    assert min(p.peak for p in search.quick_candidates(profile)) + least_margin(tight) > tight
    for _ in range(2):
        c = BudgetController(tight, CPU, probe=probe, reserve=AllocatorReserve())
        assert c.adopt_prediction(profile, shared=shared)
    assert shared.searched == 2 and len(w.asked) == 2  # the whole search's plans: nothing to ask
