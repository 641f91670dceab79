"""The search: which plans to consider, and which of them to run.

:func:`candidates` makes, from a profile alone (independent of any budget), plans from
keeping everything down to the least memory, for every copy window. :func:`choose` picks
the fastest whose modelled peak fits a budget: so more budget never predicts a step slower
than alike (:func:`~.tolerances.alike`), and a budget at or above the no-offload peak keeps
everything (keeping is the fastest plan, and does the least). Among plans the model rates
alike, the one doing the least it cannot see goes first (:func:`simplest_first`).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from .actions import Action, GroupDecision
from .costmodel import MemoryPlan, Profile, Work, evaluate, unmodelled_work
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
    peak, step, moves = evaluate(profile, groups, max_inflight, prefetch)
    if not moves:
        max_inflight = prefetch = 0  # nothing crosses the bus: one plan, whatever the copy window
    return MemoryPlan(groups, max_inflight, prefetch, peak, step)


def candidates(profile: Profile) -> list[MemoryPlan]:
    """Plans from keeping everything down to the least memory, for every window and
    prefetch: the path that at each step takes the move saving the most modelled peak
    memory per modelled second added. Independent of any budget."""
    n = len(profile.groups)
    keep_all = (KEEP,) * n
    out = [evaluated(profile, keep_all, 0, 0)]
    for w in WINDOWS:
        for pf in PREFETCHES:
            out += _greedy_path(profile, evaluated(profile, keep_all, w, pf), w, pf)
    out += _families(profile)
    return out


Move = tuple[GroupDecision, ...]


def _greedy_path(profile: Profile, current: MemoryPlan, w: int, pf: int) -> list[MemoryPlan]:
    """From ``current``, take the move with the best score (modelled peak saved per second
    added) until no move saves memory.

    Scores are evaluated lazily: a move's score against an earlier plan stands in for its
    current one until the move comes first; then it is evaluated again, and taken if it
    still beats every standing score. When no standing score is positive, every move is
    evaluated afresh, so like an exhaustive search the path ends only where no move saves
    memory, though not always at the same plan (scores do rise as other moves are made).
    Evaluating every move at every step instead grows with the cube of the groups."""
    path: list[MemoryPlan] = []

    def scored(i: int, move: Move) -> tuple[float, MemoryPlan]:
        trial = evaluated(profile, current.groups[:i] + move + current.groups[i + len(move):], w, pf)
        saved = current.peak - trial.peak
        return (saved / max(trial.step_s - current.step_s, 1e-9) if saved > 0 else 0.0), trial

    def positive(moves: Iterable[tuple[int, Move]]) -> list[tuple[float, int, Move]]:
        return [(score, i, m) for i, m in moves for score in [scored(i, m)[0]] if score > 0]

    def every_move() -> list[tuple[float, int, Move]]:
        return positive((i, m) for i in range(len(profile.groups)) for m in moves(profile, current.groups, i))

    standing = every_move()
    while standing:
        standing.sort(key=lambda s: -s[0])
        _, i, move = standing.pop(0)  # (a taken move's group leaves no stale scores behind)
        score, trial = scored(i, move)
        if score <= 0 or (standing and score < standing[0][0]):
            if score > 0:
                standing.append((score, i, move))  # no longer first: judged again in its turn
            elif not standing:
                standing = every_move()
            continue
        current = trial
        path.append(current)
        # moves touching the groups it changed, or the module they are parts of, were found
        # against their old actions: found again
        changed = set(range(i, i + len(move)))
        changed |= {w.first for w in profile.wholes if changed & set(range(w.first, w.first + w.parts))}
        standing = [s for s in standing if not changed & set(range(s[1], s[1] + len(s[2])))]
        standing += positive((j, m) for j in sorted(changed) for m in moves(profile, current.groups, j))
        if not standing:
            standing = every_move()
    return path


def _families(profile: Profile) -> list[MemoryPlan]:
    """Plans the greedy path need not pass through: recompute the first k recomputable
    groups and keep the others, for every k (what a user checkpointing by hand would pick),
    also with those groups' inputs offloaded; recompute every group with the first k
    groups' inputs offloaded; where groups are the parts of modules, the same two with those
    modules recomputed whole; and offload the first j groups whole while recomputing the
    others with their inputs offloaded."""
    n = len(profile.groups)
    recomputable = [i for i, g in enumerate(profile.groups) if g.inputs is not None]
    out = []
    recompute, recompute_offload = _decision(Action.RECOMPUTE), _decision(Action.RECOMPUTE_OFFLOAD)
    for k in range(1, len(recomputable) + 1):
        first = set(recomputable[:k])
        for decision, windows in ((recompute, [(0, 0)]), (recompute_offload, [(1, 1), (2, 2)])):
            groups = tuple(decision if i in first else KEEP for i in range(n))
            out += [evaluated(profile, groups, w, pf) for w, pf in windows]
    # everything recomputed, the first k groups' inputs moved out: held longest, they are
    # what checkpointing every group keeps at the end of forward
    for k in range(1, len(recomputable)):
        first = set(recomputable[:k])
        groups = tuple((recompute_offload if i in first else recompute) if g.inputs is not None
                       else KEEP for i, g in enumerate(profile.groups))
        out += [evaluated(profile, groups, w, pf) for w, pf in ((1, 1), (2, 2))]
    # modules recomputed whole: the first k (checkpointing k blocks by hand), also with their
    # inputs moved out; and all of them, the first k's inputs moved out
    size = {w.first: w.parts for w in profile.wholes}

    def with_wholes(actions: dict[int, Action]) -> tuple[GroupDecision, ...]:
        groups = [KEEP] * n
        for j, a in actions.items():
            groups[j:j + size[j]] = [_decision(a)] + [INSIDE] * (size[j] - 1)
        return tuple(groups)

    for k in range(1, len(size) + 1):
        starts = list(size)[:k]
        out.append(evaluated(profile, with_wholes(dict.fromkeys(starts, Action.RECOMPUTE_WHOLE)), 0, 0))
        out += [evaluated(profile, with_wholes(dict.fromkeys(starts, Action.RECOMPUTE_WHOLE_OFFLOAD)), w, pf)
                for w, pf in ((1, 1), (2, 2))]
        if k < len(size):
            actions = {j: Action.RECOMPUTE_WHOLE_OFFLOAD if j in starts else Action.RECOMPUTE_WHOLE for j in size}
            out += [evaluated(profile, with_wholes(actions), w, pf) for w, pf in ((1, 1), (2, 2))]
    # the least memory: the first groups' backward comes last, with every gradient made; a group
    # reloaded there skips its recomputation's peak
    offload = _decision(Action.OFFLOAD)
    for j in range(1, n + 1):
        groups = tuple(offload if i < j or g.inputs is None else recompute_offload
                       for i, g in enumerate(profile.groups))
        out += [evaluated(profile, groups, w, pf) for w, pf in ((0, 0), (1, 1))]
    return out


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
    if g.inputs is not None and a in (Action.KEEP, Action.OFFLOAD):
        out.append((_decision(Action.RECOMPUTE),))
    if g.inputs and a in (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE):
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
            f"{least:,} bytes ({least / 2**30:.2f} GiB). Raise memory_budget, or make the step smaller."
        )
    return fastest(profile, fitting)


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
