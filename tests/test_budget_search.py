"""The memory budget's search, a pure function from a profile to a plan, over the cost model:
its promises hold on many random profiles (CPU only; neither touches a device)."""

import copy
import pickle
import random
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from actoffload.budget import search
from actoffload.budget.actions import Action, GroupDecision
from actoffload.budget.costmodel import (GroupProfile, MemoryPlan, Profile, Simulation, Whole, bus_bytes, host_bytes,
                                         moves_bytes, simulate, simulate_each, unmodelled_work)
from actoffload.budget.search import BudgetTooSmall, candidates, choose, fastest, simplest_first
from actoffload.budget.tolerances import TIE

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
def test_search_chosen_plan_fits_and_more_budget_is_never_slower(seed):
    # more budget never predicts a slower step than alike: the fastest fitting plan only gets
    # faster, and the plan chosen is alike to it (the one doing least the model cannot see)
    profile = PROFILES[seed]
    plans = candidates(profile)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    last_fastest = float("inf")
    for k in range(9):
        budget = least + (most - least) * k // 8
        plan = choose(profile, budget, plans)
        assert plan.peak <= budget
        assert simulate(profile, plan.groups, plan.max_inflight, plan.prefetch) == (plan.peak, plan.step_s)
        quickest = min(p.step_s for p in plans if p.peak <= budget)
        assert quickest <= last_fastest and plan.step_s <= quickest * (1 + TIE)
        last_fastest = quickest


@pytest.mark.parametrize("seed", range(40))
def test_search_budget_at_the_no_offload_peak_keeps_everything(seed):
    profile = PROFILES[seed]
    keep_all = tuple(GroupDecision() for _ in profile.groups)
    peak, step = simulate(profile, keep_all, 0, 0)
    plan = choose(profile, peak)
    assert all(p.action == Action.KEEP for p in plan.groups) and plan.step_s == pytest.approx(step)


@pytest.mark.parametrize("seed", range(40))
def test_search_budget_below_every_plan_names_the_smallest_reachable_peak(seed):
    profile = PROFILES[seed]
    least = min(p.peak for p in candidates(profile))
    with pytest.raises(BudgetTooSmall, match=f"smallest reachable peak is about {least:,} bytes"):
        choose(profile, least - 1)


def test_search_prefers_recompute_where_the_bus_is_slow_and_offload_where_it_is_fast():
    g = GroupProfile("0", spans=(256 * MiB,), kept=0, inputs=8 * MiB, forward_s=2e-3, backward_s=4e-3)
    for bw, action in [(1e9, Action.RECOMPUTE), (1e12, Action.OFFLOAD)]:
        profile = Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=bw, h2d_bps=bw)
        plan = choose(profile, 700 * MiB)
        assert plan.groups[0].action == action, (bw, plan)


def test_search_reaches_below_recomputing_everything_by_reloading_the_first_groups():
    """The first group's backward comes last, with every gradient made: recomputing it peaks
    higher there than reloading it, so the least memory offloads it rather than recomputes."""
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3,
                     forward_extra=64 * MiB, backward_extra=32 * MiB, grads=16 * MiB, recompute_extra=48 * MiB)
    p = Profile((g,) * 4, base=0, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9)
    everything_recomputed = simulate(p, (GroupDecision(Action.RECOMPUTE_OFFLOAD),) * 4, 0, 0)[0]
    least = min(candidates(p), key=lambda plan: plan.peak)
    assert least.peak < everything_recomputed
    assert least.groups[0].action == Action.OFFLOAD


@pytest.mark.parametrize("seed", range(40))
def test_search_greedy_path_ends_where_no_single_move_saves_memory(seed):
    # scores are evaluated lazily, but the path still ends only at a plan no move improves
    from actoffload.budget.search import _greedy_path, evaluated, moves
    profile = PROFILES[seed]
    start = evaluated(profile, tuple(GroupDecision() for _ in profile.groups), 1, 1)
    path = _greedy_path(profile, start.groups, 1, 1)
    end = path[-1] if path else start
    assert all(a.peak > b.peak for a, b in zip([start] + path, path))  # every step saves memory
    for i in range(len(profile.groups)):
        for move in moves(profile, end.groups, i):
            trial = evaluated(profile, end.groups[:i] + move + end.groups[i + len(move):], 1, 1)
            assert trial.peak >= end.peak


def test_search_simulates_a_deep_model_far_fewer_times_than_an_exhaustive_search(monkeypatch):
    # 96 groups (48 layers, two groups each): an exhaustive greedy step simulates every move
    # of every group, about a million simulations in all; scored lazily, a few thousand
    calls = []
    real = Simulation.change
    monkeypatch.setattr(Simulation, "change", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = _profile(random.Random(0)).groups
    groups = tuple(replace(layer[i % len(layer)], name=str(i)) for i in range(96))
    plans = candidates(Profile(groups, base=0, outside_s=1e-3, d2h_bps=20e9, h2d_bps=20e9))
    assert len(plans) > 96 and 1000 < len(calls) < 50_000


def test_search_recomputes_a_module_whole_where_recomputing_its_parts_would_keep_too_many_inputs():
    # two modules of three parts; the middle part's inputs are three times the others' (Q, K, V).
    # Recomputing the first module's parts keeps 40 MiB of inputs, recomputing it whole 8 MiB:
    # under a budget between the two, only the whole fits without the (slow) bus
    parts = [GroupProfile(str(i), spans=(64 * MiB,), kept=0, inputs=(24 if i % 3 == 1 else 8) * MiB,
                          forward_s=1e-3, backward_s=2e-3) for i in range(6)]
    profile = Profile(tuple(parts), base=0, outside_s=0.0, d2h_bps=1e8, h2d_bps=1e8,
                      wholes=(Whole(0, 3, inputs=8 * MiB), Whole(3, 3, inputs=8 * MiB)))
    whole_first = tuple(GroupDecision(a) for a in [Action.RECOMPUTE_WHOLE, Action.INSIDE, Action.INSIDE, Action.KEEP, Action.KEEP, Action.KEEP])
    parts_first = tuple(GroupDecision(a) for a in [Action.RECOMPUTE] * 3 + [Action.KEEP] * 3)
    budget = simulate(profile, whole_first, 0, 0)[0]
    assert simulate(profile, parts_first, 0, 0)[0] == budget + 32 * MiB
    plan = choose(profile, budget)
    assert plan.groups == whole_first
    # the model runs the module as one recomputed group: its forward again, all its activations back at once
    assert plan.step_s == pytest.approx(6 * 1e-3 + 6 * 2e-3 + 3 * 1e-3)  # forward, backward, recompute


def test_search_the_least_memory_recomputes_modules_whole_where_that_peaks_no_higher_than_their_parts():
    # two modules of three parts, the step's peak in the head and loss (512 MiB beyond the
    # groups): recomputing every module whole with its inputs moved out, in step with compute,
    # peaks where recomputing every part so does, and moves a third of the inputs and opens a
    # third of the recomputations; the least memory is then that plan (on the loop sweep's
    # decoder on an H200, 128 ms a step against 155, the same 5.62 GiB reserved)
    parts = [GroupProfile(str(i), spans=(16 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
             for i in range(6)]
    profile = Profile(tuple(parts), base=0, outside_s=1e-3, d2h_bps=1e9, h2d_bps=1e9, outside_extra=512 * MiB,
                      wholes=(Whole(0, 3, inputs=8 * MiB), Whole(3, 3, inputs=8 * MiB)))
    RO, WO, IN = (GroupDecision(a) for a in (Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_WHOLE_OFFLOAD, Action.INSIDE))
    every_part, every_whole = (RO,) * 6, (WO, IN, IN) * 2
    by_parts, by_wholes = (simulate(profile, g, 0, 0) for g in (every_part, every_whole))
    assert by_wholes[0] == by_parts[0] and by_wholes[1] < by_parts[1]
    # the paths under one copy window (as a workload predicted from another searches), the
    # families under theirs: only a family reaches it (reloading ahead, the faster)
    plans = candidates(profile, [(1, 1)])
    least = min(plans, key=lambda p: (p.peak, p.step_s))  # the controller's least memory
    assert least.key == (every_whole, 0, 1) and least.peak == by_parts[0]
    assert (every_whole, 0, 0) in {p.key for p in plans}


def test_search_between_plans_modelled_alike_picks_the_one_recomputing_fewer_groups():
    # recomputing one module whole, or its first part alone plus the next module whole, model
    # alike where the first part's recomputation is free (checkpointing stops before its
    # matmul); the second runs checkpointing twice, which costs host time the model cannot see,
    # though it recomputes fewer bytes (6 MiB against 9)
    parts = [GroupProfile(str(i), spans=(n * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=1e-3,
                          recompute_s=0.0 if i % 2 == 0 else 1e-3) for i, n in enumerate((1, 8, 1, 4))]
    profile = Profile(tuple(parts), base=0, outside_s=0.0, d2h_bps=1e8, h2d_bps=1e8,
                      wholes=(Whole(0, 2, inputs=8 * MiB), Whole(2, 2, inputs=8 * MiB)))
    one = tuple(GroupDecision(a) for a in (Action.RECOMPUTE_WHOLE, Action.INSIDE, Action.KEEP, Action.KEEP))
    two = tuple(GroupDecision(a) for a in (Action.RECOMPUTE, Action.KEEP, Action.RECOMPUTE_WHOLE, Action.INSIDE))
    assert simulate(profile, one, 0, 0)[1] == simulate(profile, two, 0, 0)[1]
    assert unmodelled_work(profile, one).unkept_groups == 1 and unmodelled_work(profile, two).unkept_groups == 2
    assert unmodelled_work(profile, one).redone_bytes > unmodelled_work(profile, two).redone_bytes
    plans = [MemoryPlan(g, 0, 0, *simulate(profile, g, 0, 0)) for g in (two, one)]
    assert fastest(profile, plans).groups == one


def test_search_tries_the_plan_moving_fewer_bytes_among_those_the_model_rates_alike():
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
    off, keep = GroupDecision(Action.OFFLOAD), GroupDecision()
    mover = MemoryPlan((off, off), 1, 1, peak=10, step_s=1.0)
    lighter = MemoryPlan((off, keep), 1, 1, peak=20, step_s=1.0 + TIE / 2)
    slower = MemoryPlan((keep, keep), 0, 0, peak=30, step_s=1.0 + 2 * TIE)
    assert list(simplest_first(profile, [slower, mover, lighter])) == [lighter, mover, slower]
    assert fastest(profile, [slower, mover, lighter]) == lighter  # one rule for both


def test_search_among_plans_rated_alike_bus_bytes_come_before_groups_not_kept():
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
    recompute = GroupDecision(Action.RECOMPUTE)
    moving = MemoryPlan((GroupDecision(Action.OFFLOAD), GroupDecision()), 1, 1, peak=10, step_s=1.0)  # 64 MiB moved
    still = MemoryPlan((recompute, recompute), 0, 0, peak=20, step_s=1.0)  # two groups not kept, none moved
    assert list(simplest_first(profile, [moving, still])) == [still, moving]


def test_search_tries_the_plan_with_fewer_groups_not_kept_among_those_the_model_rates_alike():
    # a recomputed part costs host time the model does not see (checkpointing, hooks): between
    # two plans moving nothing that the model rates alike, the one recomputing fewer groups goes first
    g = GroupProfile("g", spans=(64 * MiB,), kept=0, inputs=8 * MiB, forward_s=1e-3, backward_s=2e-3)
    profile = Profile((g, g, g), base=0, outside_s=0.0, d2h_bps=20e9, h2d_bps=20e9)
    recompute, keep = GroupDecision(Action.RECOMPUTE), GroupDecision()
    parts = MemoryPlan((recompute, recompute, keep), 0, 0, peak=10, step_s=1.0)
    one = MemoryPlan((recompute, keep, keep), 0, 0, peak=20, step_s=1.0 + TIE / 2)
    assert list(simplest_first(profile, [parts, one])) == [one, parts]


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_whether_a_plan_moves_bytes_is_whether_it_moves_a_byte_across_the_bus(seed):
    # moves_bytes reads a plan group by group (the controller asks it of every candidate as a
    # step begins); bus_bytes and host_bytes add up the whole plan, modules run whole made one group
    profile = PROFILES[seed]
    plans = [p.groups for p in candidates(profile)]
    rng = random.Random(seed)
    plain = [a for a in Action if not a.whole and a is not Action.INSIDE]
    for _ in range(50):
        plans.append(tuple(GroupDecision(rng.choice(plain), rng.choice((0.5, 1.0))) for _ in profile.groups))
    assert any(moves_bytes(profile, g) for g in plans) and not all(moves_bytes(profile, g) for g in plans)
    for groups in plans:
        assert moves_bytes(profile, groups) == (bus_bytes(profile, groups) > 0) == (host_bytes(profile, groups) > 0)


def test_search_a_decision_takes_a_plain_action_name():
    # tools and older callers name actions: the decision holds the Action
    assert GroupDecision(Action.RECOMPUTE.value) == GroupDecision(Action.RECOMPUTE)
    assert GroupDecision(Action.RECOMPUTE.value).action is Action.RECOMPUTE


def test_search_examples_in_its_docstrings_hold():
    import doctest

    assert doctest.testmod(search).failed == 0


# ---------------------------------------------------------------- the fast search against a plain one
def _varied(seed: int) -> Profile:
    """A small random profile: recomputed times and host pace, modules of parts, a bus from
    far too slow to far too fast (where waits dominate, clocks grow long)."""
    rng = random.Random(seed)
    profile = _profile(rng)
    groups = tuple(replace(g, recompute_s=g.forward_s * rng.uniform(0.2, 1.0) if rng.random() < 0.5 else None,
                           host_s=g.forward_s * rng.uniform(0.5, 1.5) if rng.random() < 0.3 else None,
                           recompute_extra=rng.randint(0, 16) * MiB) for g in profile.groups)
    bw = 10 ** rng.uniform(3, 12)
    return replace(profile, groups=groups, d2h_bps=bw, h2d_bps=bw * rng.uniform(0.5, 2.0),
                   outside_extra=rng.randint(0, 64) * MiB)


def _plain_candidates(profile: Profile) -> list[MemoryPlan]:
    """:func:`candidates` the plain way: every plan simulated afresh (:func:`simulate`), the
    standing moves a list sorted stably by score each time, every family plan on its own."""

    def plan(groups, w, pf):
        peak, step = simulate(profile, groups, w, pf)
        moves = moves_bytes(profile, groups)
        return MemoryPlan(tuple(groups), w if moves else 0, pf if moves else 0, peak, step)

    def path(w, pf):
        current, out = plan(keep_all, w, pf), []

        def scored(i, move):
            trial = plan(current.groups[:i] + move + current.groups[i + len(move):], w, pf)
            saved = current.peak - trial.peak
            return saved / max(trial.step_s - current.step_s, 1e-9) if saved > 0 else 0.0

        def every_move():
            return [(s, i, m) for i in range(n) for m in search.moves(profile, current.groups, i)
                    for s in [scored(i, m)] if s > 0]

        standing = every_move()
        while standing:
            standing.sort(key=lambda s: -s[0])
            _, i, move = standing.pop(0)
            s = scored(i, move)
            if s <= 0 or (standing and s < standing[0][0]):
                if s > 0:
                    standing.append((s, i, move))
                elif not standing:
                    standing = every_move()
                continue
            current = plan(current.groups[:i] + move + current.groups[i + len(move):], w, pf)
            out.append(current)
            changed = set(range(i, i + len(move)))
            changed |= {m.first for m in profile.wholes if changed & set(range(m.first, m.first + m.parts))}
            standing = [t for t in standing if not changed & set(range(t[1], t[1] + len(t[2])))]
            standing += [(s, j, m) for j in sorted(changed) for m in search.moves(profile, current.groups, j)
                         for s in [scored(j, m)] if s > 0]
            if not standing:
                standing = every_move()
        return out

    def firsts(start, decision, at, windows):
        made, current = [], list(start)
        for j in at:
            current[j] = decision
            made.append(tuple(current))
        return [[plan(groups, w, pf) for groups in made] for w, pf in windows]

    def with_wholes(actions):
        groups = list(keep_all)
        for m in profile.wholes:
            if m.first in actions:
                groups[m.first:m.first + m.parts] = [search._decision(actions[m.first])] + [search.INSIDE] * (m.parts - 1)
        return tuple(groups)

    n = len(profile.groups)
    keep_all = (search.KEEP,) * n
    out = [plan(keep_all, 0, 0)] + [p for w in (0, 1, 2) for pf in (0, 1, 2) for p in path(w, pf)]
    recomputable = [i for i, g in enumerate(profile.groups) if g.inputs is not None]
    R, RO, OFF = (search._decision(a) for a in (Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD, Action.OFFLOAD))
    for plans in zip(*firsts(keep_all, R, recomputable, [(0, 0)]), *firsts(keep_all, RO, recomputable, [(1, 1), (2, 2)])):
        out += plans
    everything = tuple(R if g.inputs is not None else search.KEEP for g in profile.groups)
    for plans in zip(*firsts(everything, RO, recomputable[:-1], [(1, 1), (2, 2)])):
        out += plans
    firsts_whole = [m.first for m in profile.wholes]
    for k in range(1, len(firsts_whole) + 1):
        out.append(plan(with_wholes(dict.fromkeys(firsts_whole[:k], Action.RECOMPUTE_WHOLE)), 0, 0))
        out += [plan(with_wholes(dict.fromkeys(firsts_whole[:k], Action.RECOMPUTE_WHOLE_OFFLOAD)), w, pf)
                for w, pf in ((1, 1), (2, 2), (0, 0), (0, 1))]
        if k < len(firsts_whole):
            actions = {f: Action.RECOMPUTE_WHOLE_OFFLOAD if f in firsts_whole[:k] else Action.RECOMPUTE_WHOLE
                       for f in firsts_whole}
            out += [plan(with_wholes(actions), w, pf) for w, pf in ((1, 1), (2, 2))]
    start = tuple(OFF if g.inputs is None else RO for g in profile.groups)
    for plans in zip(*firsts(start, OFF, range(n), [(0, 0), (1, 1)])):
        out += plans
    return out


@pytest.mark.parametrize("seed", range(12))
def test_search_fast_candidates_are_the_plain_ones_to_the_last_bit(seed):
    # the search costs plans next to one another, sums calm runs of the clock, shares scores
    # between paths, scores found moves lazily and simulates families at once: the same plans,
    # the same bytes and seconds, in the same order, as simulating every plan afresh
    profile = _varied(seed)
    fast, plain = candidates(profile), _plain_candidates(profile)
    assert [(p.key, p.peak, p.step_s) for p in fast] == [(p.key, p.peak, p.step_s) for p in plain]


@pytest.mark.parametrize("seed", range(8))
def test_search_a_plan_costed_next_to_another_is_the_plan_simulated_afresh(seed):
    # chains of moves, each costed next to the plan before (peak, step) and simulated next to
    # it (Simulation.after), against simulate() of the same plan
    rng = random.Random(seed)
    profile = _varied(100 + seed)
    n = len(profile.groups)
    for w, pf in ((0, 0), (0, 2), (1, 1), (2, 0), (2, 2)):
        sim = Simulation(profile, (search.KEEP,) * n, w, pf)
        for _ in range(2 * n):
            i = rng.randrange(n)
            options = search.moves(profile, sim.groups, i)
            if not options:
                continue
            move = rng.choice(options)
            change = sim.change(i, move)
            groups = sim.groups[:i] + move + sim.groups[i + len(move):]
            assert (sim.peak_after(change), sim.step_after(change)) == simulate(profile, groups, w, pf)
            sim = sim.after(change)
            assert (sim.peak, sim.step_s) == simulate(profile, groups, w, pf)


def test_search_families_simulated_at_once_are_each_simulated_afresh():
    rng = random.Random(7)
    decisions = [search.KEEP] + [search._decision(a) for a in (Action.OFFLOAD, Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD)]
    for seed in range(6):
        profile = _varied(200 + seed)
        n = len(profile.groups)
        plans = np.array([[rng.randrange(len(decisions)) if profile.groups[j].inputs is not None else rng.randrange(2)
                           for j in range(n)] for _ in range(5)])
        windows = ((0, 1), (1, 0), (2, 2))
        for (w, pf), (peaks, steps, _) in zip(windows, simulate_each(profile, decisions, plans, windows)):
            for row, peak, step in zip(plans, peaks, steps):
                assert (peak, step) == simulate(profile, [decisions[d] for d in row], w, pf)


def test_a_group_decision_is_one_object_per_action_and_fraction_in_each_process():
    """A plan's identity (a tuple of decisions) is looked up thousands of times per choice, so
    equal decisions are one object, however made (called, replaced, copied, unpickled), and hash
    and compare as objects; what the planning process sends back becomes this process's object
    (an enum's hash is its name's, which differs between processes)."""
    d = GroupDecision(Action.OFFLOAD, 0.5)
    assert d is GroupDecision("offload", 0.5) is pickle.loads(pickle.dumps(d)) is copy.deepcopy(d)
    assert replace(d, fraction=0.25) is GroupDecision(Action.OFFLOAD, 0.25) is not d
    assert GroupDecision() is GroupDecision(Action.KEEP, 1.0) and d != GroupDecision(Action.OFFLOAD, 0.25)
    theirs = subprocess.run([sys.executable, "-c", "import pickle, sys; from actoffload.budget.actions import "
                             "Action, GroupDecision; sys.stdout.buffer.write(pickle.dumps("
                             "{GroupDecision(Action.RECOMPUTE): 1}))"], capture_output=True, check=True,
                            env={"PYTHONHASHSEED": "1", "PATH": ""}, cwd=str(Path(__file__).parents[1]))
    assert pickle.loads(theirs.stdout)[GroupDecision(Action.RECOMPUTE)] == 1


def test_a_group_decision_made_on_two_threads_at_once_is_one_object():
    """The planning process's answers are unpickled on a thread of their own while the step's
    thread makes decisions: the same decision made on both at once is still one object (two would
    be two plans that do the same). Threads switched as often as they can be, over fresh fractions:
    without a lock some decisions came out twice (10 to 54 of 20,000 on the CPU machine)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        fractions = [0.123456 + i * 1e-9 for i in range(20000)]
        made: list[list] = [[], []]
        start = threading.Barrier(2)

        def make(k: int) -> None:
            start.wait()
            made[k].extend(GroupDecision(Action.OFFLOAD, f) for f in fractions)

        threads = [threading.Thread(target=make, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert all(a is b for a, b in zip(*made)) and len(made[0]) == len(fractions)


@pytest.mark.parametrize("seed", range(40))
def test_search_a_plan_improved_within_a_limit_stays_within_it_and_no_group_alone_makes_it_faster(seed):
    from actoffload.budget.search import _alternatives, evaluated, improved_within
    profile = PROFILES[seed]
    plans = candidates(profile)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    for limit in (least, (least + most) // 2, least + (most - least) // 10):
        start = min((p for p in plans if p.peak <= limit), key=lambda p: p.step_s)
        better = improved_within(profile, start, limit, sweeps=100)
        again = evaluated(profile, better.groups, better.max_inflight, better.prefetch)
        assert (better.peak, better.step_s) == (again.peak, again.step_s)  # as simulated afresh
        assert better.peak <= limit and better.step_s <= start.step_s
        for i, g in enumerate(profile.groups):
            if better.groups[i].action.whole or better.groups[i].action is Action.INSIDE:
                continue
            for d in _alternatives(g):
                trial = evaluated(profile, better.groups[:i] + (d,) + better.groups[i + 1:], better.max_inflight,
                                  better.prefetch)
                assert trial.peak > limit or trial.step_s >= better.step_s * (1 - 1e-12), (i, d)


def test_search_candidates_for_a_limit_add_the_fastest_plan_within_it_improved():
    from actoffload.budget.search import improved_within
    profile = PROFILES[24]
    plans = candidates(profile)
    limit = sorted({p.peak for p in plans})[2]  # near the least memory, where the paths keep too little
    best = min((p for p in plans if p.peak <= limit), key=lambda p: p.step_s)
    with_limit = candidates(profile, limits=[limit])
    better = improved_within(profile, best, limit)
    assert better.step_s < 0.95 * best.step_s
    assert with_limit == plans + [better] and choose(profile, limit, with_limit) == better


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="the search runs side by side in forked processes")
def test_search_in_several_processes_makes_the_same_plans_in_the_same_order():
    """The paths of different copy windows apart, in forked processes: every plan, its modelled
    peak and time to the last bit, in the order one process makes them, and with them what a
    budget improves and chooses (in a Python of its own, where no other test's thread keeps
    it from forking; that it forked, its children's process ids say)."""
    from test_budget_fanout import WATCH_FORKS, in_a_fresh_process
    in_a_fresh_process(WATCH_FORKS, """
        import sys
        sys.path[:0] = ["tests", "benchmarks"]
        from bench_planning import synthetic
        from test_budget_search import PROFILES
        from actoffload.budget import search
        for profile in PROFILES[::5] + [synthetic(12, parts=True, selective=True)]:
            plans = search.candidates(profile)
            peaks = sorted({p.peak for p in plans})
            limit = peaks[min(2, len(peaks) - 1)]
            alone = search.candidates(profile, limits=[limit])
            for processes in (2, 3, 5):
                fanout.run = watched
                apart = search.candidates(profile, limits=[limit], processes=processes)
                fanout.run = run
                assert [(p.key, p.peak, p.step_s) for p in apart] == [(p.key, p.peak, p.step_s) for p in alone]
                assert search.choose(profile, limit, apart) == search.choose(profile, limit, alone)
        assert len(forked - {os.getpid()}) >= 2, forked
    """)


def test_search_shares_keep_a_max_inflights_windows_together_and_the_families_last():
    windows = [(w, pf) for w in search.WINDOWS for pf in search.PREFETCHES]
    assert search.shares(windows, 1) == [windows]
    assert search.shares(windows, 2) == [windows[:3], windows[3:]]
    assert search.shares(windows, 3) == search.shares(windows, 8) == [windows[:3], windows[3:6], windows[6:]]
    assert search.shares([(1, 1)], 4) == [[(1, 1)]]
    with pytest.raises(ValueError, match="processes must be at least 1"):
        candidates(PROFILES[0], processes=0)


def test_budget_too_small_says_the_peak_in_a_unit_it_reaches():
    """A budget of a few MiB (the CPU's, where only the groups' saves count) is said in MiB, not
    as 0.00 GiB."""
    g = GroupProfile("0", spans=(3 << 20,), kept=0, inputs=1024, forward_s=1e-3, backward_s=2e-3)
    p = Profile((g, g), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    with pytest.raises(BudgetTooSmall, match=r"bytes \(3\.00 MiB\)\. Raise memory_budget"):
        choose(p, budget=1)
