"""The search: which plans to consider, and which of them to run.

:func:`candidates` makes, from a profile alone (independent of any budget), plans from
keeping everything down to the least memory, for every copy window; and where it is given the
modelled peaks a budget allows, the fastest plan within each, improved group by group
(:func:`improved_within`). :func:`choose` picks the fastest whose modelled peak fits a
budget: among the budget-free plans, more budget never predicts a step slower than alike
(:func:`~.tolerances.alike`), and a budget at or above the no-offload peak keeps everything
(keeping is the fastest plan, and does the least). Among plans the model rates alike, the one
doing the least it cannot see goes first (:func:`simplest_first`).
"""

from __future__ import annotations

import gc
import heapq
from contextlib import contextmanager
from functools import partial
from itertools import count
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from . import fanout
from .actions import Action, GroupDecision
from .costmodel import Change, GroupProfile, MemoryPlan, Profile, Simulation, Work, simulate_each, unmodelled_work
from .tolerances import alike

WINDOWS = (0, 1, 2)  # max_inflight
PREFETCHES = (0, 1, 2)
FRACTIONS = (0.5, 1.0)  # of a group's offloadable bytes, largest spans first

KEEP = GroupDecision(Action.KEEP)
INSIDE = GroupDecision(Action.INSIDE)
_DECISIONS: dict[tuple[Action, float], GroupDecision] = {}


def _decision(action: Action, fraction: float = 1.0) -> GroupDecision:
    """One object per decision (the cost model remembers what it read of a group per object)."""
    d = _DECISIONS.get((action, fraction))
    if d is None:
        d = _DECISIONS[(action, fraction)] = GroupDecision(action, fraction)
    return d


def evaluated(profile: Profile, groups: tuple[GroupDecision, ...], max_inflight: int, prefetch: int) -> MemoryPlan:
    """``groups`` with this copy window as a plan, costed by the model (a plan that moves no
    bytes has one copy window: none)."""
    return Simulation(profile, groups, max_inflight, prefetch).plan()


def keeping_everything(profile: Profile) -> MemoryPlan:
    """The plan that keeps every group's saves on the device: the fastest of all (nothing moved,
    nothing recomputed), so where it fits, no search can find a faster one.

    Example::

        plan = keeping_everything(profile)
        plan.peak <= budget      # then it is the plan
    """
    return evaluated(profile, (KEEP,) * len(profile.groups), 0, 0)


def candidates(profile: Profile, windows: Sequence[tuple[int, int]] | None = None,
               families: bool = True, limits: Sequence[int] = (), processes: int = 1) -> list[MemoryPlan]:
    """Plans from keeping everything down to the least memory, for every window and
    prefetch (``windows``: only these ``(max_inflight, prefetch)``; the hand-written families
    keep theirs, left out without ``families``): the path that at each step takes the move
    saving the most modelled peak memory per modelled second added. Independent of any budget,
    but for ``limits`` (modelled peaks a budget allows): for each, the fastest plan within it,
    improved group by group within it (:func:`improved_within`), where that is faster.

    ``processes``: up to this many processes search side by side, the paths of different copy
    windows apart (:func:`shares`; :mod:`~.fanout` forks them, so only a caller without
    threads, as the planning process, asks for more than one). The plans are the same.

    Example::

        plans = candidates(profile, limits=[budget], processes=3)
    """
    with _collector_paused():
        return _candidates(profile, windows, families, limits, processes)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the search runs: the search makes hundreds of
    thousands of objects that live until it ends (moves' scores, plans), and each of the
    collector's passes over them finds nothing to free (docs/budgets.md, "What planning costs").
    The little it leaves in cycles (a path's closures) is collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _candidates(profile: Profile, windows: Sequence[tuple[int, int]] | None, families: bool, limits: Sequence[int],
                processes: int) -> list[MemoryPlan]:
    windows = list(windows) if windows is not None else [(w, pf) for w in WINDOWS for pf in PREFETCHES]
    keep_all = (KEEP,) * len(profile.groups)

    def share(ws: Sequence[tuple[int, int]]) -> Callable[[], list[MemoryPlan]]:
        def plans() -> list[MemoryPlan]:
            shared, out = _Shared(), []
            for w, pf in ws:
                out += _greedy_path(profile, keep_all, w, pf, shared)
            return out
        return plans

    out = [evaluated(profile, keep_all, 0, 0)]
    # the families go to the process done with its paths first
    for plans in fanout.run([share(ws) for ws in shares(windows, processes)],
                            spare=[partial(_families, profile)] if families else []):
        out += plans
    for limit in limits:
        within = [p for p in out if p.peak <= limit]
        if within:
            best = min(within, key=lambda p: p.step_s)
            better = improved_within(profile, best, limit)
            if better.step_s < best.step_s:
                out.append(better)
    return out


def shares(windows: Sequence[tuple[int, int]], processes: int) -> list[list[tuple[int, int]]]:
    """``windows`` cut into at most ``processes`` runs, in order, each process's paths: the
    windows of one ``max_inflight`` go together (their paths score many moves for one another),
    and where there are more such runs than processes, the last ones go together (the paths
    without a copy window, the first run, take longest on their own).

    >>> shares([(0, 0), (0, 1), (1, 1), (2, 2)], 2)
    [[(0, 0), (0, 1)], [(1, 1), (2, 2)]]
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    runs: list[list[tuple[int, int]]] = []
    for window in windows:
        if runs and runs[-1][-1][0] == window[0]:
            runs[-1].append(window)
        else:
            runs.append([window])
    while len(runs) > processes:
        runs[-2:] = [runs[-2] + runs[-1]]
    return runs or [[]]


def _alternatives(g: GroupProfile) -> list[GroupDecision]:
    """Every decision a group may take on its own (not a module recomputed whole)."""
    out = [KEEP]
    if g.offloadable:
        out += [_decision(Action.OFFLOAD, f) for f in FRACTIONS]
    if g.inputs is not None:
        out.append(_decision(Action.RECOMPUTE))
    if g.inputs:
        out.append(_decision(Action.RECOMPUTE_OFFLOAD))
    if _selective_helps(g):
        out.append(_decision(Action.RECOMPUTE_SELECTIVE))
        out += [_decision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, f) for f in FRACTIONS]
    if _attention_helps(g):
        out.append(_decision(Action.RECOMPUTE_ATTENTION))
        out += [_decision(Action.RECOMPUTE_ATTENTION_OFFLOAD, f) for f in FRACTIONS]
    return out


def improved_within(profile: Profile, plan: MemoryPlan, limit: int, sweeps: int = 4) -> MemoryPlan:
    """``plan`` made faster one group at a time, its modelled peak kept within ``limit``: each
    group in turn takes the decision that shortens the modelled step, if one does, and the
    groups are gone over again while one changed (at most ``sweeps`` times). Groups of a module
    recomputed whole stay as they are.

    The search's paths only ever keep less, each move the one saving the most memory for the
    time it adds; near the least memory, where most groups must give something up, a path can
    end on a plan that keeps less than the budget needs it to: on the GPT-MoE of the budget
    sweep, at a budget within 1.5% of the least reachable peak, its fastest plan within the budget
    recomputed every group with its inputs moved out (236.6 ms modelled), where keeping a third
    of them and recomputing the rest in place fits too (179.6 ms).

    Example::

        plan = improved_within(profile, fastest_within_budget, budget - reserve)
    """
    sim = Simulation(profile, plan.groups, plan.max_inflight, plan.prefetch)
    # a group all of whose decisions were tried against the plan as it stands, none taken, would
    # take none again: it is passed over until the plan changes (version: the changes so far)
    version = 0
    settled: dict[int, int] = {}  # group -> the version it was tried at, none taken
    for _ in range(sweeps):
        changed = False
        for i, g in enumerate(profile.groups):
            if sim.groups[i].action.whole or sim.groups[i].action is Action.INSIDE or settled.get(i) == version:
                continue
            before = version
            floor = sim.peak_floor(i)  # (the same for each of the group's decisions, until one is taken)
            for d in _alternatives(g):
                if d == sim.groups[i]:
                    continue
                if floor > limit:
                    break  # the peak stands over the limit where the group changes nothing
                change = sim.change(i, (d,))
                # its peak first, then a bound of its time, before the time itself (the costly part;
                # not kept: few tries are taken, and taking one replays it, kept)
                if (sim.peak_after(change, keep=True) > limit or sim.least_step_after(change) >= sim.step_s
                        or sim.step_after(change) >= sim.step_s):
                    continue
                sim, changed, version = sim.after(change), True, version + 1
                floor = sim.peak_floor(i)
            if version == before:
                settled[i] = version
        if not changed:
            break
    return sim.plan()


# The window of the quick search a controller makes while the whole one runs in the planning
# process (:mod:`~.worker`): the offloader's default copy window.
QUICK_WINDOW = (1, 1)


def quick_candidates(profile: Profile, window: tuple[int, int] | None = None) -> list[MemoryPlan]:
    """The plans of one path (``window``, else :data:`QUICK_WINDOW`), without the hand-written
    families: a sixth or so of :func:`candidates`' time, to run until its plans come."""
    return candidates(profile, [window or QUICK_WINDOW], families=False)


Move = tuple[GroupDecision, ...]


class _Shared:
    """Scores of moves, shared by the paths of one search. Paths that took the same moves from
    the same plan stand at the same plan; and a plan moving bytes in ``k`` groups costs the
    same whatever window beyond ``k`` (one moving none, whatever window and prefetch): a move
    scored on one path is scored for every path that cannot tell the windows apart."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int, tuple[int, ...]], int] = {}  # (plan, group, move): the plan after
        self._scores: dict[tuple[int, ...], float] = {}
        self.runs: dict[tuple[int, ...], tuple] = {}  # changes' groups as run (:class:`~.costmodel.Simulation`)
        self._moves: dict[tuple[int, GroupDecision], list[Move]] = {}

    def moves(self, profile: Profile, groups: tuple[GroupDecision, ...], i: int) -> list[Move]:
        """:func:`moves`, made once per group and decision (they depend on nothing else)."""
        key = (i, groups[i])
        known = self._moves.get(key)
        if known is None:
            known = self._moves[key] = moves(profile, groups, i)
        return known

    def plan_after(self, plan: int, i: int, move: Move) -> int:
        """The plan taking ``move`` at group ``i`` leads to (plans are numbered as reached)."""
        return self._plans.setdefault((plan, i, tuple(map(id, move))), len(self._plans) + 1)

    def known(self, key: _Key) -> float | None:
        """The score of a move (:func:`_key`) a path with the same windows worked out, else None."""
        return self._scores.get(key)

    def keep(self, key: _Key, score: float) -> None:
        self._scores[key] = score

    def score(self, key: _Key, scored: Callable[[], float]) -> float:
        """The score of a move (:func:`_key`), as ``scored`` gives it where no path with the same
        windows scored it yet."""
        if key not in self._scores:
            self._scores[key] = scored()
        return self._scores[key]


# a move's (group, its decisions) at a plan (as numbered), and the windows the plan and the
# plan after the move have, as far as they matter (:class:`_Shared`)
_Key = tuple[int, ...]


def _key(plan: int, i: int, move: Move, windows: tuple[int, int, int, int]) -> _Key:
    return (plan, i, *map(id, move), *windows)


class _Standing:
    """The moves with a standing score, best first, and among equal scores the one given its
    score first (what sorting a list of them stably each time does). Moves of the groups a
    taken move changed are dropped (lazily: each group counts its changes).

    A move may stand with an upper bound of its score and the means to work the score out
    (``exact``), done only once it comes first: a score standing first is then the best, as
    every bound below it is (the order is the scores', and among equal ones the order given)."""

    def __init__(self, n: int):
        # -score, order given, group, move, its group's change count, how to work the score out
        self._heap: list[tuple[float, int, int, Move, int, Callable[[], float] | None]] = []
        self._order = count()
        self._changes = [0] * n
        self._standing = [0] * n  # per group
        self._size = 0

    def __bool__(self) -> bool:
        return self._size > 0

    def add(self, score: float, i: int, move: Move, exact: Callable[[], float] | None = None) -> None:
        heapq.heappush(self._heap, (-score, next(self._order), i, move, self._changes[i], exact))
        self._standing[i] += 1
        self._size += 1

    def _first(self) -> tuple[float, int, int, Move, int, Callable[[], float] | None]:
        heap = self._heap
        while True:
            first = heap[0]
            if first[4] != self._changes[first[2]]:
                heapq.heappop(heap)  # found against a group's old decision
            elif first[5] is not None:  # a bound: the score, worked out, takes its place in order
                heapq.heapreplace(heap, (-first[5](), *first[1:5], None))
            else:
                return first

    @property
    def best(self) -> float:
        return -self._first()[0]

    def pop(self) -> tuple[int, Move]:
        _, _, i, move, _, _ = self._first()
        heapq.heappop(self._heap)
        self._standing[i] -= 1
        self._size -= 1
        return i, move

    def drop(self, groups: Iterable[int]) -> None:
        for i in groups:
            self._size -= self._standing[i]
            self._standing[i] = 0
            self._changes[i] += 1


def _greedy_path(profile: Profile, start: tuple[GroupDecision, ...], w: int, pf: int,
                 shared: _Shared | None = None) -> list[MemoryPlan]:
    """From the plan taking ``start``'s decisions, take the move with the best score
    (modelled peak saved per second added) until no move saves memory.

    Scores are evaluated lazily: a move's score against an earlier plan stands in for its
    current one until the move comes first; then it is evaluated again, and taken if it
    still beats every standing score. When no standing score is positive, every move is
    evaluated afresh, so like an exhaustive search the path ends only where no move saves
    memory, though not always at the same plan (scores do rise as other moves are made).
    Evaluating every move at every step instead grows with the cube of the groups. A move
    is costed next to the current plan (:class:`~.costmodel.Simulation`), its time only
    where it saves memory (else its score is 0 whatever its time).

    ``shared``: scores shared with the other paths of a search (:class:`_Shared`), all from
    the same ``start``."""
    sim = Simulation(profile, start, w, pf, shared.runs if shared is not None else None)
    plan = 0  # the plan the path stands at, as numbered in shared
    path: list[MemoryPlan] = []
    standing = _Standing(len(profile.groups))
    enclosing = {j: m.first for m in profile.wholes for j in range(m.first, m.first + m.parts)}
    next_moves = (shared or _Shared()).moves

    def key_of(i: int, move: Move, change: Change) -> _Key | None:
        """Where the move's score is shared (:func:`_key`): the windows of the plan and of the
        plan after it, as far as they matter."""
        if shared is None:
            return None
        movers, after = sim.movers, sim.movers_after(change)
        return _key(plan, i, move, (min(w, movers), pf if movers else 0, min(w, after), pf if after else 0))

    def saved_by(change: Change) -> int:
        return sim.peak - sim.peak_after(change, keep=True)  # (kept: no cost, and taking it needs them)

    def bound(change: Change, saved: int) -> float:
        return saved / max(sim.least_step_after(change) - sim.step_s, 1e-9)

    def find(i: int) -> None:
        """Put the moves from group ``i`` that save memory among the standing, each with its
        score, or with a bound of it where its time (the costly part) is yet to be worked out."""
        floors: dict[int, int] = {}  # by the groups a move decides (moves of as many share it)
        for m in next_moves(profile, sim.groups, i):
            floor = floors.get(len(m))
            if floor is None:
                floor = floors[len(m)] = sim.peak_floor(i, len(m))
            if floor >= sim.peak:
                continue  # the peak stands where the move changes nothing: it saves nothing
            change = sim.change(i, m)
            key = key_of(i, m, change)
            known = shared.known(key) if shared is not None and key is not None else None
            if known is not None:
                if known > 0:
                    standing.add(known, i, m)
                continue
            saved = saved_by(change)
            if saved <= 0:
                if shared is not None and key is not None:
                    shared.keep(key, 0.0)
                continue
            standing.add(bound(change, saved), i, m, partial(exact, sim, change, saved, key, (i, m)))

    def rescored(i: int, move: Move, change: Change) -> float | None:
        """The score at the current plan of the move just taken from the standing (its time
        kept: it is likely taken); None where a bound of it falls below the best standing:
        it stands again with that bound, as it would with its score (judged in its turn)."""
        key = key_of(i, move, change)
        known = shared.known(key) if shared is not None and key is not None else None
        if known is not None:
            return known
        saved = saved_by(change)
        if saved <= 0:
            return exact(sim, change, saved, key)
        if standing:
            least = bound(change, saved)
            if least < standing.best:
                standing.add(least, i, move, partial(exact, sim, change, saved, key, (i, move)))
                return None
        return exact(sim, change, saved, key, keep=True)

    # the move scored last against the plan the path stands at, as (group, move, change): where it
    # comes first and is taken there, its change (checkpoints and replay kept) is taken as it is
    scored_here: tuple[int, Move, Change] | None = None

    def exact(base: Simulation, change: Change, saved: int, key: _Key | None, at: tuple[int, Move] | None = None,
              keep: bool = False) -> float:
        """A move's score against the plan it was found at (``base``; ``key``: where shared;
        ``keep``: its replay kept, for a move likely taken, as one found at the plan the path
        stands at, ``at``, is where it comes first); 0 where it saves nothing."""
        nonlocal scored_here
        here = at if base is sim else None
        found = (saved / max(base.step_after(change, keep or here is not None) - base.step_s, 1e-9)
                 if saved > 0 else 0.0)
        if here is not None:
            scored_here = (*here, change)
        if shared is not None and key is not None:
            shared.keep(key, found)
        return found

    def change_at(i: int, move: Move) -> Change:
        """The change taking ``move`` at group ``i`` of the plan the path stands at."""
        if scored_here is not None and scored_here[0] == i and scored_here[1] is move:
            return scored_here[2]
        return sim.change(i, move)

    def every_move() -> None:
        for i in range(len(profile.groups)):
            find(i)

    every_move()
    while standing:
        i, move = standing.pop()
        change = change_at(i, move)
        s = rescored(i, move, change)
        if s is None:
            continue
        if s <= 0 or (standing and s < standing.best):
            if s > 0:
                standing.add(s, i, move)  # no longer first: judged again in its turn
            elif not standing:
                every_move()
            continue
        sim = sim.after(change)
        scored_here = None
        path.append(sim.plan())
        if shared is not None:
            plan = shared.plan_after(plan, i, move)
        # moves touching the groups it changed, or the module they are parts of, were found
        # against their old actions: found again
        changed = set(range(i, i + len(move)))
        changed |= {enclosing[j] for j in changed if j in enclosing}
        standing.drop(changed)
        for j in sorted(changed):
            find(j)
        if not standing:
            every_move()
    return path


def _families(profile: Profile) -> list[MemoryPlan]:
    """Plans the greedy path need not pass through: recompute the first k recomputable
    groups and keep the others, for every k (what a user checkpointing by hand would pick),
    also with those groups' inputs offloaded; recompute every group with the first k
    groups' inputs offloaded; recompute the first k selectively, every group selectively
    with the first k recomputed in full, and every group selectively moving half of what it
    keeps, the first k all of it; recompute the first k keeping their attention's outputs, and
    every group recomputed with the first k keeping their attention's and moving all they keep;
    where groups are the parts of modules, the first two with those modules recomputed whole (the first k with their inputs moved out also with no copy
    out in flight: the least memory, module by module, which a search under one copy window
    finds no other way); and offload the first j groups whole while recomputing
    the others with their inputs offloaded. A family's plans run the same groups, and are
    simulated at once; those recomputing modules whole differ one from the next in one
    module: each is simulated next to the one before."""
    n = len(profile.groups)
    recomputable = [i for i, g in enumerate(profile.groups) if g.inputs is not None]
    out: list[MemoryPlan] = []
    recompute, recompute_offload = _decision(Action.RECOMPUTE), _decision(Action.RECOMPUTE_OFFLOAD)
    keep_all = (KEEP,) * n
    # the first k recomputed (windows (0, 0)), or recomputed with their inputs moved out ((1, 1), (2, 2))
    (recomputed,) = _firsts(profile, keep_all, recompute, recomputable, [(0, 0)])
    moved_out = _firsts(profile, keep_all, recompute_offload, recomputable, [(1, 1), (2, 2)])
    for plans in zip(recomputed, *moved_out):
        out += plans
    # everything recomputed, the first k groups' inputs moved out: held longest, they are
    # what checkpointing every group keeps at the end of forward
    everything = tuple(recompute if g.inputs is not None else KEEP for g in profile.groups)
    for plans in zip(*_firsts(profile, everything, recompute_offload, recomputable[:-1], [(1, 1), (2, 2)])):
        out += plans
    # selective recomputation (costly ops' outputs kept): the first k groups, the others kept (what
    # a user of torch's selective checkpointing writes); every group, the first k recomputed in
    # full (the costly ops' outputs held longest go first); and every group with what it keeps
    # moved out, the first k moving all of it and the others half
    selective = [i for i in recomputable if _selective_helps(profile.groups[i])]
    if selective:
        recompute_selective = _decision(Action.RECOMPUTE_SELECTIVE)
        (firsts,) = _firsts(profile, keep_all, recompute_selective, selective, [(0, 0)])
        every = tuple(recompute_selective if i in selective else d for i, d in enumerate(keep_all))
        (then_full,) = _firsts(profile, every, recompute, selective[:-1], [(0, 0)])
        out += firsts + then_full
        half, whole = (_decision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, f) for f in FRACTIONS)
        halves = tuple(half if i in selective else d for i, d in enumerate(keep_all))
        out += [evaluated(profile, halves, w, pf) for w, pf in ((1, 1), (2, 2))]
        for plans in zip(*_firsts(profile, halves, whole, selective, [(1, 1), (2, 2)])):
            out += plans
    # the attention's outputs kept (the matmuls run again): the first k groups, the others kept;
    # and every group recomputed, the first k keeping their attention's outputs and moving all
    # they keep (checkpointing's memory, less its costliest recomputation at long sequences)
    attention = [i for i in recomputable if _attention_helps(profile.groups[i])]
    if attention:
        (firsts,) = _firsts(profile, keep_all, _decision(Action.RECOMPUTE_ATTENTION), attention, [(0, 0)])
        out += firsts
        moved = _decision(Action.RECOMPUTE_ATTENTION_OFFLOAD, FRACTIONS[-1])
        for plans in zip(*_firsts(profile, everything, moved, attention, [(1, 1), (2, 2)])):
            out += plans
    # modules recomputed whole: the first k (checkpointing k blocks by hand), also with their
    # inputs moved out (with a copy in flight, and without); and all of them, the first k's
    # inputs moved out
    if profile.wholes:
        out += _wholes(profile)
    # the least memory: the first groups' backward comes last, with every gradient made; a group
    # reloaded there skips its recomputation's peak
    offload = _decision(Action.OFFLOAD)
    start = tuple(offload if g.inputs is None else recompute_offload for g in profile.groups)
    for plans in zip(*_firsts(profile, start, offload, range(n), [(0, 0), (1, 1)])):
        out += plans
    return out


def _firsts(profile: Profile, start: tuple[GroupDecision, ...], decision: GroupDecision, groups: Sequence[int],
            windows: Sequence[tuple[int, int]]) -> list[list[MemoryPlan]]:
    """For each copy window, the plans taking ``decision`` for the first k of ``groups``
    (k = 1, 2, ..) and ``start``'s for the others, simulated at once."""
    decisions = list(dict.fromkeys(start + (decision,)))
    plans = np.tile([decisions.index(d) for d in start], (len(groups), 1))
    taken, made = decisions.index(decision), []
    current = list(start)
    for k, j in enumerate(groups):
        plans[k:, j] = taken
        current[j] = decision
        made.append(tuple(current))
    return [[MemoryPlan(g, w if m else 0, pf if m else 0, peak, step)
             for g, peak, step, m in zip(made, peaks, steps, moving)]
            for (w, pf), (peaks, steps, moving) in zip(windows, simulate_each(profile, decisions, plans, windows))]


def _wholes(profile: Profile) -> list[MemoryPlan]:
    """The families recomputing modules whole (:func:`_families`), each plan simulated next to
    the one before."""
    out: list[MemoryPlan] = []
    keep_all = (KEEP,) * len(profile.groups)
    runs: dict[tuple[int, ...], tuple] = {}

    def families(groups: tuple[GroupDecision, ...], windows: Sequence[tuple[int, int]]) -> list[Simulation]:
        return [Simulation(profile, groups, w, pf, runs) for w, pf in windows]

    def then(sims: list[Simulation], i: int, decisions: Sequence[GroupDecision]) -> list[Simulation]:
        """Each plan with module ``i`` on taking ``decisions``, added to the plans made."""
        sims = [sim.after(sim.change(i, (d,) + _inside(profile, i, d))) for sim, d in zip(sims, decisions)]
        out.extend(sim.plan() for sim in sims)
        return sims

    whole, whole_offload = _decision(Action.RECOMPUTE_WHOLE), _decision(Action.RECOMPUTE_WHOLE_OFFLOAD)
    every_whole = list(keep_all)
    for m in profile.wholes:
        every_whole[m.first:m.first + m.parts] = (whole,) + _inside(profile, m.first, whole)
    # the first k whole, in place ((0, 0)) or their inputs moved out ((1, 1), (2, 2); and with no
    # copy out in flight, (0, 0) and (0, 1): all of them so is as little memory as recomputing
    # every part with its inputs moved out, where the peak is not a module's recomputation, for a
    # third of the recomputations and moves, and a search under one copy window (a predicted
    # workload's) has no path to it: on the loop sweep's decoder 127 and 123 ms a step against 155)
    by_hand = families(keep_all, [(0, 0), (1, 1), (2, 2), (0, 0), (0, 1)])
    all_whole = families(tuple(every_whole), [(1, 1), (2, 2)])
    for k, m in enumerate(profile.wholes):
        by_hand = then(by_hand, m.first, (whole,) + (whole_offload,) * 4)
        if k + 1 < len(profile.wholes):
            all_whole = then(all_whole, m.first, (whole_offload,) * 2)
    return out


def _inside(profile: Profile, i: int, d: GroupDecision) -> tuple[GroupDecision, ...]:
    """The decisions of the other parts of the module at ``i`` where ``d`` runs it whole."""
    return (INSIDE,) * (profile.whole_at[i].parts - 1) if d.action.whole else ()


def _selective_helps(g: GroupProfile) -> bool:
    """Whether recomputing ``g`` selectively keeps less than it saves: its costly ops' outputs
    were measured, and they and its inputs come to less than its saves (not so for a part that
    is one matmul, which saves only its input). Else the search does not try it: every move
    tried costs planning time."""
    return g.inputs is not None and g.costly is not None and g.inputs + g.costly_bytes < g.offloadable + g.kept


def _attention_helps(g: GroupProfile) -> bool:
    """Whether recomputing ``g`` keeping only its attention's outputs spares its recomputation
    anything: its fused attention calls were measured there, taking some of its time (a group
    with none, an MLP or an eager attention's, is not tried: every move tried costs planning time)."""
    return g.inputs is not None and bool(g.attention) and bool(g.attention_share)


def moves(profile: Profile, groups: tuple[GroupDecision, ...], i: int) -> list[Move]:
    """The next decisions from group ``i`` on (a group never goes back to keeping more of its
    own; a move is taken only where it saves modelled memory, so a path ends), each as the
    decisions it puts in place of ``groups[i:]``'s first ones: one group's own, or, at the
    first part of a module that may be recomputed whole, that module's."""
    g, a, fraction = profile.groups[i], groups[i].action, groups[i].fraction
    out: list[Move] = []
    if g.offloadable and a is Action.KEEP:
        out += [(_decision(Action.OFFLOAD, f),) for f in FRACTIONS]
    if a is Action.OFFLOAD and fraction < 1.0:
        out += [(_decision(Action.OFFLOAD, f),) for f in FRACTIONS if f > fraction]
    selective = _selective_helps(g)
    if selective and a in (Action.KEEP, Action.OFFLOAD):
        out.append((_decision(Action.RECOMPUTE_SELECTIVE),))
    if selective and (a in (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE_SELECTIVE)
                      or (a is Action.RECOMPUTE_SELECTIVE_OFFLOAD and fraction < 1.0)):
        out += [(_decision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, f),) for f in FRACTIONS
                if a is not Action.RECOMPUTE_SELECTIVE_OFFLOAD or f > fraction]
    # (keeping the attention's outputs is no move of the paths: offered from every state on the
    # way, its three decisions doubled the search's time on the planning benchmark; the families
    # and the improvement group by group reach it, and a plan improved so may be anywhere)
    if g.inputs is not None and a in (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE_SELECTIVE,
                                      Action.RECOMPUTE_SELECTIVE_OFFLOAD, Action.RECOMPUTE_ATTENTION):
        out.append((_decision(Action.RECOMPUTE),))
    if g.inputs and a in (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE_SELECTIVE, Action.RECOMPUTE_SELECTIVE_OFFLOAD,
                          Action.RECOMPUTE, Action.RECOMPUTE_ATTENTION, Action.RECOMPUTE_ATTENTION_OFFLOAD):
        out.append((_decision(Action.RECOMPUTE_OFFLOAD),))
    whole = profile.whole_at.get(i)
    if whole is not None:
        inside = (INSIDE,) * (whole.parts - 1)
        if not a.whole:
            out.append((_decision(Action.RECOMPUTE_WHOLE),) + inside)
        if whole.inputs and a is not Action.RECOMPUTE_WHOLE_OFFLOAD:
            out.append((_decision(Action.RECOMPUTE_WHOLE_OFFLOAD),) + inside)
    return out


class BudgetTooSmall(ValueError):
    """No plan keeps the modelled peak under the budget."""


def choose(profile: Profile, budget: int, plans: Sequence[MemoryPlan] | None = None) -> MemoryPlan:
    """The fastest plan whose modelled peak fits ``budget`` (:func:`fastest`).

    >>> from actoffload.budget.costmodel import GroupProfile
    >>> g = GroupProfile("0", spans=(4096,), kept=0, inputs=1024, forward_s=1e-3, backward_s=2e-3)
    >>> p = Profile((g, g), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    >>> choose(p, budget=1 << 20).groups[0].action is Action.KEEP   # everything fits: keep
    True
    """
    plans = candidates(profile) if plans is None else plans
    fitting = [p for p in plans if p.peak <= budget]
    if not fitting:
        least = min(p.peak for p in plans)
        raise BudgetTooSmall(
            f"no plan fits a memory budget of {budget:,} bytes: the smallest reachable peak is about "
            f"{least:,} bytes ({_size_text(least)}). Raise memory_budget, or make the step smaller."
        )
    return fastest(profile, fitting)


def _size_text(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it reaches, to two decimals, for messages (here:
    the planning process imports no torch, so not from ``settings``).

    >>> _size_text(3 << 20), _size_text(5 * 2**30 // 2), _size_text(512)
    ('3.00 MiB', '2.50 GiB', '512 B')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(nbytes) >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} B"


def fastest(profile: Profile, plans: Iterable[MemoryPlan]) -> MemoryPlan:
    """The fastest plan by the model: of those alike to the least modelled step time, the one
    doing the least the model does not see (:class:`~.costmodel.Work`). The first of
    :func:`simplest_first`."""
    return next(simplest_first(profile, plans))


def simplest_first(profile: Profile, plans: Iterable[MemoryPlan]) -> Iterator[MemoryPlan]:
    """``plans`` by modelled step time, where those alike to the fastest left
    (:func:`~.tolerances.alike`) go in the order of the work the model does not see
    (:class:`~.costmodel.Work`: bus bytes, then groups that hook or recompute, then bytes
    redone), then by time and peak: among plans it rates alike, the one that leans least on
    what it cannot see runs fastest. Lazily: choosing reads the first few of a thousand
    plans, during a step."""
    work: dict[int, Work] = {}

    def unseen(p: MemoryPlan) -> Work:
        if id(p) not in work:
            work[id(p)] = unmodelled_work(profile, p.groups)
        return work[id(p)]

    left = sorted(plans, key=lambda p: p.step_s)
    while left:
        near = 1
        while near < len(left) and alike(left[0].step_s, left[near].step_s):
            near += 1
        first = min(range(near), key=lambda i: (unseen(left[i]), left[i].step_s, left[i].peak))
        yield left.pop(first)
