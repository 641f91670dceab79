"""The memory-budget planner, a pure function from a profile to a plan: its promises hold
on many random profiles (CPU only; the planner never touches a device)."""

import random
from dataclasses import replace

import pytest

from actoffload.budget.planner import (BudgetTooSmall, GroupPlan, GroupProfile, Plan, Profile, Whole, candidates,
                                      choose, fastest, simulate, unmodelled_work)

MiB = 1 << 20


def _profile(rng: random.Random) -> Profile:
    groups = []
    for i in range(rng.randint(1, 8)):
        spans = tuple(sorted((rng.randint(1, 64) * MiB for _ in range(rng.randint(0, 4))), reverse=True))
        fwd = rng.uniform(1e-3, 20e-3)
        groups.append(GroupProfile(
            str(i), spans=spans, kept=rng.randint(0, 4) * MiB,
            inputs=None if rng.random() < 0.2 else rng.randint(1, 16) * MiB,
            forward_s=fwd, backward_s=2 * fwd, forward_extra=rng.randint(0, 32) * MiB,
            backward_extra=rng.randint(0, 64) * MiB, grads=rng.randint(0, 8) * MiB))
    bw = rng.uniform(5e9, 60e9)
    # every other profile: the groups are the parts of modules of up to three parts
    wholes, i = [], 0
    while rng.random() < 0.5 and i < len(groups):
        n = min(rng.randint(1, 3), len(groups) - i)
        wholes.append(Whole(i, n, inputs=rng.randint(1, 16) * MiB))
        i += n
    return Profile(tuple(groups), base=rng.randint(0, 2048) * MiB, outside_s=rng.uniform(0, 5e-3),
                   d2h_bps=bw, h2d_bps=bw * rng.uniform(0.8, 1.2), wholes=tuple(wholes))


PROFILES = [_profile(random.Random(seed)) for seed in range(40)]


@pytest.mark.parametrize("seed", range(40))
def test_planner_chosen_plan_fits_and_more_budget_is_never_slower(seed):
    profile = PROFILES[seed]
    plans = candidates(profile)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    last_time = float("inf")
    for k in range(9):
        budget = least + (most - least) * k // 8
        plan = choose(profile, budget, plans)
        assert plan.peak <= budget
        assert simulate(profile, plan.groups, plan.max_inflight, plan.prefetch) == (plan.peak, plan.step_s)
        assert plan.step_s <= last_time + 1e-12  # more budget never predicts a slower step
        last_time = plan.step_s


@pytest.mark.parametrize("seed", range(40))
def test_planner_budget_at_the_no_offload_peak_keeps_everything(seed):
    profile = PROFILES[seed]
    keep_all = tuple(GroupPlan() for _ in profile.groups)
    peak, step = simulate(profile, keep_all, 0, 0)
    plan = choose(profile, peak)
    assert all(p.action == "keep" for p in plan.groups) and plan.step_s == pytest.approx(step)


@pytest.mark.parametrize("seed", range(40))
def test_planner_budget_below_every_plan_names_the_smallest_reachable_peak(seed):
    profile = PROFILES[seed]
    least = min(p.peak for p in candidates(profile))
    with pytest.raises(BudgetTooSmall, match=f"smallest reachable peak is about {least:,} bytes"):
        choose(profile, least - 1)


def test_planner_model_keep_all_is_pure_compute_and_offloading_is_bus_bound_when_the_bus_is_slow():
    g = GroupProfile("0", spans=(100 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g, g), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    keep = tuple(GroupPlan() for _ in range(3))
    assert simulate(profile, keep, 0, 0) == (300 * MiB, pytest.approx(9e-3))
    off = tuple(GroupPlan("offload") for _ in range(3))
    peak, step = simulate(profile, off, 0, 0)
    bus = 100 * MiB / 1e9
    assert step == pytest.approx(3 * 1e-3 + 3 * bus + 3 * bus + 3 * 2e-3)  # out then back, nothing hidden
    assert peak == 100 * MiB  # one group's activations at a time
    recompute = tuple(GroupPlan("recompute") for _ in range(3))
    peak, step = simulate(profile, recompute, 0, 0)
    assert step == pytest.approx(3 * 1e-3 + 3 * (2e-3 + 1e-3)) and peak == 2 * MiB + 100 * MiB


def test_planner_prefers_recompute_where_the_bus_is_slow_and_offload_where_it_is_fast():
    g = GroupProfile("0", spans=(256 * MiB,), kept=0, inputs=8 * MiB, forward_s=2e-3, backward_s=4e-3)
    for bw, action in [(1e9, "recompute"), (1e12, "offload")]:
        profile = Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=bw, h2d_bps=bw)
        plan = choose(profile, 700 * MiB)
        assert plan.groups[0].action == action, (bw, plan)


def test_planner_reaches_below_recomputing_everything_by_reloading_the_first_groups():
    """The first group's backward comes last, with every gradient made: recomputing it peaks
    higher there than reloading it, so the least memory offloads it rather than recomputes."""
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3,
                     forward_extra=64 * MiB, backward_extra=32 * MiB, grads=16 * MiB, recompute_extra=48 * MiB)
    p = Profile((g,) * 4, base=0, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9)
    everything_recomputed = simulate(p, (GroupPlan("recompute_offload"),) * 4, 0, 0)[0]
    least = min(candidates(p), key=lambda plan: plan.peak)
    assert least.peak < everything_recomputed
    assert least.groups[0].action == "offload"


def test_simulate_counts_a_full_window_of_copies_in_flight_however_fast_the_bus():
    """A copy may run late (a plan's first step pins host memory): memory is modelled for
    the last max_inflight groups still holding their sources, time for the modelled bus."""
    g = GroupProfile("g", spans=(100,), kept=0, inputs=None, forward_s=1.0, backward_s=1.0)
    p = Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=1e12, h2d_bps=1e12)
    offload = (GroupPlan("offload"),) * 4
    for window, in_flight in ((0, 0), (1, 100), (2, 200)):
        trace: list = []
        simulate(p, offload, window, 0, trace)
        assert dict(trace)["forward 3"] == in_flight + 100  # plus what group 3 saves
        assert dict(trace)["loss"] == in_flight  # the window now ends with group 3


def test_simulate_charges_recomputation_its_measured_time():
    """Checkpointing stops recomputing once the last saved tensor is back: a measured
    recomputation shorter than the forward is what a recomputed group's backward adds."""
    g = GroupProfile("g", spans=(100,), kept=0, inputs=10, forward_s=4.0, backward_s=2.0)
    p = Profile((g,), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    recompute = (GroupPlan("recompute"),)
    assert simulate(p, recompute, 0, 0)[1] == 4.0 + 2.0 + 4.0  # unmeasured: its forward again
    measured = Profile((replace(g, recompute_s=1.5),), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    assert simulate(measured, recompute, 0, 0)[1] == 4.0 + 2.0 + 1.5
    assert simulate(measured, (GroupPlan(),), 0, 0)[1] == 4.0 + 2.0  # kept: no recomputation


@pytest.mark.parametrize("seed", range(40))
def test_planner_greedy_path_ends_where_no_single_move_saves_memory(seed):
    # scores are evaluated lazily, but the path still ends only at a plan no move improves
    from actoffload.budget.planner import _evaluated, _greedy_path, _moves
    profile = PROFILES[seed]
    start = _evaluated(profile, tuple(GroupPlan() for _ in profile.groups), 1, 1)
    path = _greedy_path(profile, start, 1, 1)
    end = path[-1] if path else start
    assert all(a.peak > b.peak for a, b in zip([start] + path, path))  # every step saves memory
    for i in range(len(profile.groups)):
        for move in _moves(profile, end.groups, i):
            trial = _evaluated(profile, end.groups[:i] + move + end.groups[i + len(move):], 1, 1)
            assert trial.peak >= end.peak


def test_planner_simulates_a_deep_model_far_fewer_times_than_an_exhaustive_search(monkeypatch):
    # 96 groups (48 layers, two groups each): an exhaustive greedy step simulates every move
    # of every group, about a million simulations in all; scored lazily, a few thousand
    from actoffload.budget import planner
    calls = []
    real = planner.simulate
    monkeypatch.setattr(planner, "simulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = _profile(random.Random(0)).groups
    groups = tuple(replace(layer[i % len(layer)], name=str(i)) for i in range(96))
    plans = candidates(Profile(groups, base=0, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9))
    assert len(plans) > 96 and len(calls) < 50_000


def test_planner_recomputes_a_module_whole_where_recomputing_its_parts_would_keep_too_many_inputs():
    # two modules of three parts; the middle part's inputs are three times the others' (Q, K, V).
    # Recomputing the first module's parts keeps 40 MiB of inputs, recomputing it whole 8 MiB:
    # under a budget between the two, only the whole fits without the (slow) bus
    parts = [GroupProfile(str(i), spans=(64 * MiB,), kept=0, inputs=(24 if i % 3 == 1 else 8) * MiB,
                          forward_s=1e-3, backward_s=2e-3) for i in range(6)]
    profile = Profile(tuple(parts), base=0, outside_s=0.0, d2h_bps=1e8, h2d_bps=1e8,
                      wholes=(Whole(0, 3, inputs=8 * MiB), Whole(3, 3, inputs=8 * MiB)))
    whole_first = tuple(GroupPlan(a) for a in ["recompute_whole", "inside", "inside", "keep", "keep", "keep"])
    parts_first = tuple(GroupPlan(a) for a in ["recompute"] * 3 + ["keep"] * 3)
    budget = simulate(profile, whole_first, 0, 0)[0]
    assert simulate(profile, parts_first, 0, 0)[0] == budget + 32 * MiB
    plan = choose(profile, budget)
    assert plan.groups == whole_first
    # the model runs the module as one recomputed group: its forward again, all its activations back at once
    assert plan.step_s == pytest.approx(6 * 1e-3 + 6 * 2e-3 + 3 * 1e-3)  # forward, backward, recompute


def test_simulate_charges_a_host_paced_forwards_recomputation_its_host_time():
    # a forward whose host time reaches its device time kept the device waiting: so does its
    # recomputation, whatever its device time. A device-paced forward's host time is hidden.
    def step(host_s):
        g = GroupProfile("0", spans=(8 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3,
                         recompute_s=2e-5, host_s=host_s)
        return simulate(Profile((g,), 0, 0.0, 1e9, 1e9), (GroupPlan("recompute"),), 0, 0)[1]

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
    whole = (GroupPlan("recompute_whole"), GroupPlan("inside"))
    assert simulate(profile, whole, 0, 0)[1] == pytest.approx(4e-3 + 3e-3 + 5e-4)


def test_planner_between_plans_modelled_alike_picks_the_one_recomputing_fewer_groups():
    # recomputing one module whole, or its first part alone plus the next module whole, model
    # alike where the first part's recomputation is free (checkpointing stops before its
    # matmul); the second runs checkpointing twice, which costs host time the model cannot see,
    # though it recomputes fewer bytes (6 MiB against 9)
    parts = [GroupProfile(str(i), spans=(n * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=1e-3,
                          recompute_s=0.0 if i % 2 == 0 else 1e-3) for i, n in enumerate((1, 8, 1, 4))]
    profile = Profile(tuple(parts), base=0, outside_s=0.0, d2h_bps=1e8, h2d_bps=1e8,
                      wholes=(Whole(0, 2, inputs=8 * MiB), Whole(2, 2, inputs=8 * MiB)))
    one = tuple(GroupPlan(a) for a in ("recompute_whole", "inside", "keep", "keep"))
    two = tuple(GroupPlan(a) for a in ("recompute", "keep", "recompute_whole", "inside"))
    assert simulate(profile, one, 0, 0)[1] == simulate(profile, two, 0, 0)[1]
    assert unmodelled_work(profile, one).unkept_groups == 1 and unmodelled_work(profile, two).unkept_groups == 2
    assert unmodelled_work(profile, one).redone_bytes > unmodelled_work(profile, two).redone_bytes
    plans = [Plan(g, 0, 0, *simulate(profile, g, 0, 0)) for g in (two, one)]
    assert fastest(profile, plans).groups == one


def test_simulate_frees_a_whole_modules_later_parts_before_its_earlier_parts_backward():
    # after recomputing, all of a module's activations are back (120 MiB); the first part's
    # 50 MiB of temporaries come when the later parts' backward has freed theirs (10 + 50)
    parts = [GroupProfile("0", spans=(10 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3,
                          backward_extra=50 * MiB),
             GroupProfile("1", spans=(10 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3),
             GroupProfile("2", spans=(100 * MiB,), kept=0, inputs=MiB, forward_s=1e-3, backward_s=1e-3)]
    profile = Profile(tuple(parts), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9, wholes=(Whole(0, 3, MiB),))
    trace = []
    simulate(profile, tuple(GroupPlan(a) for a in ("recompute_whole", "inside", "inside")), 0, 0, trace)
    assert dict(trace)["backward 0"] == 120 * MiB
    # with a part's own parameter gradients: the first part's backward comes after the others' are made
    profile = replace(profile, groups=(parts[0], parts[1], replace(parts[2], grads=80 * MiB)))
    trace = []
    simulate(profile, tuple(GroupPlan(a) for a in ("recompute_whole", "inside", "inside")), 0, 0, trace)
    assert dict(trace)["backward 0"] == 80 * MiB + 10 * MiB + 50 * MiB
