"""The memory-budget planner: a pure function from a measured profile to a plan.

A plan says, for each group of a step, what happens to what it saves, and how far the
fast path's copies may run ahead:

- ``keep``: everything stays on the device (no bus, no recompute);
- ``offload``: its largest spans, up to a fraction of its offloadable bytes, move to host
  memory and come back for backward (bus time, hidden behind compute where it can be);
- ``recompute``: the group's module runs under activation checkpointing, so it saves only
  its inputs, and its forward runs again in backward (compute time); ``recompute_offload``
  also moves those inputs to host memory;
- ``recompute_whole`` (and ``recompute_whole_offload``): where groups are the parts of one
  module (``ao.wrap(blocks, off, parts=...)``), that module runs whole under checkpointing,
  as one group: it keeps one set of inputs instead of each part's, and its parts, marked
  ``inside``, are no groups. Recomputing a whole block costs less host time than
  recomputing its parts one by one, and backward then holds all its activations at once.

:func:`choose` picks, among a set of candidate plans that does not depend on the budget,
the fastest whose modelled peak fits: so more budget never predicts a slower step, and a
budget at or above the no-offload peak keeps everything (keeping is the fastest plan).
:func:`simulate` is the model: device memory over the step phase by phase, and the step
time from the compute stream, the two copy streams and the ordering between them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterable, NamedTuple, Sequence

ACTIONS = ("keep", "offload", "recompute", "recompute_offload", "recompute_whole", "recompute_whole_offload", "inside")
WHOLE = ("recompute_whole", "recompute_whole_offload")  # on a module's first part; the others are "inside"
WINDOWS = (0, 1, 2)  # max_inflight
PREFETCHES = (0, 1, 2)
FRACTIONS = (0.5, 1.0)  # of a group's offloadable bytes, largest spans first
HOST_PACED = 0.9  # a forward whose host time is at least this share of its device time ran at the host's pace


@dataclass(frozen=True)
class GroupProfile:
    """What one group of a step did when profiled.

    ``spans``: the bytes of each span it could offload, largest first; ``kept``: bytes it
    saves that stay whatever the plan (small, vetoed, not marked); ``inputs``: bytes it saves
    when recomputed (its module's inputs), ``None`` if it cannot be (not a wrapped module);
    ``forward_s``/``backward_s``: compute time of its forward and of its backward (without
    recompute); ``forward_extra``: the most bytes allocated during its forward above what was
    allocated when it began (as profiled, recomputed: temporaries, among them what it would
    save); ``backward_extra``: the most bytes allocated during its backward beyond what the
    model counts (temporaries, gradients of activations); ``recompute_extra``: how much
    higher memory goes while backward runs its forward again (recomputed plans only: a
    group moved out and reloaded skips that peak); ``grads``: bytes of parameter gradients
    its backward allocates; ``recompute_s``: how long backward took to run its forward again
    (less than ``forward_s``: checkpointing stops once the last saved tensor is back);
    ``host_s``: the host's time for its forward (``None`` where the host is the device).
    """

    name: str
    spans: tuple[int, ...]
    kept: int
    inputs: int | None
    forward_s: float
    backward_s: float
    forward_extra: int = 0
    backward_extra: int = 0
    grads: int = 0
    recompute_extra: int = 0
    recompute_s: float | None = None  # measured; checkpoint stops recomputing after the last save
    reached: bool = True  # backward unpacked something it saved
    host_s: float | None = None

    @property
    def recompute_time(self) -> float:
        """Seconds backward spends running its forward again (its forward's, if not measured).
        A forward that ran at the host's pace (its host time reached ``HOST_PACED`` of its
        device time: the device waited for its kernels, as in a MoE's Python loop over
        experts) runs again at that pace: it is charged its forward's host time where that is
        longer, which holds the forward-side work of hooks and checkpointing too. A forward
        that reads a value back (a MoE's routing) waits for the device's queue, and counts as
        host-paced: recomputed in backward, it makes the device wait as well. Measured on an
        H200, a MoE block's Q/K/V part, whose recomputation keeps the device busy for 0.02
        ms, added 1 ms to the step."""
        device = self.forward_s if self.recompute_s is None else self.recompute_s
        if self.host_s is not None and self.host_s >= HOST_PACED * self.forward_s:
            return max(device, self.host_s)
        return device

    @cached_property  # read in every simulation step: summed once
    def offloadable(self) -> int:
        return sum(self.spans)

    def moved(self, fraction: float) -> int:
        """Bytes moved when offloading up to ``fraction`` of the offloadable bytes, largest
        spans first (a span moves whole)."""
        cap, moved = fraction * self.offloadable, 0
        for n in self.spans:
            if moved + n > cap + 1e-9 and moved > 0:
                break
            moved += n
        return moved


@dataclass(frozen=True)
class Whole:
    """A module whose parts are the groups ``first .. first + parts - 1``, which a plan may
    recompute whole: then it saves its own ``inputs`` (bytes) instead of each part's."""

    first: int
    parts: int
    inputs: int


@dataclass(frozen=True)
class Profile:
    """A profiled step: its groups in forward order, and the step around them.

    ``base``: bytes allocated when the first group opened (parameters, optimizer state,
    inputs, what ran before); ``outside_s``: compute time between the last group's forward
    and the first group's backward (head, loss); ``d2h_bps``/``h2d_bps``: copy bandwidth
    each way.
    """

    groups: tuple[GroupProfile, ...]
    base: int
    outside_s: float
    d2h_bps: float
    h2d_bps: float
    outside_extra: int = 0  # the most the head and loss allocate between forward and backward
    wholes: tuple[Whole, ...] = ()  # modules whose parts the groups are, in forward order

    @cached_property  # read in every simulation step
    def whole_at(self) -> dict[int, Whole]:
        """Each module that may be recomputed whole, by its first group."""
        return {w.first: w for w in self.wholes}


@dataclass(frozen=True)
class GroupPlan:
    action: str = "keep"
    fraction: float = 1.0  # of the offloadable bytes (``offload``)

    def moved(self, g: GroupProfile) -> int:
        """Bytes it moves to host memory (a whole module's inputs: those of its first part)."""
        if self.action == "offload":
            return g.moved(self.fraction)
        if self.action in ("recompute_offload", "recompute_whole_offload"):
            return g.inputs or 0
        return 0

    def resident(self, g: GroupProfile) -> int:
        """Bytes the group holds on the device between its forward and its backward."""
        if self.action == "keep":
            return g.offloadable + g.kept
        if self.action == "offload":
            return g.offloadable - g.moved(self.fraction) + g.kept
        if self.action in ("recompute", "recompute_whole"):
            return g.inputs or 0
        return 0

    @property
    def recomputed(self) -> bool:
        """Its activations come back by running its forward again (as a part, or inside a whole)."""
        return self.action.startswith("recompute") or self.action == "inside"


@dataclass(frozen=True)
class Plan:
    groups: tuple[GroupPlan, ...]
    max_inflight: int = 0
    prefetch: int = 0
    peak: int = 0  # modelled, bytes
    step_s: float = 0.0  # modelled

    def describe(self, profile: Profile) -> list[dict]:
        """One row per group: name, action and bytes, for ``stats()["plan"]`` (a module run
        whole: on its first part; its other parts show 0)."""
        rows = []
        for i, (g, p) in enumerate(zip(profile.groups, self.groups)):
            if p.action in WHOLE:
                g = replace(g, inputs=profile.whole_at[i].inputs)
            rows.append({"group": g.name, "action": p.action, "offloaded_bytes": p.moved(g),
                         "resident_bytes": p.resident(g)})
        return rows


def simulate(profile: Profile, groups: Sequence[GroupPlan], max_inflight: int, prefetch: int,
             trace: list[tuple[str, int]] | None = None) -> tuple[int, float]:
    """Modelled ``(peak bytes, step seconds)`` of ``groups`` with this window and prefetch.

    Memory, checked at each group's forward and backward: ``base``, what the earlier
    groups left resident, copy sources in flight (the last ``max_inflight`` groups moved:
    a copy may run late), what backward has reloaded ahead, gradients so far, and the
    group's own activations and measured extra (temporaries).
    Time: the forward runs group after group; a group's copy out starts when it is done and
    the copy stream is free; compute waits for the oldest copy once more than
    ``max_inflight`` groups hold their sources. Groups still copying out when backward
    begins are used in place. In backward a group's reload starts when backward reaches
    it or the group ``prefetch`` later, and its backward starts once the reload is done;
    recomputing adds the group's recomputation to its backward. ``trace`` collects the modelled
    bytes at each checkpoint: ``("forward 3", bytes)``, ``("loss", bytes)``, ...
    """
    profile, groups = as_run(profile, groups)
    gs = profile.groups
    n = len(gs)
    resident = [p.resident(g) for g, p in zip(gs, groups)]
    moved = [p.moved(g) for g, p in zip(gs, groups)]
    recompute = [p.action.startswith("recompute") for p in groups]
    base, d2h_bps, h2d_bps = profile.base, profile.d2h_bps, profile.h2d_bps
    # the three streams' clocks; copies out in order, so they also end in order
    compute = d2h = 0.0
    copying: deque[tuple[int, float]] = deque()  # (group, copy end) of copies not known done
    peak = base
    held = 0  # bytes the groups done so far keep on the device
    # Memory counts the worst case of the window: a copy that runs late (the first step of a
    # plan pins host memory) leaves the last max_inflight groups holding their sources.
    window: list[int] = []
    in_flight = 0  # bytes of the window's groups
    for i, g in enumerate(gs):
        # forward_extra was measured recomputed, where what the group saves was temporary:
        # saving it keeps those bytes (at least) alive until the group ends
        saves = 0 if recompute[i] else g.offloadable + g.kept
        at = base + held + in_flight + (saves if saves > g.forward_extra else g.forward_extra)
        if at > peak:
            peak = at
        if trace is not None:
            trace.append((f"forward {i}", at))
        compute += g.forward_s
        held += resident[i]
        if moved[i]:
            d2h = (compute if compute > d2h else d2h) + moved[i] / d2h_bps
            copying.append((i, d2h))
            if max_inflight:
                window.append(i)
                if len(window) > max_inflight:
                    del window[0]
                in_flight = sum(moved[j] for j in window)
        while copying and copying[0][1] <= compute:
            copying.popleft()  # done: sources freed
        while len(copying) > max_inflight:
            _, end = copying.popleft()
            if end > compute:
                compute = end  # compute waits for the oldest copy
    at = base + held + in_flight + profile.outside_extra
    if at > peak:
        peak = at
    if trace is not None:
        trace.append(("loss", at))
    compute += profile.outside_s
    # sources still live when backward begins are used in place, not reloaded: for time, those
    # the model has still copying; for memory, the whole window (held until their backward)
    in_place = {j for j, _ in copying}
    for j in window:
        resident[j] += moved[j]
        held += moved[j]
    peak = max(peak, base + held)
    in_window = set(window)
    grads = 0
    ready = [-1.0] * n  # group -> when its bytes are back on the device (-1: not started)
    h2d = compute
    for i in range(n - 1, -1, -1):
        g = gs[i]
        for j in range(i, max(-1, i - prefetch - 1), -1):  # reaching i: its reload, and prefetch
            if ready[j] < 0:
                if moved[j] and j not in in_place:
                    h2d = (compute if compute > h2d else h2d) + moved[j] / h2d_bps
                    ready[j] = h2d
                else:
                    ready[j] = 0.0
        held -= resident[i]
        ahead = 0
        for j in range(max(0, i - prefetch), i):
            if ready[j] >= 0 and j not in in_window:
                ahead += moved[j]
        # its activations are all back (reloaded or recomputed) while its backward runs
        at = (base + held + ahead + grads + g.offloadable + g.kept + g.backward_extra
              + (g.recompute_extra if recompute[i] else 0))
        if at > peak:
            peak = at
        if trace is not None:
            trace.append((f"backward {i}", at))
        if ready[i] > compute:
            compute = ready[i]
        compute += g.backward_s + (g.recompute_time if recompute[i] else 0.0)
        grads += g.grads
    return peak, compute


def as_run(profile: Profile, groups: Sequence[GroupPlan]) -> tuple[Profile, Sequence[GroupPlan]]:
    """The groups as the step runs them: each module recomputed whole becomes one group (its
    parts' bytes and times together, its first part's inputs), so that :func:`simulate`
    models it like any recomputed group."""
    if not any(p.action in WHOLE for p in groups):
        return profile, groups
    gs, ps = [], []
    i = 0
    while i < len(groups):
        p = groups[i]
        if p.action not in WHOLE:
            gs.append(profile.groups[i])
            ps.append(p)
            i += 1
            continue
        whole = profile.whole_at[i]
        gs.append(_whole(profile.groups[i:i + whole.parts], whole.inputs))
        ps.append(GroupPlan("recompute" if p.action == "recompute_whole" else "recompute_offload"))
        i += whole.parts
    return replace(profile, groups=tuple(gs), wholes=()), tuple(ps)


def _whole(parts: Sequence[GroupProfile], inputs: int) -> GroupProfile:
    """A module's parts as one recomputed group saving ``inputs``. Its forward holds, beyond
    what it keeps, one part's temporaries and that part's inputs (the outputs of the part
    before it). Its backward begins with every part's activations back at once; while a part's
    backward runs, those of the parts after it are freed already, and their parameter
    gradients made: its ``backward_extra`` is the most of that over the parts, less all the
    activations (which :func:`simulate` counts)."""
    first = parts[0]
    later_grads = [sum(g.grads for g in parts[k + 1:]) for k in range(len(parts))]
    activations = [g.offloadable + g.kept for g in parts]
    so_far = [sum(activations[:k + 1]) for k in range(len(parts))]
    return GroupProfile(
        name=f"{first.name}..{parts[-1].name}",
        spans=tuple(sorted((n for g in parts for n in g.spans), reverse=True)),
        kept=sum(g.kept for g in parts), inputs=inputs,
        forward_s=sum(g.forward_s for g in parts), backward_s=sum(g.backward_s for g in parts),
        forward_extra=max(g.forward_extra + ((g.inputs or 0) if k else 0) for k, g in enumerate(parts)),
        backward_extra=max(held + g.backward_extra + later for g, held, later in zip(parts, so_far, later_grads))
        - so_far[-1],
        grads=sum(g.grads for g in parts), recompute_extra=max(g.recompute_extra for g in parts),
        recompute_s=sum(g.recompute_time for g in parts))


def moves_bytes(profile: Profile, groups: Sequence[GroupPlan]) -> bool:
    """Whether a plan moves any bytes across the bus."""
    return bus_bytes(profile, groups) > 0


def bus_bytes(profile: Profile, groups: Sequence[GroupPlan]) -> int:
    """Bytes a plan moves to host memory and back."""
    run, plans = as_run(profile, groups)
    return sum(p.moved(g) for p, g in zip(plans, run.groups))


class Work(NamedTuple):
    """What a plan does that the model takes as free or perfectly hidden, to choose between
    plans it rates alike (least first, in this order): ``bus_bytes`` moved to host memory and
    back (the model hides copies behind compute perfectly; they contend with it);
    ``unkept_groups``, groups as the step runs them (a module recomputed whole is one) that
    do not keep what they save (each runs saved-tensor hooks, a recomputed one checkpoint's
    machinery and its kernels again: host time, which a step that waits on the host pays);
    ``redone_bytes`` moved or recomputed."""

    bus_bytes: int
    unkept_groups: int
    redone_bytes: int


def unmodelled_work(profile: Profile, groups: Sequence[GroupPlan]) -> Work:
    """A plan's :class:`Work`."""
    run, plans = as_run(profile, groups)
    return Work(sum(p.moved(g) for p, g in zip(plans, run.groups)),
                sum(p.action != "keep" for p in plans),
                sum(p.moved(g) + (g.offloadable if p.recomputed else 0) for p, g in zip(plans, run.groups)))


def _evaluated(profile: Profile, groups: tuple[GroupPlan, ...], w: int, pf: int) -> Plan:
    if not moves_bytes(profile, groups):
        w = pf = 0  # nothing crosses the bus: one plan, whatever the copy window
    peak, step = simulate(profile, groups, w, pf)
    return Plan(groups, w, pf, peak, step)


def candidates(profile: Profile) -> list[Plan]:
    """Plans from keeping everything down to the least memory, for every window and
    prefetch: the path that at each step takes the move saving the most modelled peak
    memory per modelled second added. Independent of any budget."""
    n = len(profile.groups)
    keep_all = tuple(GroupPlan() for _ in range(n))
    out = [_evaluated(profile, keep_all, 0, 0)]
    for w in WINDOWS:
        for pf in PREFETCHES:
            out += _greedy_path(profile, _evaluated(profile, keep_all, w, pf), w, pf)
    out += _families(profile)
    return out


def _greedy_path(profile: Profile, current: Plan, w: int, pf: int) -> list[Plan]:
    """From ``current``, take the move with the best score (modelled peak saved per second
    added) until no move saves memory.

    Scores are evaluated lazily: a move's score against an earlier plan stands in for its
    current one until the move comes first; then it is evaluated again, and taken if it
    still beats every standing score. When no standing score is positive, every move is
    evaluated afresh, so like an exhaustive search the path ends only where no move saves
    memory, though not always at the same plan (scores do rise as other moves are made; on
    300 random profiles the least memory reached was the same, and the chosen plans were
    within 8% either way). Evaluating every move at every step grows with the cube of the
    groups (0.9 s at 24 groups on a 2-core CPU)."""
    path: list[Plan] = []

    def scored(i: int, move: tuple[GroupPlan, ...]) -> tuple[float, Plan]:
        trial = _evaluated(profile, current.groups[:i] + move + current.groups[i + len(move):], w, pf)
        saved = current.peak - trial.peak
        return (saved / max(trial.step_s - current.step_s, 1e-9) if saved > 0 else 0.0), trial

    def positive(moves: Iterable[tuple[int, tuple[GroupPlan, ...]]]) -> list[tuple[float, int, tuple[GroupPlan, ...]]]:
        return [(score, i, m) for i, m in moves for score in [scored(i, m)[0]] if score > 0]

    def every_move() -> list[tuple[float, int, tuple[GroupPlan, ...]]]:
        return positive((i, m) for i in range(len(profile.groups)) for m in _moves(profile, current.groups, i))

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
        standing += positive((j, m) for j in sorted(changed) for m in _moves(profile, current.groups, j))
        if not standing:
            standing = every_move()
    return path


def _families(profile: Profile) -> list[Plan]:
    """Plans the greedy path need not pass through: recompute the first k recomputable
    groups and keep the others, for every k (what a user checkpointing by hand would pick),
    also with those groups' inputs offloaded; recompute every group with the first k
    groups' inputs offloaded; where groups are the parts of modules, the same two with those
    modules recomputed whole; and offload the first j groups whole while recomputing the
    others with their inputs offloaded."""
    n = len(profile.groups)
    recomputable = [i for i, g in enumerate(profile.groups) if g.inputs is not None]
    out = []
    for k in range(1, len(recomputable) + 1):
        first = set(recomputable[:k])
        for action, windows in (("recompute", [(0, 0)]), ("recompute_offload", [(1, 1), (2, 2)])):
            groups = tuple(GroupPlan(action) if i in first else GroupPlan() for i in range(n))
            out += [_evaluated(profile, groups, w, pf) for w, pf in windows]
    # everything recomputed, the first k groups' inputs moved out: held longest, they are
    # what checkpointing every group keeps at the end of forward
    for k in range(1, len(recomputable)):
        first = set(recomputable[:k])
        groups = tuple(GroupPlan("recompute_offload" if i in first else "recompute") if g.inputs is not None
                       else GroupPlan() for i, g in enumerate(profile.groups))
        out += [_evaluated(profile, groups, w, pf) for w, pf in ((1, 1), (2, 2))]
    # modules recomputed whole: the first k (checkpointing k blocks by hand), also with their
    # inputs moved out; and all of them, the first k's inputs moved out
    size = {w.first: w.parts for w in profile.wholes}

    def with_wholes(actions: dict[int, str]) -> tuple[GroupPlan, ...]:
        groups = [GroupPlan() for _ in range(n)]
        for j, a in actions.items():
            groups[j:j + size[j]] = [GroupPlan(a)] + [GroupPlan("inside")] * (size[j] - 1)
        return tuple(groups)

    for k in range(1, len(size) + 1):
        starts = list(size)[:k]
        out.append(_evaluated(profile, with_wholes(dict.fromkeys(starts, "recompute_whole")), 0, 0))
        out += [_evaluated(profile, with_wholes(dict.fromkeys(starts, "recompute_whole_offload")), w, pf)
                for w, pf in ((1, 1), (2, 2))]
        if k < len(size):
            actions = {j: "recompute_whole_offload" if j in starts else "recompute_whole" for j in size}
            out += [_evaluated(profile, with_wholes(actions), w, pf) for w, pf in ((1, 1), (2, 2))]
    # the least memory: the first groups' backward comes last, with every gradient made; a group
    # reloaded there skips its recomputation's peak
    for j in range(1, n + 1):
        groups = tuple(GroupPlan("offload") if i < j or g.inputs is None else GroupPlan("recompute_offload")
                       for i, g in enumerate(profile.groups))
        out += [_evaluated(profile, groups, w, pf) for w, pf in ((0, 0), (1, 1))]
    return out


def _moves(profile: Profile, groups: tuple[GroupPlan, ...], i: int) -> list[tuple[GroupPlan, ...]]:
    """The next actions from group ``i`` on (a group never goes back to keeping more of its
    own; a move is taken only where it saves modelled memory, so a path ends), each as the
    actions it puts in place of ``groups[i:]``'s first ones: one group's own, or, at the first
    part of a module that may be recomputed whole, that module's."""
    g, p = profile.groups[i], groups[i]
    out: list[tuple[GroupPlan, ...]] = []
    if g.offloadable and p.action == "keep":
        out += [(GroupPlan("offload", f),) for f in FRACTIONS]
    if p.action == "offload" and p.fraction < 1.0:
        out += [(GroupPlan("offload", f),) for f in FRACTIONS if f > p.fraction]
    if g.inputs is not None and p.action in ("keep", "offload"):
        out.append((GroupPlan("recompute"),))
    if g.inputs and p.action in ("keep", "offload", "recompute"):
        out.append((GroupPlan("recompute_offload"),))
    whole = profile.whole_at.get(i)
    if whole is not None:
        inside = (GroupPlan("inside"),) * (whole.parts - 1)
        if p.action not in WHOLE:
            out.append((GroupPlan("recompute_whole"),) + inside)
        if whole.inputs and p.action != "recompute_whole_offload":
            out.append((GroupPlan("recompute_whole_offload"),) + inside)
    return out


class BudgetTooSmall(ValueError):
    """No plan keeps the modelled peak under the budget."""


def choose(profile: Profile, budget: int, plans: Sequence[Plan] | None = None) -> Plan:
    """The fastest plan whose modelled peak fits ``budget``.

    >>> g = GroupProfile("0", spans=(4096,), kept=0, inputs=1024, forward_s=1e-3, backward_s=2e-3)
    >>> p = Profile((g, g), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    >>> choose(p, budget=1 << 20).groups[0].action   # everything fits: keep
    'keep'
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


def fastest(profile: Profile, plans: Iterable[Plan]) -> Plan:
    """The plan of least modelled step time. Equal times (the bus hidden behind compute) go
    to the plan doing the least the model does not see (:class:`Work`)."""
    plans = list(plans)
    least = min(round(p.step_s, 9) for p in plans)
    tied = [p for p in plans if round(p.step_s, 9) == least]  # the rest need no Work
    return min(tied, key=lambda p: (unmodelled_work(profile, p.groups), p.peak))
