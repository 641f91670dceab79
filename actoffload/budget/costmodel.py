"""The cost model: what a memory plan costs, in device memory and in step time, given a
measured profile of the step; and the arithmetic that turns measured steps into that profile
(so that simulating the profiled plan gives back what was measured).

A plan says, for each group of a step, what happens to what it saves
(:class:`~.actions.GroupDecision`), and how far the fast path's copies may run ahead. The
actions (:class:`~.actions.Action`):

- ``KEEP``: everything stays on the device (no bus, no recompute);
- ``OFFLOAD``: its largest spans, up to a fraction of its offloadable bytes, move to host
  memory and come back for backward (bus time, hidden behind compute where it can be);
- ``RECOMPUTE``: the group's module runs under activation checkpointing, so it saves only
  its inputs, and its forward runs again in backward (compute time); ``RECOMPUTE_OFFLOAD``
  also moves those inputs to host memory;
- ``RECOMPUTE_WHOLE`` (and ``RECOMPUTE_WHOLE_OFFLOAD``): where groups are the parts of one
  module (``ao.wrap(blocks, off, parts=...)``), that module runs whole under checkpointing,
  as one group: it keeps one set of inputs instead of each part's, and its parts, marked
  ``INSIDE``, are no groups. Recomputing a whole block costs less host time than
  recomputing its parts one by one, and backward then holds all its activations at once.

:func:`simulate` is the model: device memory over the step phase by phase, and the step
time from the compute stream, the two copy streams and the ordering between them.
:func:`recompute_time` is the one place that says what running a group's forward again
costs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, NamedTuple, Sequence

from ..spans import largest_within
from .actions import Action, GroupDecision
from .tolerances import HOST_PACED, new_workload, off_model


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
        """Seconds backward spends running its forward again: :func:`recompute_time`."""
        return recompute_time(self)

    @cached_property  # read in every simulation step: summed once
    def offloadable(self) -> int:
        return sum(self.spans)

    @cached_property  # read in every simulation step: worked out once per fraction
    def _moved_at(self) -> dict[float, int]:
        return {}

    @cached_property  # what a simulation reads of it under a decision: see _rows
    def _rows(self) -> dict[int, tuple[GroupDecision, _Row]]:
        return {}

    def moved(self, fraction: float) -> int:
        """Bytes moved when offloading up to ``fraction`` of the offloadable bytes: the largest
        spans that fit (:func:`~actoffload.spans.largest_within`, a span moves whole), and at
        least the largest span (a share below it would move nothing, which is keeping)."""
        known = self._moved_at.get(fraction)
        if known is None:
            cap = max(fraction * self.offloadable, max(self.spans, default=0))
            known = self._moved_at[fraction] = sum(self.spans[i] for i in largest_within(self.spans, cap))
        return known


def recompute_time(g: GroupProfile) -> float:
    """Seconds backward spends running ``g``'s forward again (its forward's, if not measured).

    A forward that ran at the host's pace (its host time reached ``HOST_PACED`` of its
    device time: the device waited for its kernels, as in a MoE's Python loop over experts)
    runs again at that pace: it is charged its forward's host time where that is longer,
    which holds the forward-side work of hooks and checkpointing too. A forward that reads
    a value back (a MoE's routing) waits for the device's queue, and counts as host-paced:
    recomputed in backward, it makes the device wait as well, however little device time
    its kernels take."""
    device = g.forward_s if g.recompute_s is None else g.recompute_s
    if g.host_s is not None and g.host_s >= HOST_PACED * g.forward_s:
        return max(device, g.host_s)
    return device


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

    @cached_property  # read in every simulation: each group's figures, as lists
    def columns(self) -> tuple[list[float], list[int], list[float], list[int], list[int], list[int]]:
        """Per group: ``forward_s``, ``forward_extra``, ``backward_s``, ``backward_extra``,
        ``recompute_extra``, ``grads``."""
        gs = self.groups
        return ([g.forward_s for g in gs], [g.forward_extra for g in gs], [g.backward_s for g in gs],
                [g.backward_extra for g in gs], [g.recompute_extra for g in gs], [g.grads for g in gs])

    @cached_property  # read in every simulation step
    def whole_at(self) -> dict[int, Whole]:
        """Each module that may be recomputed whole, by its first group."""
        return {w.first: w for w in self.wholes}


def moved(d: GroupDecision, g: GroupProfile) -> int:
    """Bytes a group moves to host memory under ``d`` (a whole module's inputs: those of its
    first part)."""
    if d.action is Action.OFFLOAD:
        return g.moved(d.fraction)
    if d.action.moves_inputs:
        return g.inputs or 0
    return 0


def resident(d: GroupDecision, g: GroupProfile) -> int:
    """Bytes a group holds on the device between its forward and its backward under ``d``."""
    a = d.action
    if a is Action.KEEP:
        return g.offloadable + g.kept
    if a is Action.OFFLOAD:
        return g.offloadable - g.moved(d.fraction) + g.kept
    if a is Action.RECOMPUTE or a is Action.RECOMPUTE_WHOLE:
        return g.inputs or 0
    return 0


@dataclass(frozen=True)
class MemoryPlan:
    """A memory plan: what each group does, the copy window (``max_inflight``, ``prefetch``), and what the
    model says it costs (``peak`` bytes, ``step_s`` seconds)."""

    groups: tuple[GroupDecision, ...]
    max_inflight: int = 0
    prefetch: int = 0
    peak: int = 0  # modelled, bytes
    step_s: float = 0.0  # modelled

    @property
    def key(self) -> tuple[tuple[GroupDecision, ...], int, int]:
        """A plan's identity: what each group does and the copy window (not what it costs)."""
        return self.groups, self.max_inflight, self.prefetch

    def describe(self, profile: Profile) -> list[dict]:
        """One row per group: name, action (its plain name) and bytes, for
        ``stats()["plan"]`` (a module run whole: on its first part; its other parts show 0)."""
        rows = []
        for i, (g, p) in enumerate(zip(profile.groups, self.groups)):
            if p.action.whole:
                g = replace(g, inputs=profile.whole_at[i].inputs)
            rows.append({"group": g.name, "action": p.action.value, "offloaded_bytes": moved(p, g),
                         "resident_bytes": resident(p, g)})
        return rows


def profiling_decision(recomputable: bool) -> GroupDecision:
    """What a group does while the step is profiled: the least memory the offloader can run
    knowing nothing (recomputed with its inputs moved out where it can be, else moved out
    whole). :func:`profile_of` takes a measured step to have run exactly this."""
    return GroupDecision(Action.RECOMPUTE_OFFLOAD if recomputable else Action.OFFLOAD)


def profiled_plan(profile: Profile) -> tuple[GroupDecision, ...]:
    """The groups' decisions of the profiled step."""
    return tuple(profiling_decision(g.inputs is not None) for g in profile.groups)


def simulate(profile: Profile, groups: Sequence[GroupDecision], max_inflight: int, prefetch: int,
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
    recomputing adds the group's recomputation (:func:`recompute_time`) to its backward.
    ``trace`` collects the modelled bytes at each checkpoint: ``("forward 3", bytes)``,
    ``("loss", bytes)``, ...
    """
    run, ps = as_run(profile, groups)
    return _simulate(run, _rows(run, ps), max_inflight, prefetch, trace)


def evaluate(profile: Profile, groups: Sequence[GroupDecision], max_inflight: int,
             prefetch: int) -> tuple[int, float, bool]:
    """``(peak, step seconds, moves bytes)`` of ``groups``, with no copy window where it moves
    no bytes (one plan then, whatever the window): :func:`simulate` and :func:`moves_bytes`
    in one pass (planning evaluates thousands of plans)."""
    run, ps = as_run(profile, groups)
    rows = _rows(run, ps)
    moves = any(r[1] for r in rows)
    if not moves:
        max_inflight = prefetch = 0
    peak, step = _simulate(run, rows, max_inflight, prefetch, None)
    return peak, step, moves


_Row = tuple[int, int, bool, int]  # resident, moved, recomputed, its activations


def _rows(profile: Profile, groups: Sequence[GroupDecision]) -> list[_Row]:
    """Per group as run, what :func:`_simulate` reads of it under its decision (each group
    remembers the rows of the decisions it was asked about: a search asks of a few decisions
    thousands of times)."""
    out = []
    for g, p in zip(profile.groups, groups):
        table = g._rows
        row = table.get(id(p))
        if row is None or row[0] is not p:
            recomputes = p.action.recomputes
            row = table[id(p)] = (p, (resident(p, g), moved(p, g), recomputes, g.offloadable + g.kept))
            if len(table) > 64:  # decisions made afresh by a caller: keep the latest few
                del table[next(iter(table))]
        out.append(row[1])
    return out


def _simulate(profile: Profile, rows: list[_Row], max_inflight: int, prefetch: int,
              trace: list[tuple[str, int]] | None) -> tuple[int, float]:
    """:func:`simulate` on the groups as run and their rows (:func:`_rows`)."""
    forward_s, forward_extra, backward_s, backward_extra, recompute_extra, grads_of = profile.columns
    n = len(rows)
    resident_ = [r[0] for r in rows]
    moved_ = [r[1] for r in rows]
    recompute = [r[2] for r in rows]
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
    for i in range(n):
        row = rows[i]
        # forward_extra was measured recomputed, where what the group saves was temporary:
        # saving it keeps those bytes (at least) alive until the group ends
        saves = 0 if row[2] else row[3]
        extra = forward_extra[i]
        at = base + held + in_flight + (saves if saves > extra else extra)
        if at > peak:
            peak = at
        if trace is not None:
            trace.append((f"forward {i}", at))
        compute += forward_s[i]
        held += row[0]
        m = row[1]
        if m:
            d2h = (compute if compute > d2h else d2h) + m / d2h_bps
            copying.append((i, d2h))
            if max_inflight:
                window.append(i)
                if len(window) > max_inflight:
                    del window[0]
                in_flight = sum(moved_[j] for j in window)
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
        resident_[j] += moved_[j]
        held += moved_[j]
    peak = max(peak, base + held)
    in_window = set(window)
    grads = 0
    ready = [-1.0] * n  # group -> when its bytes are back on the device (-1: not started)
    h2d = compute
    for i in range(n - 1, -1, -1):
        last = i - prefetch - 1
        for j in range(i, last if last > -1 else -1, -1):  # reaching i: its reload, and prefetch
            if ready[j] < 0:
                if moved_[j] and j not in in_place:
                    h2d = (compute if compute > h2d else h2d) + moved_[j] / h2d_bps
                    ready[j] = h2d
                else:
                    ready[j] = 0.0
        held -= resident_[i]
        ahead = 0
        if prefetch:
            first = i - prefetch
            for j in range(first if first > 0 else 0, i):
                if ready[j] >= 0 and j not in in_window:
                    ahead += moved_[j]
        row = rows[i]
        # its activations are all back (reloaded or recomputed) while its backward runs
        at = (base + held + ahead + grads + row[3] + backward_extra[i]
              + (recompute_extra[i] if row[2] else 0))
        if at > peak:
            peak = at
        if trace is not None:
            trace.append((f"backward {i}", at))
        if ready[i] > compute:
            compute = ready[i]
        compute += backward_s[i] + (profile.groups[i].recompute_time if row[2] else 0.0)
        grads += grads_of[i]
    return peak, compute


def peak_at(profile: Profile, plan: MemoryPlan) -> str:
    """Where a plan's modelled peak falls: ``"forward 3"``, ``"loss"``, ``"backward 0"``."""
    trace: list[tuple[str, int]] = []
    simulate(profile, plan.groups, plan.max_inflight, plan.prefetch, trace)
    return max(trace, key=lambda t: t[1])[0] if trace else "start"


def as_run(profile: Profile, groups: Sequence[GroupDecision]) -> tuple[Profile, Sequence[GroupDecision]]:
    """The groups as the step runs them: each module recomputed whole becomes one group (its
    parts' bytes and times together, its first part's inputs), so that :func:`simulate`
    models it like any recomputed group."""
    if not profile.wholes or not any(p.action.whole for p in groups):
        return profile, groups
    gs, ps = [], []
    i = 0
    while i < len(groups):
        p = groups[i]
        if not p.action.whole:
            gs.append(profile.groups[i])
            ps.append(p)
            i += 1
            continue
        whole = profile.whole_at[i]
        gs.append(_whole(profile.groups[i:i + whole.parts], whole.inputs))
        ps.append(GroupDecision(p.action.as_group))
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


def moves_bytes(profile: Profile, groups: Sequence[GroupDecision]) -> bool:
    """Whether a plan moves any bytes across the bus."""
    return bus_bytes(profile, groups) > 0


def bus_bytes(profile: Profile, groups: Sequence[GroupDecision]) -> int:
    """Bytes a plan moves to host memory and back."""
    run, plans = as_run(profile, groups)
    return sum(moved(p, g) for p, g in zip(plans, run.groups))


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


def unmodelled_work(profile: Profile, groups: Sequence[GroupDecision]) -> Work:
    """A plan's :class:`Work`."""
    run, plans = as_run(profile, groups)
    return Work(sum(moved(p, g) for p, g in zip(plans, run.groups)),
                sum(p.action is not Action.KEEP for p in plans),
                sum(moved(p, g) + (g.offloadable if p.action.recomputes else 0) for p, g in zip(plans, run.groups)))


# ---------------------------------------------------------------- from measured steps to a profile
@dataclass(frozen=True)
class MeasuredGroup:
    """What profiling measured of one group, in seconds and bytes.

    ``recomputed``: it ran recomputed (its module can be); ``forward_s``: its forward;
    ``backward_s``: from backward reaching it to backward reaching the group before it (the
    first group: to the end of backward), ``None`` if backward never reached it;
    ``recompute_s``: its forward run again in backward, ``None`` if not seen; ``moved``: bytes
    it moved out; ``spans``/``kept``: what it would save not recomputed (offloadable spans,
    largest first, and bytes that stay); ``inputs``: what it saved recomputed;
    ``forward_peak``: the most allocated during its forward above what was allocated when it
    opened; ``backward_peak``, ``recompute_peak``: the most allocated (absolute) during its
    backward and during its recomputation; ``host_s``: the host's time for its forward, and
    ``recompute_host_s`` for its recomputation (``None`` where the host is the device; the
    latter is for diagnostics: the model charges a recomputation its forward's host time).
    """

    recomputed: bool
    forward_s: float
    backward_s: float | None
    recompute_s: float | None
    moved: int
    spans: tuple[int, ...]
    kept: int
    inputs: int
    forward_peak: int
    backward_peak: int
    recompute_peak: int
    host_s: float | None = None
    recompute_host_s: float | None = None


@dataclass(frozen=True)
class MeasuredStep:
    """A profiled step as measured: ``base`` (bytes allocated when it began), its groups,
    ``outside_s`` (from the last group's forward to backward reaching it: head and loss) and
    ``outside_peak`` (the most allocated then), the modules whose parts its groups were, and the
    copy bandwidth each way."""

    base: int
    groups: tuple[MeasuredGroup, ...]
    outside_s: float
    outside_peak: int
    d2h_bps: float
    h2d_bps: float
    wholes: tuple[Whole, ...] = field(default=())


def profile_of(step: MeasuredStep) -> Profile:
    """A measured profiling step (which ran :func:`profiling_decision` for every group, with
    no copy window) as the profile :func:`simulate` reads: what the model adds to a group's
    backward under that plan (its reload at the bus's pace, its measured recomputation)
    comes off the measured time, and what the model counts while it runs (the bytes the
    earlier groups hold, its own activations) off the measured peak. A group backward never
    reached is taken to cost twice its forward."""
    groups: list[GroupProfile] = []
    held = 0  # what the earlier groups hold under the profiled plan
    for i, m in enumerate(step.groups):
        recompute = m.recompute_s if m.recompute_s is not None else (m.forward_s if m.recomputed else 0.0)
        bwd = m.backward_s if m.backward_s is not None else 2 * m.forward_s
        bwd -= m.moved / step.h2d_bps + recompute  # its reload and its recompute
        saves = sum(m.spans) + m.kept
        g = GroupProfile(str(i), m.spans, m.kept, m.inputs if m.recomputed else None,
                         max(m.forward_s, 0.0), max(bwd, 0.0), max(m.forward_peak, 0),
                         max(m.backward_peak - (step.base + held + saves), 0),
                         recompute_extra=max(m.recompute_peak - m.backward_peak, 0),
                         recompute_s=m.recompute_s, reached=m.backward_s is not None, host_s=m.host_s)
        groups.append(g)
        held += resident(profiling_decision(m.recomputed), g)
    return Profile(tuple(groups), step.base, max(step.outside_s, 0.0), step.d2h_bps, step.h2d_bps,
                   outside_extra=max(step.outside_peak - (step.base + held), 0),
                   wholes=tuple(w for w in step.wholes if w.first + w.parts <= len(groups)))


def same_workload(a: Profile, b: Profile, base_tolerance: int) -> bool:
    """Two profiling steps saw one workload: the same groups saving about the same bytes
    (no :func:`~.tolerances.new_workload` apart), on about the same base (within
    ``base_tolerance``: gradients kept from the first step would otherwise count in its
    backward and in the second's base)."""
    if len(a.groups) != len(b.groups) or abs(a.base - b.base) > base_tolerance or a.wholes != b.wholes:
        return False
    for x, y in zip(a.groups, b.groups):
        if (x.inputs is None) != (y.inputs is None) or new_workload(y.offloadable + y.kept, x.offloadable + x.kept):
            return False
    return True


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def merged(a: Profile, b: Profile) -> Profile:
    """Two profiling steps of one workload: the faster time and the larger memory of each (the
    first also pins host memory and grows the allocator's pools: its times run long, its peaks
    do not lie). Whether the host set a group's pace is judged within one step: the host time
    goes with the faster forward's."""
    groups = tuple(replace(y, forward_s=min(x.forward_s, y.forward_s), backward_s=min(x.backward_s, y.backward_s),
                           recompute_s=_least(x.recompute_s, y.recompute_s),
                           host_s=x.host_s if x.forward_s < y.forward_s else y.host_s,
                           forward_extra=max(x.forward_extra, y.forward_extra),
                           backward_extra=max(x.backward_extra, y.backward_extra),
                           recompute_extra=max(x.recompute_extra, y.recompute_extra),
                           reached=x.reached or y.reached)
                   for x, y in zip(a.groups, b.groups))
    return replace(b, groups=groups, outside_s=min(a.outside_s, b.outside_s),
                   outside_extra=max(a.outside_extra, b.outside_extra))


# ---------------------------------------------------------------- agreeing with a measured step
def bus_scaled(profile: Profile, factor: float) -> Profile:
    """The profile with both bandwidths times ``factor``."""
    return replace(profile, d2h_bps=profile.d2h_bps * factor, h2d_bps=profile.h2d_bps * factor)


def compute_scaled(profile: Profile, factor: float) -> Profile:
    """The profile with every compute time times ``factor`` (the host's times too: a
    host-paced group stays host-paced, and its recomputation shrinks alike)."""
    return replace(profile, outside_s=profile.outside_s * factor, groups=tuple(
        replace(g, forward_s=g.forward_s * factor, backward_s=g.backward_s * factor,
                recompute_s=None if g.recompute_s is None else g.recompute_s * factor,
                host_s=None if g.host_s is None else g.host_s * factor)
        for g in profile.groups))


def calibrated(profile: Profile, plan: MemoryPlan, seconds: float) -> Profile | None:
    """The profile made to agree with ``plan``'s measured step time, or ``None`` where it
    agrees already (within :data:`~.tolerances.CALIBRATION_SLACK`) or cannot be made to.
    Slower than modelled while moving bytes: what moving costs beyond the copies (hooks,
    packing, contention with compute) shows as a slower bus. Faster than modelled: the
    profile's compute times ran long (in a step that waits on the host, profiling's own host
    work shows between kernels), so they shrink, by at most a half (where halving compute
    cannot reach the time, the bus bounds it, and the model stays)."""
    off = off_model(seconds, plan.step_s)
    bus = off > 0 and moves_bytes(profile, plan.groups)
    scaled: Callable[[Profile, float], Profile]
    if bus:
        scaled = bus_scaled
    elif off < 0:
        scaled = compute_scaled
    else:
        return None

    def step_s(factor: float) -> float:
        return simulate(scaled(profile, factor), plan.groups, plan.max_inflight, plan.prefetch)[1]

    # bus: the model's time falls as the factor grows; compute: it grows with the factor
    lo, hi = (1e-3, 1.0) if bus else (0.5, 1.0)
    if not bus and step_s(lo) > seconds:
        return None
    for _ in range(20):
        mid = (lo + hi) / 2
        if (step_s(mid) > seconds) == bus:
            lo = mid
        else:
            hi = mid
    return scaled(profile, hi if bus else lo)
