"""The memory budget's cost model: what a plan costs, from one place; measured steps turned
into a profile that gives the measurement back; the model made to agree with a measured
step (CPU only; the model never touches a device)."""

import doctest
import random
from dataclasses import replace

import pytest

import actoffload.spans
from actoffload import policy
from actoffload.budget import costmodel
from actoffload.budget.actions import Action, GroupDecision
from actoffload.budget.costmodel import (GroupProfile, MeasuredGroup, MeasuredStep, MemoryPlan, Profile, Whole,
                                         calibrated, compute_scaled, merged, profile_of, profiled_plan, recompute_time,
                                         same_workload, simulate)
from actoffload.budget.search import choose
from actoffload.spans import largest_within

MiB = 1 << 20


def _slow_bus() -> Profile:
    g = GroupProfile("0", spans=(256 * MiB,), kept=0, inputs=8 * MiB, forward_s=2e-3, backward_s=4e-3)
    return Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)


def test_costmodel_the_cost_of_recomputing_is_said_in_one_place(monkeypatch):
    # on a slow bus recomputing is cheaper than moving 256 MiB out and back; make running a
    # forward again cost a second instead, in the one function that says what it costs, and
    # the plan chosen for the same budget moves bytes instead
    profile = _slow_bus()
    plan = choose(profile, 700 * MiB)
    assert plan.groups[0].action is Action.RECOMPUTE
    monkeypatch.setattr(costmodel, "recompute_time", lambda g: 1.0)
    assert profile.groups[0].recompute_time == 1.0
    plan = choose(profile, 700 * MiB)
    assert not any(d.action.recomputes for d in plan.groups)
    assert any(d.action is Action.OFFLOAD for d in plan.groups)


def test_costmodel_a_module_recomputed_whole_costs_its_parts_recomputation_from_the_same_place(monkeypatch):
    parts = tuple(GroupProfile(str(i), spans=(8 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3)
                  for i in range(2))
    profile = Profile(parts, 0, 0.0, 1e9, 1e9, wholes=(Whole(0, 2, MiB),))
    whole = (GroupDecision(Action.RECOMPUTE_WHOLE), GroupDecision(Action.INSIDE))
    assert simulate(profile, whole, 0, 0)[1] == pytest.approx(4e-3 + 2e-3)
    monkeypatch.setattr(costmodel, "recompute_time", lambda g: 5 * g.forward_s)
    assert simulate(profile, whole, 0, 0)[1] == pytest.approx(4e-3 + 2 * 5e-3)


def test_costmodel_spans_move_by_the_one_rule_of_the_policy():
    assert doctest.testmod(actoffload.spans).failed == 0
    # a share of a group moves the largest spans that fit, and at least the largest
    g = GroupProfile("g", spans=(6 * MiB, 5 * MiB, 3 * MiB, 2 * MiB), kept=0, inputs=None, forward_s=1, backward_s=1)
    assert g.moved(0.5) == 8 * MiB  # 6, not 5 (11 > 8), not 3 (9 > 8), then 2
    assert g.moved(1.0) == 16 * MiB
    assert replace(g, spans=(10 * MiB, 2 * MiB)).moved(0.5) == 10 * MiB  # a share below the largest: the largest
    assert replace(g, spans=()).moved(0.5) == 0


@pytest.mark.parametrize("seed", range(20))
def test_costmodel_the_bytes_a_plan_moves_are_the_bytes_the_policy_moves(seed):
    # the controller gives the policy the model's bytes as its cap: the same spans move
    rng = random.Random(seed)
    sizes = [rng.randint(1, 64) * MiB for _ in range(rng.randint(1, 6))]
    g = GroupProfile("g", spans=tuple(sorted(sizes, reverse=True)), kept=0, inputs=None, forward_s=1, backward_s=1)
    facts = [policy.SavedFact(key=1000 + i, start=0, end=n) for i, n in enumerate(sizes)]
    for fraction in (0.5, 1.0):
        cap = costmodel.moved(GroupDecision(Action.OFFLOAD, fraction), g)
        plan = policy.plan_facts(facts, min_offload_bytes=0, policy="all", committed=True, move_at_most=cap)
        assert sum(s.nbytes for s in plan.spans) == cap
        assert sorted(s.nbytes for s in plan.spans) == sorted(sizes[i] for i in largest_within(sizes, cap))


def _measured() -> MeasuredStep:
    """A profiling step of three groups: two recomputed (4 MiB of inputs moved out each), then
    one that moved its 32 MiB out whole and kept 1 MiB."""
    rec = dict(recomputed=True, moved=4 * MiB, spans=(16 * MiB, 8 * MiB), kept=0, inputs=4 * MiB)
    return MeasuredStep(
        base=100 * MiB, outside_s=1e-3, outside_peak=110 * MiB, d2h_bps=1e9, h2d_bps=1e9,
        groups=(MeasuredGroup(forward_s=1e-3, backward_s=10e-3, recompute_s=0.5e-3, forward_peak=30 * MiB,
                              backward_peak=140 * MiB, recompute_peak=150 * MiB, **rec),
                MeasuredGroup(forward_s=2e-3, backward_s=12e-3, recompute_s=1e-3, forward_peak=30 * MiB,
                              backward_peak=145 * MiB, recompute_peak=141 * MiB, **rec),
                MeasuredGroup(recomputed=False, forward_s=3e-3, backward_s=50e-3, recompute_s=None, moved=32 * MiB,
                              spans=(32 * MiB,), kept=MiB, inputs=0, forward_peak=40 * MiB, backward_peak=170 * MiB,
                              recompute_peak=0)))


def test_costmodel_simulating_the_profiled_plan_gives_back_the_measured_step():
    step = _measured()
    profile = profile_of(step)
    assert [g.inputs for g in profile.groups] == [4 * MiB, 4 * MiB, None]
    trace: list = []
    peak, seconds = simulate(profile, profiled_plan(profile), 0, 0, trace)
    copies = sum(m.moved for m in step.groups) / 1e9  # profiling's copies are synchronous
    assert seconds == pytest.approx(sum(m.forward_s + m.backward_s for m in step.groups) + step.outside_s + copies)
    assert dict(trace)["loss"] == step.outside_peak
    for i, m in enumerate(step.groups):  # a recomputed group's backward peaks as it recomputes
        assert dict(trace)[f"backward {i}"] == max(m.backward_peak, m.recompute_peak)


def test_costmodel_a_group_backward_never_reached_costs_twice_its_forward():
    step = _measured()
    unreached = replace(step.groups[2], forward_s=50e-3, backward_s=None)
    g = profile_of(replace(step, groups=step.groups[:2] + (unreached,))).groups[2]
    assert not g.reached and g.backward_s == pytest.approx(2 * 50e-3 - 32 * MiB / 1e9)  # less its reload


def test_costmodel_two_profiling_steps_merge_to_the_faster_time_and_the_larger_memory():
    """The first profiling step also pins host memory: its times run long, its peaks do not lie."""
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=3e-3, backward_s=2e-3,
                     forward_extra=16 * MiB, backward_extra=8 * MiB, recompute_extra=MiB, recompute_s=5e-4,
                     host_s=6e-3)
    h = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=4e-3,
                     forward_extra=12 * MiB, backward_extra=10 * MiB, recompute_extra=2 * MiB, recompute_s=7e-4,
                     host_s=2e-3)
    first = Profile((g,), base=100 * MiB, outside_s=2e-3, d2h_bps=20e9, h2d_bps=20e9, outside_extra=8 * MiB)
    second = Profile((h,), base=100 * MiB, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9, outside_extra=4 * MiB)
    m = merged(first, second).groups[0]
    assert (m.forward_s, m.backward_s, m.recompute_s, m.host_s) == (1e-3, 2e-3, 5e-4, 2e-3)
    assert (m.forward_extra, m.backward_extra, m.recompute_extra) == (16 * MiB, 10 * MiB, 2 * MiB)
    assert merged(first, second).outside_s == 1e-3 and merged(first, second).outside_extra == 8 * MiB


def test_costmodel_two_profiling_steps_merge_the_inputs_the_marks_hold_and_a_whole_module_keeps_them():
    """What the policy and the marks keep of a recomputed group's inputs stays whatever the plan:
    merged, the more of the two steps' held bytes stays (never more than the inputs move); a
    module recomputed whole holds as many of its own inputs."""
    g = GroupProfile("g", spans=(MiB,), kept=0, inputs=100, forward_s=1e-3, backward_s=1e-3, inputs_moving=90)
    h = replace(g, inputs=80, inputs_moving=None)
    for a, b, held in ((g, h, 10), (h, g, 10), (h, h, 0)):
        p = Profile((a,), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
        q = Profile((b,), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
        m = merged(p, q).groups[0]
        assert m.inputs == b.inputs and m.held_inputs == held
        assert costmodel.resident(GroupDecision(Action.RECOMPUTE_OFFLOAD), m) == held
    assert costmodel.with_inputs(g, 300).movable_inputs == 290 and costmodel.with_inputs(h, 300).inputs_moving is None


def test_costmodel_two_profiling_steps_judge_the_hosts_pace_within_one_step():
    # the faster forward's step gives the host time too: the least of each, from two steps,
    # would call a device-paced group host-paced
    g = GroupProfile("g", spans=(MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3, host_s=0.5e-3)
    h = replace(g, forward_s=3e-3, host_s=0.2e-3)
    for a, b in ((g, h), (h, g)):
        p = Profile((a,), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
        q = Profile((b,), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
        m = merged(p, q).groups[0]
        assert (m.forward_s, m.host_s) == (1e-3, 0.5e-3)


def test_costmodel_profiles_are_merged_only_for_one_workload_on_one_base():
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    a = Profile((g,) * 2, base=100 * MiB, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9)
    assert same_workload(a, a, MiB)
    slightly = replace(a, groups=(replace(g, spans=(66 * MiB,)),) * 2)  # a batch 3% larger
    assert same_workload(a, slightly, MiB)
    assert not same_workload(a, replace(a, groups=(replace(g, spans=(80 * MiB,)),) * 2), MiB)
    # gradients kept from the first step: in its backward, and in the second's base
    assert not same_workload(a, replace(a, base=164 * MiB), MiB)


def _four() -> Profile:
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3,
                     forward_extra=16 * MiB, backward_extra=16 * MiB)
    return Profile((g,) * 4, base=100 * MiB, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9, outside_extra=8 * MiB)


def _costed(profile: Profile, groups, window=0) -> MemoryPlan:
    return MemoryPlan(groups, window, window, *simulate(profile, groups, window, window))


def test_costmodel_a_step_that_moved_bytes_slower_than_modelled_slows_the_modelled_bus():
    profile = _four()
    mover = _costed(profile, (GroupDecision(Action.OFFLOAD),) * 4, 1)
    seconds = 2 * mover.step_s + 1e-3
    agreed = calibrated(profile, mover, seconds)
    assert agreed is not None and agreed.d2h_bps < profile.d2h_bps and agreed.groups == profile.groups
    assert simulate(agreed, mover.groups, 1, 1)[1] == pytest.approx(seconds, rel=0.01)  # the model now agrees
    assert calibrated(profile, mover, 1.01 * mover.step_s) is None  # noise


def test_costmodel_a_step_faster_than_modelled_shrinks_the_modelled_compute_and_the_hosts_time_alike():
    # a host-paced group stays host-paced, and its recomputation costs less by the same factor
    profile = _four()
    profile = replace(profile, groups=tuple(replace(g, host_s=2 * g.forward_s) for g in profile.groups))
    keep = _costed(profile, (GroupDecision(),) * 4)
    agreed = calibrated(profile, keep, 0.7 * keep.step_s)
    assert agreed is not None and agreed.d2h_bps == profile.d2h_bps  # the bus is left alone
    before, after = profile.groups[0], agreed.groups[0]
    factor = after.forward_s / before.forward_s
    assert factor < 0.9
    assert after.host_s == pytest.approx(before.host_s * factor)
    assert after.recompute_time == pytest.approx(before.recompute_time * factor)
    assert simulate(agreed, keep.groups, 0, 0)[1] == pytest.approx(0.7 * keep.step_s, rel=0.01)


def test_costmodel_does_not_shrink_compute_past_what_the_bus_allows():
    """A bus-bound plan faster than modelled says nothing about compute: the model stays."""
    g = GroupProfile("g", spans=(1 << 30,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g,) * 4, base=100 * MiB, outside_s=1e-3, d2h_bps=1e9, h2d_bps=1e9)
    mover = _costed(profile, (GroupDecision(Action.OFFLOAD),) * 4)
    assert calibrated(profile, mover, 0.9 * mover.step_s) is None  # bus time alone is more than that


def test_costmodel_describes_actions_by_their_plain_names():
    profile = _four()
    plan = _costed(profile, (GroupDecision(Action.OFFLOAD, 0.5), GroupDecision(Action.RECOMPUTE_OFFLOAD),
                             GroupDecision(Action.RECOMPUTE), GroupDecision()))
    rows = plan.describe(profile)
    assert [r["action"] for r in rows] == [a.value for a in (Action.OFFLOAD, Action.RECOMPUTE_OFFLOAD,
                                                             Action.RECOMPUTE, Action.KEEP)]
    assert all(type(r["action"]) is str for r in rows)
    assert [(r["offloaded_bytes"], r["resident_bytes"]) for r in rows] == [
        (64 * MiB, 0), (8 * MiB, 0), (0, 8 * MiB), (0, 64 * MiB)]


def test_costmodel_keep_all_is_pure_compute_and_offloading_is_bus_bound_when_the_bus_is_slow():
    g = GroupProfile("0", spans=(100 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g, g), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    keep = tuple(GroupDecision() for _ in range(3))
    assert simulate(profile, keep, 0, 0) == (300 * MiB, pytest.approx(9e-3))
    off = tuple(GroupDecision(Action.OFFLOAD) for _ in range(3))
    peak, step = simulate(profile, off, 0, 0)
    bus = 100 * MiB / 1e9
    assert step == pytest.approx(3 * 1e-3 + 3 * bus + 3 * bus + 3 * 2e-3)  # out then back, nothing hidden
    assert peak == 100 * MiB  # one group's activations at a time
    recompute = tuple(GroupDecision(Action.RECOMPUTE) for _ in range(3))
    peak, step = simulate(profile, recompute, 0, 0)
    assert step == pytest.approx(3 * 1e-3 + 3 * (2e-3 + 1e-3)) and peak == 2 * MiB + 100 * MiB


def test_costmodel_simulate_counts_a_full_window_of_copies_in_flight_however_fast_the_bus():
    """A copy may run late (a plan's first step pins host memory): memory is modelled for
    the last max_inflight groups still holding their sources, time for the modelled bus."""
    g = GroupProfile("g", spans=(100,), kept=0, inputs=None, forward_s=1.0, backward_s=1.0)
    p = Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=1e12, h2d_bps=1e12)
    offload = (GroupDecision(Action.OFFLOAD),) * 4
    for window, in_flight in ((0, 0), (1, 100), (2, 200)):
        trace: list = []
        simulate(p, offload, window, 0, trace)
        assert dict(trace)["forward 3"] == in_flight + 100  # plus what group 3 saves
        assert dict(trace)["loss"] == in_flight  # the window now ends with group 3


def test_costmodel_simulate_charges_recomputation_its_measured_time():
    """Checkpointing stops recomputing once the last saved tensor is back: a measured
    recomputation shorter than the forward is what a recomputed group's backward adds."""
    g = GroupProfile("g", spans=(100,), kept=0, inputs=10, forward_s=4.0, backward_s=2.0)
    p = Profile((g,), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    recompute = (GroupDecision(Action.RECOMPUTE),)
    assert simulate(p, recompute, 0, 0)[1] == 4.0 + 2.0 + 4.0  # unmeasured: its forward again
    measured = Profile((replace(g, recompute_s=1.5),), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    assert simulate(measured, recompute, 0, 0)[1] == 4.0 + 2.0 + 1.5
    assert simulate(measured, (GroupDecision(),), 0, 0)[1] == 4.0 + 2.0  # kept: no recomputation


def test_costmodel_simulate_charges_a_host_paced_forwards_recomputation_its_host_time():
    # a forward whose host time reaches its device time kept the device waiting: so does its
    # recomputation, whatever its device time. A device-paced forward's host time is hidden.
    def step(host_s):
        g = GroupProfile("0", spans=(8 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3,
                         recompute_s=2e-5, host_s=host_s)
        return simulate(Profile((g,), 0, 0.0, 1e9, 1e9), (GroupDecision(Action.RECOMPUTE),), 0, 0)[1]

    assert step(None) == pytest.approx(2e-3 + 2e-5)
    assert step(0.5e-3) == pytest.approx(2e-3 + 2e-5)  # the device's pace
    assert step(0.85e-3) == pytest.approx(2e-3 + 2e-5)
    assert step(0.95e-3) == pytest.approx(2e-3 + 0.95e-3)  # within HOST_PACED of it: the host's
    assert step(3e-3) == pytest.approx(2e-3 + 3e-3)
    # a module recomputed whole: each part at its own pace
    parts = (GroupProfile("0", spans=(8 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3,
                          recompute_s=2e-5, host_s=3e-3),
             GroupProfile("1", spans=(8 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3,
                          recompute_s=5e-4, host_s=0.2e-3))
    profile = Profile(parts, 0, 0.0, 1e9, 1e9, wholes=(Whole(0, 2, MiB),))
    whole = (GroupDecision(Action.RECOMPUTE_WHOLE), GroupDecision(Action.INSIDE))
    assert simulate(profile, whole, 0, 0)[1] == pytest.approx(4e-3 + 3e-3 + 5e-4)


def test_costmodel_a_host_paced_recomputation_is_charged_its_own_host_time_where_measured():
    # the forward's host time holds the profiling's work on each group's way in and out; the
    # recomputation's own (the least the profiling steps measured) is what backward waits for
    g = GroupProfile("0", spans=(8 * MiB,), kept=0, inputs=MiB, forward_s=0.5e-3, backward_s=1e-3,
                     recompute_s=0.4e-3, host_s=1.5e-3, recompute_host_s=0.7e-3)
    assert recompute_time(g) == pytest.approx(0.7e-3)
    assert recompute_time(replace(g, recompute_host_s=None)) == pytest.approx(1.5e-3)  # not measured
    assert recompute_time(replace(g, recompute_host_s=0.1e-3)) == pytest.approx(0.4e-3)  # the device's pace
    assert recompute_time(replace(g, host_s=0.2e-3)) == pytest.approx(0.4e-3)  # device-paced: hidden
    metered, unmetered = replace(g, recompute_host_s=1.2e-3), replace(g, recompute_host_s=0.7e-3)
    both = merged(Profile((metered,), 0, 0.0, 1e9, 1e9), Profile((unmetered,), 0, 0.0, 1e9, 1e9))
    assert both.groups[0].recompute_host_s == 0.7e-3
    assert compute_scaled(Profile((g,), 0, 0.0, 1e9, 1e9), 0.5).groups[0].recompute_host_s == pytest.approx(0.35e-3)


def test_costmodel_simulate_frees_a_whole_modules_later_parts_before_its_earlier_parts_backward():
    # after recomputing, all of a module's activations are back (120 MiB); the first part's
    # 50 MiB of temporaries come when the later parts' backward has freed theirs (10 + 50)
    parts = [GroupProfile("0", spans=(10 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3,
                          backward_extra=50 * MiB),
             GroupProfile("1", spans=(10 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3),
             GroupProfile("2", spans=(100 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3)]
    profile = Profile(tuple(parts), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9, wholes=(Whole(0, 3, MiB),))
    trace = []
    simulate(profile, tuple(GroupDecision(a) for a in (Action.RECOMPUTE_WHOLE, Action.INSIDE, Action.INSIDE)), 0, 0, trace)
    assert dict(trace)["backward 0"] == 120 * MiB
    # with a part's own parameter gradients: the first part's backward comes after the others' are made
    profile = replace(profile, groups=(parts[0], parts[1], replace(parts[2], grads=80 * MiB)))
    trace = []
    simulate(profile, tuple(GroupDecision(a) for a in (Action.RECOMPUTE_WHOLE, Action.INSIDE, Action.INSIDE)), 0, 0, trace)
    assert dict(trace)["backward 0"] == 80 * MiB + 10 * MiB + 50 * MiB
