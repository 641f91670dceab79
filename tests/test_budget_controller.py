"""The budget controller's judgement: measured peaks beat the model, and a base that grows
(optimizer state made after the first step) moves every plan (CPU; the probe is faked)."""

from dataclasses import replace

import pytest
import torch

from actoffload.budget.controller import TIMINGS, BudgetController, _key, _merged
from actoffload.budget.planner import GroupPlan, GroupProfile, Plan, Profile, candidates, choose, simulate

MiB = 1 << 20


def _controller(budget: int, measured_least: int | None = None) -> tuple[BudgetController, Plan]:
    """A controller planned over four equal groups; ``measured_least``: the profiling step's
    measured peak above the base (the least-memory plan ran)."""
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3,
                     forward_extra=16 * MiB, backward_extra=16 * MiB)
    profile = Profile((g,) * 4, base=100 * MiB, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9, outside_extra=8 * MiB)
    c = BudgetController(budget, torch.device("cpu"))
    c.profile, c.plans, c._reprofile = profile, candidates(profile), False  # as if profiled
    least_groups = (GroupPlan("recompute_offload"),) * 4
    least = Plan(least_groups, 0, 0, *simulate(profile, least_groups, 0, 0))
    c.plans.append(least)
    if measured_least is not None:
        c._measured[_key(least)] = measured_least
    c._choose()
    return c, least


def test_controller_a_plan_that_ran_is_judged_by_its_measured_peak():
    _, least = _controller(1 << 40)
    below_every_model = least.peak - 4 * MiB  # the model was pessimistic; the step measured less
    c, _ = _controller(below_every_model, measured_least=below_every_model - 100 * MiB)
    assert _key(c.plan) == _key(least)


def test_controller_overshoot_raises_the_margin_but_spares_plans_measured_within_the_budget():
    c, least = _controller(1 << 40, measured_least=0)
    keep = max(c.plans, key=lambda p: p.peak)
    c.budget = keep.peak + MiB  # the least margin: what the model never sees
    c._choose()
    assert _key(c.plan) == _key(keep)
    c.margin = 1 << 40  # every model figure out of reach
    c._choose()
    assert _key(c.plan) == _key(least)  # measured: still fits


class _Allocated:
    """A probe whose allocated bytes the test sets (the rest as on the CPU)."""

    def __init__(self, probe, allocated):
        self._probe, self.bytes = probe, allocated

    def allocated(self):
        return self.bytes

    def __getattr__(self, name):
        return getattr(self._probe, name)


def test_controller_a_changed_base_profiles_again():
    """Gradients kept from the last step, or optimizer state made after the first, change what
    is allocated when a step begins: the profile no longer holds."""
    c, _ = _controller(512 * MiB)
    c.probe = _Allocated(c.probe, c.profile.base + 1024)  # noise: same workload
    c.step_begins()
    assert not c.profiling
    c.probe.bytes = c.profile.base + 64 * MiB  # Adam's state appeared
    c.step_begins()
    assert c.profiling


def test_controller_measures_what_the_model_promises_and_keeps_the_fastest_measured():
    c, _ = _controller(1 << 40)
    keep = c.plan
    assert all(p.action == "keep" for p in keep.groups)
    c.budget = keep.peak - 1  # keeping everything no longer fits
    c._choose()
    first = c.plan
    c._runs[_key(first)] = 2
    c._times[_key(first)] = [10 * first.step_s] * (TIMINGS - 1)  # far slower than modelled
    c._choose()
    assert _key(c.plan) == _key(first)  # fewer than TIMINGS timed steps are not a measurement yet
    c._runs[_key(first)] = 3
    c._times[_key(first)].append(11 * first.step_s)
    c._choose()
    second = c.plan
    assert _key(second) != _key(first) and second.step_s < 10 * first.step_s  # the model's next promise runs
    c._runs[_key(second)] = 3
    c._times[_key(second)] = [2 * first.step_s, 3 * first.step_s, 2 * first.step_s]
    c._choose()
    assert _key(c.plan) not in (_key(first),)  # never back to the slow one
    for _ in range(10):  # a model that is always wrong: exploring stops after EXPLORE plans
        k = _key(c.plan)
        c._runs[k] = 3
        c._times.setdefault(k, [20 * first.step_s] * TIMINGS)
        c._choose()
    from actoffload.budget.controller import EXPLORE
    assert len(c._runs) <= EXPLORE + 1
    assert _key(c.plan) == _key(second)  # the fastest measured


def test_controller_a_measured_plan_the_model_cannot_beat_stays():
    c, _ = _controller(1 << 40)
    keep = c.plan
    c._runs[_key(keep)] = 3
    c._times[_key(keep)] = [keep.step_s] * TIMINGS  # as modelled: no plan promises to be faster
    c._choose()
    assert _key(c.plan) == _key(keep)


def test_controller_a_step_that_moved_bytes_slower_than_modelled_slows_the_modelled_bus():
    c, least = _controller(1 << 40)
    c._profiled = least.groups
    mover = next(p for p in c.plans if any(g.action == "offload" for g in p.groups))
    bus = c.profile.d2h_bps
    c._runs[_key(mover)] = 2
    for _ in range(TIMINGS):  # measured: the median of its timed steps
        c._untimed = (_key(mover), 0.0, 2 * mover.step_s + 1e-3)  # CPU marks: host seconds
        c._time_last_step()
    assert c.profile.d2h_bps < bus
    again = next(p for p in c.plans if _key(p) == _key(mover))
    assert abs(again.step_s - (2 * mover.step_s + 1e-3)) < 0.01 * again.step_s  # the model now agrees
    keep = next(p for p in c.plans if all(g.action == "keep" for g in p.groups))
    assert keep.step_s == min(p.step_s for p in c.plans)  # moving nothing is unaffected


def test_controller_two_profiling_steps_merge_to_the_faster_time_and_the_larger_memory():
    """The first profiling step also pins host memory: its times run long, its peaks do not lie."""
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=3e-3, backward_s=2e-3,
                     forward_extra=16 * MiB, backward_extra=8 * MiB, recompute_extra=MiB, recompute_s=5e-4,
                     host_s=6e-3)
    h = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=4e-3,
                     forward_extra=12 * MiB, backward_extra=10 * MiB, recompute_extra=2 * MiB, recompute_s=7e-4,
                     host_s=2e-3)
    first = Profile((g,), base=100 * MiB, outside_s=2e-3, d2h_bps=20e9, h2d_bps=20e9, outside_extra=8 * MiB)
    second = Profile((h,), base=100 * MiB, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9, outside_extra=4 * MiB)
    m = _merged(first, second).groups[0]
    assert (m.forward_s, m.backward_s, m.recompute_s, m.host_s) == (1e-3, 2e-3, 5e-4, 2e-3)
    assert (m.forward_extra, m.backward_extra, m.recompute_extra) == (16 * MiB, 10 * MiB, 2 * MiB)
    assert _merged(first, second).outside_s == 1e-3 and _merged(first, second).outside_extra == 8 * MiB


class _Overshooting(_Allocated):
    """A CUDA-like probe whose step peaks the test sets."""

    cuda = True

    def __init__(self, probe, peak):
        super().__init__(probe, 0)
        self.peak_bytes = peak

    def peak(self):
        return self.peak_bytes


def test_controller_an_overshoot_widens_the_margin_of_every_plan_not_yet_run():
    # the model's error follows the plan, not its copy window: the same groups under another
    # window would overshoot again
    c, _ = _controller(1 << 40)
    keep = c.plan
    c.budget = keep.peak - 1  # keeping everything no longer fits
    c._choose()
    ran = c.plan
    assert c.stats()["margin"] == MiB  # before any overshoot: the least margin
    c.probe = _Overshooting(c.probe, c.budget + 10 * MiB)
    c._backward_ended()
    c.probe = c.probe._probe
    assert c.margin == 10 * MiB + max(MiB, c.budget // 400) and c.stats()["margin"] == c.margin + MiB
    assert _key(c.plan) != _key(ran)  # measured over the budget: another plan runs
    untried = [p for p in c.plans if _key(p) not in c._measured]
    assert all(p.peak + c.margin > c.budget for p in untried if p.groups == ran.groups)


def test_controller_a_step_faster_than_modelled_shrinks_the_modelled_compute():
    """In a step that waits on the host, profiling's own work inflates the compute times."""
    c, least = _controller(1 << 40)
    c._profiled = least.groups
    keep = c.plan
    keep_forward_s = c.profile.groups[0].forward_s
    c._runs[_key(keep)] = 2
    c._untimed = (_key(keep), 0.0, 0.5 * keep.step_s)  # CPU marks: host seconds
    c._time_last_step()
    assert c.profile.groups[0].forward_s == keep_forward_s  # one timed step corrects nothing yet
    for _ in range(TIMINGS - 1):
        c._untimed = (_key(keep), 0.0, 0.5 * keep.step_s)
        c._time_last_step()
    again = next(p for p in c.plans if _key(p) == _key(keep))
    assert abs(again.step_s - 0.5 * keep.step_s) < 0.01 * keep.step_s  # the model now agrees
    assert c.profile.d2h_bps == 20e9  # the bus is left alone


def test_controller_shrinking_the_modelled_compute_shrinks_the_hosts_time_alike():
    # a host-paced group stays host-paced, and its recomputation costs less by the same factor
    c, least = _controller(1 << 40)
    c._profiled = least.groups
    c.profile = replace(c.profile, groups=tuple(replace(g, host_s=2 * g.forward_s) for g in c.profile.groups))
    c._plan_all()
    keep = next(p for p in c.plans if all(g.action == "keep" for g in p.groups))
    before = c.profile.groups[0]
    c._calibrate(keep, 0.5 * keep.step_s)
    after = c.profile.groups[0]
    factor = after.forward_s / before.forward_s
    assert factor < 0.9
    assert after.host_s == pytest.approx(before.host_s * factor)
    assert after.recompute_time == pytest.approx(before.recompute_time * factor)


def test_planner_plans_that_move_nothing_have_one_copy_window():
    """A window of copies matters only to a plan that moves bytes: the same groups under
    another window are the same plan (tried, measured and given a margin once)."""
    c, _ = _controller(1 << 40)
    for p in c.plans:
        if not any(g.action in ("offload", "recompute_offload") for g in p.groups):
            assert (p.max_inflight, p.prefetch) == (0, 0)


def _run_steps(c: BudgetController, steps: int, slower: float) -> None:
    """Steps as the offloader drives them: each plan's steps after its first are timed, the
    measured time ``slower`` times what the model says."""
    for _ in range(steps):
        k = _key(c.plan)
        c._runs[k] = c._runs.get(k, 0) + 1
        if c._runs[k] >= 2:
            c._untimed = (k, 0.0, slower * c.plan.step_s)  # CPU marks: host seconds
            c._time_last_step()


def test_controller_keeps_trying_what_the_model_promises_step_by_step():
    c, least = _controller(1 << 40)
    c._profiled = least.groups
    c.budget = c.plan.peak - 1  # keeping everything no longer fits: plans to choose from
    c._choose()
    _run_steps(c, 4 * (TIMINGS + 1) * 2, slower=3.0)  # the model always promises too much
    from actoffload.budget.controller import EXPLORE
    assert 3 <= len(c._runs) <= EXPLORE + 1


def test_controller_profiles_are_merged_only_for_one_workload_on_one_base():
    from actoffload.budget.controller import _same_workload

    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    a = Profile((g,) * 2, base=100 * MiB, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9)
    assert _same_workload(a, a, MiB)
    slightly = replace(a, groups=(replace(g, spans=(66 * MiB,)),) * 2)  # a batch 3% larger
    assert _same_workload(a, slightly, MiB)
    assert not _same_workload(a, replace(a, groups=(replace(g, spans=(80 * MiB,)),) * 2), MiB)
    # gradients kept from the first step: in its backward, and in the second's base
    assert not _same_workload(a, replace(a, base=164 * MiB), MiB)


def test_controller_does_not_shrink_compute_past_what_the_bus_allows():
    """A bus-bound plan faster than modelled says nothing about compute: the model stays."""
    g = GroupProfile("g", spans=(1 << 30,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g,) * 4, base=100 * MiB, outside_s=1e-3, d2h_bps=1e9, h2d_bps=1e9)
    c = BudgetController(1 << 40, torch.device("cpu"))
    c.profile, c._reprofile = profile, False
    c._profiled = (GroupPlan("offload"),) * 4
    c._plan_all()
    mover = Plan((GroupPlan("offload"),) * 4, 0, 0, *simulate(profile, (GroupPlan("offload"),) * 4, 0, 0))
    c._calibrate(mover, 0.9 * mover.step_s)  # bus time alone is more than that
    assert c.profile == profile


class _Done:
    """A CUDA event already reached."""

    def query(self):
        return True


class _DeviceSteps:
    """A probe as on CUDA whose every step takes ``seconds`` and allocates nothing."""

    cuda = True

    def __init__(self, seconds):
        self.step_s = seconds

    def mark(self):
        return _Done()

    def seconds(self, start, end):
        return self.step_s

    def peak(self):
        return 0

    def allocated(self):
        return 0

    def reset_peak(self):
        pass

    def host_clock(self):
        return None


def test_controller_stops_choosing_once_the_running_plan_is_measured(monkeypatch):
    """Choosing again walks every candidate plan: host time in every step, for nothing once
    the plan that runs is measured and nothing promises to beat it."""
    c, _ = _controller(1 << 40)
    c.probe = _DeviceSteps(c.plan.step_s)  # as modelled: nothing promises better
    chosen = []
    choose = c._choose
    monkeypatch.setattr(c, "_choose", lambda: (chosen.append(_key(c.plan)), choose()))
    for _ in range(20):
        c._time_last_step()  # as step_begins does
        c._runs[_key(c.plan)] = c._runs.get(_key(c.plan), 0) + 1
        c._backward_ended()
    assert c._timed(c.plan) and len(c._times[_key(c.plan)]) == TIMINGS
    assert len(chosen) == TIMINGS


def test_controller_measures_the_fastest_plan_that_moves_no_bytes_too():
    """Where the model prefers moving bytes, the best plan without the bus (checkpointing by
    hand) is measured as well, and kept if it is faster."""
    from actoffload.budget.planner import moves_bytes

    c, _ = _controller(1 << 40)
    slow = tuple(replace(g, forward_s=5e-3) for g in c.profile.groups)  # recomputing costs, the bus hides
    c.profile = replace(c.profile, groups=slow, d2h_bps=50e9, h2d_bps=50e9)
    c.plans = candidates(c.profile)
    still_peaks = {p.peak for p in c.plans if not moves_bytes(c.profile, p.groups)}
    # a budget where the model's fastest plan moves bytes and one that moves none also fits
    c.budget = MiB + next(b for b in sorted(still_peaks)  # (a MiB: the least margin)
                          if moves_bytes(c.profile, choose(c.profile, b, c.plans).groups))
    c._choose()
    first = c.plan
    assert moves_bytes(c.profile, first.groups)
    c._runs[_key(first)] = TIMINGS + 1
    c._times[_key(first)] = [first.step_s] * TIMINGS  # as modelled: nothing promises better
    c._choose()
    still = c.plan
    assert not moves_bytes(c.profile, still.groups) and still.step_s > first.step_s
    c._runs[_key(still)] = TIMINGS + 1
    c._times[_key(still)] = [0.9 * first.step_s] * TIMINGS  # the model overrated its recomputation
    c._choose()
    assert _key(c.plan) == _key(still)
    c._times[_key(still)] = [1.1 * first.step_s] * TIMINGS  # as the model said: slower
    c._choose()
    assert _key(c.plan) == _key(first)


class _Event:
    def __init__(self):
        self.done = True

    def query(self):
        return self.done


class _PendingSteps(_DeviceSteps):
    """As :class:`_DeviceSteps`, with marks whose completion the test sets."""

    def mark(self):
        return _Event()

    def bandwidth(self):
        return 20e9, 20e9


def _profiling_step(c, groups, recompute=False):
    """One profiling step of ``groups`` recomputed groups, each saving 4 MiB of inputs (32 MiB
    unrecomputed); ``recompute``: backward marks each one's recomputation too."""
    from actoffload import policy

    c.step_begins()
    for i in range(groups):
        c.action(True)
        c.group_closing(i)
        c.committed(i, True, policy.GroupPlan([None], [policy.Span(0, 0, 4 * MiB, [0])]),
                    policy.GroupPlan([None], [policy.Span(0, 0, 32 * MiB, [0])]))
    for i in reversed(range(groups)):
        c.backward_reaches(i)
        if recompute:
            c.recompute_begins(i)
            c.recompute_ends(i)
    c._backward_ended()


def test_controller_a_step_still_running_when_profiling_begins_is_not_timed_against_the_new_profile(monkeypatch):
    from actoffload import compat

    monkeypatch.setattr(compat, "at_backward_end", lambda callback: None)
    c, _ = _controller(1 << 40)
    c.probe = _PendingSteps(c.plan.step_s)
    for _ in range(2):  # the second step is queued for timing
        c.step_begins()
        c._backward_ended()
    pending = c._untimed[2]
    pending.done = False  # its end not reached when the next step begins
    c._reprofile = True  # a new workload: three groups now
    for _ in range(2):  # the profiling steps
        _profiling_step(c, 3)
    pending.done = True
    c.step_begins()  # profiling ends: a plan for three groups
    c._backward_ended()
    c.step_begins()  # once raised StopIteration: the old plan's step was timed against the new plans
    assert all(len(k[0]) == 3 for k in c._times)


def test_controller_a_measured_best_that_moves_no_bytes_is_not_checked_against_another():
    c, _ = _controller(1 << 40)
    keep = c.plan
    recompute = next(p for p in c.plans if any(g.action == "recompute" for g in p.groups)
                     and not any(g.action.endswith("offload") for g in p.groups))
    c._runs = {_key(recompute): TIMINGS + 1}
    c._times = {_key(recompute): [0.5 * keep.step_s] * TIMINGS}  # faster than any model figure
    c._choose()
    assert _key(c.plan) == _key(recompute)


def test_controller_judges_a_plan_by_the_median_of_its_timed_steps():
    # a plan that moves bytes runs at one of two paces: its one lucky step does not make it fastest
    c, _ = _controller(1 << 40)
    a, b = c.plans[0], c.plans[1]
    c._runs = {_key(a): TIMINGS + 1, _key(b): TIMINGS + 1}
    c._times = {_key(a): [1e-3] + [10e-3] * (TIMINGS - 1), _key(b): [5e-3] * TIMINGS}
    assert c._time_of(a) == 10e-3
    assert min((a, b), key=c._time_of) is b


def test_controller_tries_the_plan_moving_fewer_bytes_among_those_the_model_rates_alike():
    from actoffload.budget.controller import TIE, _simplest_first
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
    mover = Plan((GroupPlan("offload"), GroupPlan("offload")), 1, 1, peak=10, step_s=1.0)
    lighter = Plan((GroupPlan("offload"), GroupPlan()), 1, 1, peak=20, step_s=1.0 + TIE / 2)
    slower = Plan((GroupPlan(), GroupPlan()), 0, 0, peak=30, step_s=1.0 + 2 * TIE)
    assert list(_simplest_first([slower, mover, lighter], profile)) == [lighter, mover, slower]


def test_controller_two_profiling_steps_judge_the_hosts_pace_within_one_step():
    # the faster forward's step gives the host time too: the least of each, from two steps,
    # would call a device-paced group host-paced
    g = GroupProfile("g", spans=(MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3, host_s=0.5e-3)
    h = replace(g, forward_s=3e-3, host_s=0.2e-3)
    for a, b in ((g, h), (h, g)):
        p = Profile((a,), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
        q = Profile((b,), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
        m = _merged(p, q).groups[0]
        assert (m.forward_s, m.host_s) == (1e-3, 0.5e-3)


def test_controller_among_plans_rated_alike_bus_bytes_come_before_groups_not_kept():
    from actoffload.budget.controller import _simplest_first
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
    moving = Plan((GroupPlan("offload"), GroupPlan()), 1, 1, peak=10, step_s=1.0)  # one group, 64 MiB moved
    still = Plan((GroupPlan("recompute"), GroupPlan("recompute")), 0, 0, peak=20, step_s=1.0)  # two, none
    assert list(_simplest_first([moving, still], profile)) == [still, moving]


def test_controller_tries_the_plan_with_fewer_groups_not_kept_among_those_the_model_rates_alike():
    # a recomputed part costs host time the model does not see (checkpointing, hooks): between
    # two plans moving nothing that the model rates alike, the one recomputing fewer groups goes first
    from actoffload.budget.controller import TIE, _simplest_first
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g, g), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
    parts = Plan((GroupPlan("recompute"), GroupPlan("recompute"), GroupPlan()), 0, 0, peak=10, step_s=1.0)
    one = Plan((GroupPlan("recompute"), GroupPlan(), GroupPlan()), 0, 0, peak=20, step_s=1.0 + TIE / 2)
    assert list(_simplest_first([parts, one], profile)) == [one, parts]


class _HostPaced(_DeviceSteps):
    """A CUDA-like probe where each group's forward takes ``device_s`` on the device and the
    host's clock advances ``host_s`` between a group's opening and its closing."""

    def __init__(self, device_s, host_s):
        super().__init__(device_s)
        self.host_s, self.now = host_s, 0.0

    def host_clock(self):
        self.now += self.host_s  # read as a group opens and as it closes: host_s apart
        return self.now

    def bandwidth(self):
        return 20e9, 20e9


@pytest.mark.parametrize("host_s, paced", [(3e-3, True), (0.5e-3, False)])
def test_controller_a_forward_at_the_hosts_pace_recomputes_at_that_pace(monkeypatch, host_s, paced):
    # 1 ms of device time for its forward, and for its recomputation; where the host needs
    # 3 ms to run that forward, recomputing it costs 3 ms of the step
    from actoffload import compat

    monkeypatch.setattr(compat, "at_backward_end", lambda callback: None)
    c = BudgetController(1 << 40, torch.device("cpu"))
    c.probe = _HostPaced(1e-3, host_s)
    for _ in range(2):  # the profiling steps
        _profiling_step(c, 2, recompute=True)
    c.step_begins()
    g = c.profile.groups[0]
    assert g.host_s == pytest.approx(host_s) and g.forward_s == g.recompute_s == 1e-3
    assert g.recompute_time == (pytest.approx(host_s) if paced else 1e-3)


def test_controller_is_settled_once_its_plan_is_measured_and_nothing_is_left_to_try():
    c, _ = _controller(1 << 40)
    assert c.settled and c.stats()["settled"]  # on the CPU nothing is timed: planned is settled
    c.probe = _DeviceSteps(c.plan.step_s)
    assert not c.settled  # on CUDA: measured first
    c._runs = {_key(c.plan): TIMINGS + 1}
    c._times = {_key(c.plan): [c.plan.step_s] * TIMINGS}
    c._choose()
    assert c.settled
    c._reprofile = True
    c.step_begins()  # profiling again
    assert not c.settled and not c.stats()["settled"]
