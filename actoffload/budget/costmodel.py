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
  also moves those inputs to host memory; ``RECOMPUTE_SELECTIVE`` also keeps its costly ops'
  outputs (matmuls, attention), and runs only the rest of its forward again;
  ``RECOMPUTE_ATTENTION`` keeps its fused attention's outputs only (the ``_OFFLOAD`` forms move
  the largest of what they keep);
- ``RECOMPUTE_WHOLE`` (and ``RECOMPUTE_WHOLE_OFFLOAD``): where groups are the parts of one
  module (``ao.wrap(blocks, off, parts=...)``), that module runs whole under checkpointing,
  as one group: it keeps one set of inputs instead of each part's, and its parts, marked
  ``INSIDE``, are no groups. Recomputing a whole block costs less host time than
  recomputing its parts one by one, and backward then holds all its activations at once.

:func:`simulate` is the model: device memory over the step phase by phase, and the step
time from the compute stream, the two copy streams and the ordering between them.
:func:`recompute_time` is the one place that says what running a group's forward again
costs. Planning costs thousands of plans, so the model also comes in two faster forms, for
the search: a :class:`Simulation` keeps a simulated plan, and costs a plan one move away
from where the two differ; :func:`simulate_each` simulates many plans that run the same
groups at once. Both do :func:`simulate`'s arithmetic in the same order: the same bytes,
and the same seconds to the last bit (tests/test_budget_search.py holds them to it).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate, chain, count, islice
from operator import add
from typing import Any, Callable, Iterable, NamedTuple, Sequence, cast

import numpy as np

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
    ``host_s``: the host's time for its forward (``None`` where the host is the device), and
    ``recompute_host_s`` for its recomputation (``None``: not measured);
    ``costly``: the bytes of each of its costly ops' outputs (largest first), which a selective
    recomputation keeps beside its inputs (those of the first ``costly_calls`` costly ops, which
    its recomputation reaches before it stops; ``None``: all of them), and ``costly_share``: the share of its
    recomputation's time those ops took, which it does not spend again (``None``: not
    measured; no selective recomputation); ``attention``, ``attention_calls`` and
    ``attention_share``: the same of its fused attention calls alone (``RECOMPUTE_ATTENTION``'s);
    ``min_move``: the least bytes a span needs to move
    (the offloader's ``min_offload_bytes``): inputs, or a kept output, under it stay, whatever
    the plan (its offloadable ``spans`` were measured past it already); ``inputs_moving``,
    ``costly_moving`` and ``attention_moving``: of its inputs' bytes and kept outputs, those the
    policy and the marks let move (R3, R4; ``None``: all of them); ``dispatch_host_s``: the host's time for its forward
    and for its recomputation while every op went through a dispatch mode in Python (the
    metered profiling step), as a selective recomputation's do (``None`` where the host is the
    device, or not measured); the recomputation's no more than the forward's (:func:`profile_of`).
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
    recompute_host_s: float | None = None
    costly: tuple[int, ...] | None = None
    costly_share: float | None = None
    dispatch_host_s: tuple[float, float] | None = None
    costly_calls: int | None = None
    min_move: int = 0
    attention: tuple[int, ...] | None = None
    attention_share: float | None = None
    attention_calls: int | None = None
    inputs_moving: int | None = None
    costly_moving: tuple[int, ...] | None = None
    attention_moving: tuple[int, ...] | None = None

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

    @cached_property
    def _moved_selective_at(self) -> dict[tuple[float, bool], int]:
        return {}

    @cached_property  # what a simulation reads of it under a decision: see _row
    def _rows(self) -> dict[int, tuple[GroupDecision, _Row]]:
        return {}

    @cached_property
    def costly_bytes(self) -> int:
        return sum(self.costly or ())

    @cached_property
    def attention_bytes(self) -> int:
        return sum(self.attention or ())

    def kept_bytes(self, attention_only: bool) -> int:
        """The outputs a selective recomputation keeps: its costly ops', or its attention's only."""
        return self.attention_bytes if attention_only else self.costly_bytes

    def kept_share(self, attention_only: bool) -> float | None:
        """The share of its recomputation's time those ops took (``None``: not measured)."""
        return self.attention_share if attention_only else self.costly_share

    def moved_selective(self, fraction: float, attention_only: bool = False) -> int:
        """Bytes a selective recomputation moves when moving up to ``fraction`` of what it keeps
        (its costly outputs, or its attention's, and its inputs): the largest that fit, at least
        the largest."""
        known = self._moved_selective_at.get((fraction, attention_only))
        if known is None:
            kept = self.kept_moving(attention_only)
            inputs = self.movable_inputs
            spans = tuple(sorted((n for n in kept + ((inputs,) if inputs else ()) if n >= self.min_move),
                                 reverse=True))
            cap = max(fraction * sum(spans), max(spans, default=0))
            known = self._moved_selective_at[(fraction, attention_only)] = sum(spans[i] for i in largest_within(spans, cap))
        return known

    @property
    def movable_inputs(self) -> int:
        """Bytes of its inputs (while recomputed) that the policy and the marks let move."""
        return (self.inputs or 0) if self.inputs_moving is None else self.inputs_moving

    @property
    def held_inputs(self) -> int:
        """Bytes of its inputs that stay whatever the plan (:attr:`movable_inputs`' rest)."""
        return (self.inputs or 0) - self.movable_inputs

    def kept_moving(self, attention_only: bool) -> tuple[int, ...]:
        """The outputs a selective recomputation keeps (:meth:`kept_bytes`) that may move."""
        moving = self.attention_moving if attention_only else self.costly_moving
        if moving is not None:
            return moving
        return (self.attention if attention_only else self.costly) or ()

    def moved(self, fraction: float) -> int:
        """Bytes moved when offloading up to ``fraction`` of the offloadable bytes: the largest
        spans that fit (:func:`~actoffload.spans.largest_within`, a span moves whole), and at
        least the largest span (a share below it would move nothing, which is keeping)."""
        known = self._moved_at.get(fraction)
        if known is None:
            cap = max(fraction * self.offloadable, max(self.spans, default=0))
            known = self._moved_at[fraction] = sum(self.spans[i] for i in largest_within(self.spans, cap))
        return known


def recompute_seconds(d: GroupDecision, g: GroupProfile) -> float:
    """Seconds backward spends recomputing ``g`` under ``d``: its :func:`recompute_time`, less
    the costly ops' share where it recomputes selectively (all of it where its forward ran at
    the host's pace: the host runs every op again, kept outputs or not).

    A selective recomputation runs every op of the group's forward and of its recomputation
    through a dispatch mode in Python: where the host then falls behind the device
    (``dispatch_host_s``), its recomputation is charged the host's time, and the forward's own
    wait for the host (the model keeps one forward time per group, whatever its decision: the
    step's time is the same wherever the wait is counted)."""
    if not d.action.recomputes:
        return 0.0
    share = g.kept_share(d.action.attention_only) if d.action.selective else None
    if share is None:
        return recompute_time(g)
    seconds = recompute_time(g) if _host_paced(g) else _device_recompute(g) * (1.0 - share)
    if g.dispatch_host_s is not None:
        forward_host, recompute_host = g.dispatch_host_s
        seconds = max(seconds, recompute_host) + max(0.0, forward_host - max(g.forward_s, g.host_s or 0.0))
    return seconds


def recompute_time(g: GroupProfile) -> float:
    """Seconds backward spends running ``g``'s forward again (its forward's, if not measured).

    A forward that ran at the host's pace (its host time reached ``HOST_PACED`` of its
    device time: the device waited for its kernels, as in a MoE's Python loop over experts)
    runs again at that pace: it is charged the host's time for its recomputation where that
    is longer (the least the profiling steps measured; its forward's where none was). Not the
    forward's, which holds the profiling's own work on each group's way in and out: on an H200
    the loop sweep's decoder's attention parts took 1.2-1.5 ms of the host's time forward and
    0.7 recomputed, for 0.4 on the device, and plans recomputing them ran 2-5% faster than
    modelled with the forward's (``benchmarks/recompute_pace_probe.py``). A forward that reads
    a value back (a MoE's routing) waits for the device's queue, and counts as host-paced:
    recomputed in backward, it makes the device wait as well, however little device time
    its kernels take."""
    device = _device_recompute(g)
    if _host_paced(g):
        host = g.recompute_host_s if g.recompute_host_s is not None else g.host_s
        return max(device, host or 0.0)
    return device


def _device_recompute(g: GroupProfile) -> float:
    return g.forward_s if g.recompute_s is None else g.recompute_s


def _host_paced(g: GroupProfile) -> bool:
    return g.host_s is not None and g.host_s >= HOST_PACED * g.forward_s


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


def with_inputs(g: GroupProfile, inputs: int) -> GroupProfile:
    """``g`` saving ``inputs`` bytes (a module recomputed whole, whose first part it is): as
    much of them held by the policy and the marks as of its own."""
    return replace(g, inputs=inputs, inputs_moving=_less_held(inputs, g.held_inputs))


def _less_held(inputs: int, held: int) -> int | None:
    """Of ``inputs`` bytes, those that may move where ``held`` stay (``None``: all)."""
    return max(inputs - held, 0) if held else None


def moved(d: GroupDecision, g: GroupProfile) -> int:
    """Bytes a group moves to host memory under ``d`` (a whole module's inputs: those of its
    first part)."""
    if d.action is Action.OFFLOAD:
        return g.moved(d.fraction)
    if d.action.moves_kept:
        return g.moved_selective(d.fraction, d.action.attention_only)
    if d.action.moves_inputs:  # (as one span)
        inputs = g.movable_inputs
        return inputs if inputs and inputs >= g.min_move else 0
    return 0


def host_bytes(profile: Profile, groups: Sequence[GroupDecision]) -> int:
    """Bytes a plan holds in host memory when its forward ends: what every group moves (a whole
    module's inputs: those of its first part)."""
    return sum(_moved_by(profile, i, d, g) for i, (d, g) in enumerate(zip(groups, profile.groups)))


def _moved_by(profile: Profile, i: int, d: GroupDecision, g: GroupProfile) -> int:
    """:func:`moved` for group ``i``, whose profile is ``g``: a whole module's inputs are those
    of its first part."""
    if d.action.whole:
        g = with_inputs(g, profile.whole_at[i].inputs)
    return moved(d, g)


def most_host_bytes(profile: Profile) -> int:
    """At least what any plan holds in host memory (:func:`host_bytes`): every group moving all
    it could under any action, and every whole module its inputs."""
    return (sum(g.offloadable + (g.inputs or 0) + g.costly_bytes for g in profile.groups)
            + sum(w.inputs for w in profile.wholes))


def resident(d: GroupDecision, g: GroupProfile) -> int:
    """Bytes a group holds on the device between its forward and its backward under ``d``."""
    a = d.action
    if a is Action.KEEP:
        return g.offloadable + g.kept
    if a is Action.OFFLOAD:
        return g.offloadable - g.moved(d.fraction) + g.kept
    if a is Action.RECOMPUTE or a is Action.RECOMPUTE_WHOLE:
        return g.inputs or 0
    if a.selective:
        kept = (g.inputs or 0) + g.kept_bytes(a.attention_only)
        return kept - g.moved_selective(d.fraction, a.attention_only) if a.moves_kept else kept
    return (g.inputs or 0) - moved(d, g) if a.moves_inputs else 0


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
                g = with_inputs(g, profile.whole_at[i].inputs)
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
    group's own activations and measured extra (temporaries) (:func:`_checkpoints`).
    Time: the forward runs group after group; a group's copy out starts when it is done and
    the copy stream is free; compute waits for the oldest copy once more than
    ``max_inflight`` groups hold their sources. Groups still copying out when backward
    begins are used in place. In backward a group's reload starts when backward reaches
    it or the group ``prefetch`` later, and its backward starts once the reload is done;
    recomputing adds the group's recomputation (:func:`recompute_time`) to its backward
    (:func:`_forward`, :func:`_backward`).
    ``trace`` collects the modelled bytes at each checkpoint: ``("forward 3", bytes)``,
    ``("loss", bytes)``, ...
    """
    sim = Simulation(profile, groups, max_inflight, prefetch)
    if trace is not None:
        trace += sim.trace()
    return sim.peak, sim.step_s


# ---------------------------------------------------------------- the model, group by group
# resident, moved, recomputed, bytes at its forward and at its backward beyond what the model
# counts for the groups around it, its parameter gradients
_Row = tuple[int, int, bool, int, int, int]


def _row(p: GroupDecision, g: GroupProfile) -> _Row:
    """What the model reads of a group (as run) under a decision (remembered by the group per
    decision object: a search asks of a few decisions thousands of times)."""
    table = g._rows
    known = table.get(id(p))
    if known is not None and known[0] is p:
        return known[1]
    recomputes = p.action.recomputes
    activations = g.offloadable + g.kept
    # forward_extra was measured recomputed, where what the group saves was temporary:
    # saving it keeps those bytes (at least) alive until the group ends (a selective
    # recomputation: its costly ops' outputs)
    kept = g.kept_bytes(p.action.attention_only) if p.action.selective else 0
    forward = max(kept if recomputes else activations, g.forward_extra)
    # its activations are all back (reloaded or recomputed) while its backward runs
    backward = activations + g.backward_extra + (g.recompute_extra if recomputes else 0)
    row = (resident(p, g), moved(p, g), recomputes, forward, backward, g.grads)
    table[id(p)] = (p, row)
    if len(table) > 64:  # decisions made afresh by a caller: keep the latest few
        del table[next(iter(table))]
    return row


class _Columns(NamedTuple):
    """Per group as run: its row, its forward's seconds, its backward's (with its
    recomputation), and the seconds of its copy out and of its reload (None: it moves nothing)."""

    rows: list[_Row]
    forward_s: list[float]
    backward_s: list[float]
    out_s: list[float | None]
    back_s: list[float | None]

    def spliced(self, first: int, end: int, new: _Columns) -> _Columns:
        """These columns with groups ``first .. end - 1`` replaced by ``new``'s."""
        if end == first + 1 and len(new.rows) == 1:
            rows, backward_s = self.rows[:], self.backward_s[:]
            rows[first], backward_s[first] = new.rows[0], new.backward_s[0]
            return _Columns(rows, _put(self.forward_s, first, new.forward_s[0]), backward_s,
                            _put(self.out_s, first, new.out_s[0]), _put(self.back_s, first, new.back_s[0]))
        return _Columns(self.rows[:first] + new.rows + self.rows[end:],
                        self.forward_s[:first] + new.forward_s + self.forward_s[end:],
                        self.backward_s[:first] + new.backward_s + self.backward_s[end:],
                        self.out_s[:first] + new.out_s + self.out_s[end:],
                        self.back_s[:first] + new.back_s + self.back_s[end:])


def _put(column: list[Any], k: int, value: Any) -> list[Any]:
    """``column`` with ``value`` at ``k``: itself where that is the value there (no column is
    changed in place once made, but for a replay's entries, put back), else a copy."""
    was = column[k]
    if was is value or (value and was == value):  # (equal seconds have the same bits, but zeros)
        return column
    column = column[:]
    column[k] = value
    return column


def _forward_pairs(cols: _Columns) -> np.ndarray:
    """Per group as run: its forward's seconds and its copy out's (0.0: none)."""
    return np.array([(f, t or 0.0) for f, t in zip(cols.forward_s, cols.out_s)], dtype=np.float64).reshape(-1, 2)


def _columns(profile: Profile, run: list[tuple[int, GroupProfile, GroupDecision]]) -> _Columns:
    cols = _Columns([], [], [], [], [])
    rows, forward_s, backward_s, out_s, back_s = cols
    for _, g, p in run:
        r = _row(p, g)
        rows.append(r)
        forward_s.append(g.forward_s)
        backward_s.append(g.backward_s + (recompute_seconds(p, g) if r[2] else 0.0))
        out_s.append(r[1] / profile.d2h_bps if r[1] else None)
        back_s.append(r[1] / profile.h2d_bps if r[1] else None)
    return cols


class _Checkpoints(NamedTuple):
    """Modelled bytes at each group's forward, at the loss (between forward and backward),
    at the end of forward (sources still in flight then are held until their backward), and
    at each group's backward (by group)."""

    forward: list[int]
    loss: int
    end: int
    backward: list[int]


def _checkpoints(profile: Profile, rows: list[_Row], max_inflight: int, prefetch: int) -> _Checkpoints:
    """Memory at each checkpoint: ``base``, what the earlier groups left resident, copy sources
    in flight, what backward has reloaded ahead, gradients so far, and the group's own bytes.
    Memory counts the worst case of the window: a copy that runs late (the first step of a
    plan pins host memory) leaves the last ``max_inflight`` groups that moved holding their
    sources. So no time enters memory: a plan's peak is the same whatever its copies' pace."""
    base, forward, held = profile.base, [], 0
    window: list[int] = []  # the last max_inflight groups that moved
    for i, r in enumerate(rows):
        forward.append(base + held + sum(rows[j][1] for j in window) + r[3])
        held += r[0]
        if r[1] and max_inflight:
            window = (window + [i])[-max_inflight:]
    held += sum(rows[j][1] for j in window)
    end = base + held
    backward = [0] * len(rows)
    grads = 0
    for i in range(len(rows) - 1, -1, -1):
        r = rows[i]
        held -= r[0] + (r[1] if i in window else 0)
        ahead = sum(rows[j][1] for j in range(max(i - prefetch, 0), i) if j not in window)  # prefetched
        backward[i] = base + held + ahead + grads + r[4]
        grads += r[5]
    return _Checkpoints(forward, end + profile.outside_extra, end, backward)


_NEVER = 1 << 62  # a group no step reaches

# compute's clock, a copy stream's, and the copies on it: ends of those out not known done
# (forward), ready times of the reloads started for the groups next reached (backward)
_State = tuple[float, float, Sequence[float]]


def _same_state(compute: float, stream: float, copies: Sequence[float], state: _State) -> bool:
    """Whether a replay is back in a state another plan passed through: the same compute
    clock and copies, and a copy stream that starts the next copy at the same time (its
    clock the same, or behind compute in both)."""
    return ((stream == state[1] or (stream <= compute and state[1] <= compute)) and compute == state[0]
            and copies == state[2])


def _forward(forward_s: Iterable[float], out_s: Iterable[float | None], max_inflight: int, k: int, state: _State,
             sync: tuple[int, int, list[_State]] | None = None,
             record: list[_State] | None = None) -> tuple[int, tuple[float, tuple[float, ...]]]:
    """Forward time from group ``k`` on, in ``state`` (compute's clock, the copy-out
    stream's, the ends of copies out not known done): the forward runs group after group; a
    group's copy out (``out_s``: None where it moves nothing) starts when it is done and the
    copy stream is free; compute waits for the oldest copy once more than ``max_inflight``
    groups hold their sources. ``forward_s`` and ``out_s`` are those of groups ``k`` on.

    Returns ``(-1, (compute's clock, copies still running))`` at the end of forward, or
    ``(k, ())`` where ``sync = (first, offset, states)`` finds a group ``k >= first`` reached
    in ``states[k - offset]``, the state another plan reached its group in (the rest is
    that plan's). ``record`` collects the state before each group."""
    c, d, copying = state[0], state[1], deque(state[2])
    first, offset, states = sync or (-1, 0, [])
    if not max_inflight and not copying:  # compute waits for each copy: its clock adds the copy's time
        if record is None:
            for k, f, t in zip(count(k), forward_s, out_s):
                if k == first and c == states[k - offset][0] and _same_state(c, d, (), states[k - offset]):
                    return k, (0.0, ())
                c += f
                if t is not None:
                    c = d = c + t
            return -1, (c, ())
        for k, f, t in zip(count(k), forward_s, out_s):
            if k == first and c == states[k - offset][0] and _same_state(c, d, (), states[k - offset]):
                return k, (0.0, ())
            record.append((c, d, ()))
            c += f
            if t is not None:
                c = d = c + t
        return -1, (c, ())
    # compute's clock changes alike in both plans but where compute waits: once it differs,
    # look for the other plan's state again only after a wait (or a copy done)
    look = True
    if first < 0:
        first = _NEVER
    for k, f, t in zip(count(k), forward_s, out_s):
        if look and k >= first:
            other = states[k - offset]
            look = c == other[0]
            # (:func:`_same_state`, compute's clocks found the same)
            if look and (d == other[1] or (d <= c and other[1] <= c)) and tuple(copying) == other[2]:
                return k, (0.0, ())
        if record is not None:
            record.append((c, d, tuple(copying)))
        c += f
        if t is not None:
            d = (c if c > d else d) + t
            copying.append(d)
        while copying and copying[0] <= c:
            copying.popleft()  # done: sources freed
            look = True
        while len(copying) > max_inflight:
            end = copying.popleft()
            if end > c:
                c = end  # compute waits for the oldest copy
                look = True
    return -1, (c, tuple(copying))


_CALM = 1e-9  # of the step's clocks: a wait this close (or closer) to happening is replayed afresh
_ROUNDING = 1e-11  # of a step's clocks: far above what rounding them can add up to (a step of <= 10^4 groups)
_RUN = 8  # groups: a shorter run is replayed group by group (summing it at once costs more)
_LONG = 64  # groups: a longer run is summed by numpy (which costs more to begin)


class _Backward(NamedTuple):
    """Where a plan's backward passed: compute's clock before each group (by group), when each
    group's bytes were back, the groups whose reloads ran (in order), compute's clock where
    backward began, and the groups where a wait came close (within ``_CALM``) to happening, or
    to not happening, or a reload close to waiting for the one before (see :func:`_backward`)."""

    compute: list[float]
    ready: list[float]
    reloaded: list[int]
    start: float
    close: list[int]

    def state(self, j: int, prefetch: int) -> tuple[float, float, list[float]]:
        """Compute's clock, the reload stream's (at the last reload started) and the ready
        times of the reloads started for groups ``j - prefetch + 1 .. j``, before group ``j``."""
        k = bisect_left(self.reloaded, j + 1 - prefetch)
        stream = self.ready[self.reloaded[k]] if k < len(self.reloaded) else self.start
        return self.compute[j], stream, self.ready[max(j - prefetch + 1, 0):j + 1]


def _backward(backward_s: list[float], xs: np.ndarray, starts: list[float | None], reloaded: list[int], prefetch: int,
              j: int, state: tuple[float, float, list[float]] | float, exact: list[int], margin: float,
              sync: tuple[int, _Backward] | None = None,
              record: tuple[list[float], list[int]] | None = None) -> tuple[int, float, list[float]]:
    """Backward time from group ``j`` down: a group's reload starts when backward reaches it
    or the group ``prefetch`` later (``starts[j]``: the seconds of the reload reaching group
    ``j`` starts, None where none does, :func:`_reloads`; ``reloaded``: the groups reloaded, in
    order), and its backward starts once the reload is done. ``state``: compute's clock, the
    reload stream's, the ready times of the reloads started for groups ``j - prefetch + 1 ..
    j``; or where backward begins (``j`` the last group), compute's clock.

    Where a plan alike but for a shift of every clock neither waited nor came close (all but
    the groups ``exact``, in order), no reload is waited for and each starts when reached:
    compute's clock just adds up, and such a run is summed at once (the same additions; ``xs``
    holds ``backward_s`` for numpy to sum long runs).

    Returns ``(-1, step seconds, ready times)``, or ``(j, 0.0, ready times)`` for a group
    ``j < below`` reached in the state another plan's backward (``sync = (below, that
    backward)``) reached it in: the rest is that plan's. ``record`` collects compute's clock
    before each group, from ``j`` down, and the groups (as it passes them exactly) where a
    wait came within ``margin``."""
    ready = [0.0] * len(backward_s)  # when each group's bytes are back
    if isinstance(state, float):
        c = h = state
        for k in range(j, max(j - prefetch, -1), -1):  # reaching the last group: prefetch's reloads
            t = starts[k + prefetch]
            if t is not None:
                h = (c if c > h else h) + t
                ready[k] = h
    else:
        c, h = state[0], state[1]
        ready[j + 1 - len(state[2]):j + 1] = state[2]
    below, other = sync or (0, None)
    look = other is not None  # for the other plan's state, below: at first, while compute's clocks agree, after a wait
    e = bisect_right(exact, j) - 1  # exact[e]: the next group passed exactly
    following = exact[e] if e >= 0 else -1
    passed, close = record if record is not None else (None, None)
    while j >= 0:
        if look and j < below:
            look = c == other.compute[j]  # type: ignore[union-attr]
            if look:
                theirs = other.state(j, prefetch)  # type: ignore[union-attr]
                if ((h == theirs[1] or (h <= c and theirs[1] <= c))
                        and ready[max(j - prefetch + 1, 0):j + 1] == theirs[2]):
                    return j, 0.0, ready
        if following < j - _RUN and h <= c and (not prefetch or ready[j] <= c) and (
                prefetch < 2 or max(ready[max(j - prefetch + 1, 0):j + 1]) <= c):
            # no wait down to the next group passed exactly: compute's clock adds up
            lowest, highest = bisect_left(reloaded, following + 1 - prefetch), bisect_right(reloaded, j - prefetch)
            top = j - prefetch  # clock[top - k]: compute's clock where group k's reload starts
            clock: Sequence[float] | np.ndarray
            if j - following > _LONG:  # numpy adds one after the other too, and sooner
                clock = np.add.accumulate(np.concatenate(((c,), xs[j:following:-1] if following >= 0 else xs[j::-1])))
                if passed is not None:
                    clock = clock.tolist()
            else:
                clock = list(accumulate(backward_s[j:following:-1] if following >= 0 else backward_s[j::-1],
                                        initial=c))
            if passed is None:
                # each reload started on the way starts when reached (the stream is idle); those
                # waited for later, and the last (the stream's clock), matter beyond the run
                for k in reloaded[lowest:min(highest, lowest + prefetch + 1)]:
                    ready[k] = float(clock[top - k]) + starts[k + prefetch]  # type: ignore[operator]
                c = float(clock[-1])
            else:  # every clock passed recorded, and every reload's ready time
                ks = reloaded[lowest:highest]
                if ks and ks[-1] - ks[0] == len(ks) - 1:  # consecutive groups: their ready times at once
                    k, last = ks[0], ks[-1]
                    ready[k:last + 1] = map(add, reversed(clock[top - last:top - k + 1]),
                                            starts[k + prefetch:last + prefetch + 1])
                else:
                    for k in ks:
                        ready[k] = clock[top - k] + starts[k + prefetch]  # type: ignore[operator]
                passed.extend(clock)
                c = passed.pop()
            if highest > lowest:
                h = ready[reloaded[lowest]]
            j = following
            continue
        if following == j:
            e -= 1
            following = exact[e] if e >= 0 else -1
        t = starts[j]
        if passed is not None:
            passed.append(c)
            if t is not None and h > c - margin:
                close.append(j)  # type: ignore[union-attr]  # the reload stream came close to busy
        if t is not None:
            h = (c if c > h else h) + t
            ready[j - prefetch] = h
        r = ready[j]
        if passed is not None and r > c - margin and (not close or close[-1] != j):
            close.append(j)  # type: ignore[union-attr]  # a wait happened, or came close
        if r > c:
            c = r
            look = True
        c += backward_s[j]
        j -= 1
    return -1, c, ready


def _reloads(back_s: list[float | None], in_place: Iterable[int], prefetch: int) -> list[float | None]:
    """The seconds of the reload that reaching each group starts: that of the group
    ``prefetch`` earlier, none for a group whose sources are still there (or that moves
    nothing)."""
    starts = [None] * prefetch + back_s
    for k in in_place:
        if k < len(back_s):
            starts[k + prefetch] = None
    return starts


_NONE = int(np.iinfo(np.int64).min)  # the most bytes of no checkpoint


class _Maxima:
    """Bytes at a run of checkpoints, and the most of any range of them: the most of each
    prefix and of each suffix kept, any other range reduced."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self.before = np.maximum.accumulate(values)  # [k]: the most of values[:k + 1]
        self.after = np.maximum.accumulate(values[::-1])[::-1]  # [k]: the most of values[k:]

    def max(self, lo: int, hi: int) -> int:
        """The most of values[lo:hi] (lo < hi)."""
        if lo == 0:
            return self.before.item(hi - 1)  # (a Python int, at once)
        if hi == len(self.values):
            return self.after.item(lo)
        return int(self.values[lo:hi].max())


# checkpoints of a changed plan: (values, first, end, shift, most): values[first:end] of a
# simulated plan's, each plus shift (what the change holds more under them), the most of those
# values being most (None: not yet known); or (bytes worked out afresh, 0, 0, 0, the most of them)
_Piece = tuple[_Maxima | list[int], int, int, int, int | None]


def _most(pieces: list[_Piece], found: int) -> int:
    """The most bytes at any of the checkpoints, or ``found`` (a range's most found only
    where its suffix's could beat those found)."""
    for _, _, _, shift, most in pieces:
        if most is not None and most + shift > found:
            found = most + shift
    for values, lo, hi, shift, most in pieces:
        if most is None and values.after.item(lo) + shift > found:  # type: ignore[union-attr]
            found = max(found, values.max(lo, hi) + shift)  # type: ignore[union-attr]
    return found


def _joined(pieces: list[_Piece], was: _Maxima) -> _Maxima:
    """The checkpoints the pieces make, ``was``'s shifted (in place of a copy where the pieces
    keep their places)."""
    out, at = was.values.copy(), 0
    for values, lo, hi, shift, _ in pieces:
        if type(values) is list:
            out[at:at + len(values)] = values
            at += len(values)
        elif lo != at:  # a module runs whole, or no longer: the checkpoints move
            return _Maxima(np.concatenate([np.array(values, dtype=np.int64) if type(values) is list
                                           else values.values[lo:hi] + shift  # type: ignore[union-attr]
                                           for values, lo, hi, shift, _ in pieces]))
        else:
            if shift and hi > lo:
                out[lo:hi] += shift
            at = hi
    return _Maxima(out)


def _in_flight(rows: list[_Row], movers: list[int], k: int, w: int) -> list[int]:
    """[j]: the bytes moved by the last j of ``movers[:k]``, j = 0 .. w (fewer moved: all)."""
    out = [0]
    for j in range(k - 1, k - 1 - w, -1):
        out.append(out[-1] + rows[movers[j]][1] if j >= 0 else out[-1])
    return out


class _Around(NamedTuple):
    """A simulated plan's memory around its groups ``first .. end - 1`` (as run), whatever
    one group a change puts in their place (the search tries a group's moves in a row)."""

    first: int
    end: int
    held: int  # what the groups before first hold
    held_was: int  # what the groups before end hold
    flying: list[int]  # [k]: bytes in flight from the last k groups moving before first
    flew: list[int]  # [k]: the same before end
    forward: list[tuple[int, int, int | None]]  # checkpoints from end on: (first, end, most), a range up to
    # each of the next max_inflight groups that move, and the rest
    forward_before: int  # the most at the checkpoints before first
    backward_before: int  # the most at the backward checkpoints before first
    backward_from: int  # the most at those from end + prefetch on
    grads: int  # parameter gradients of the groups from end on
    ends: list[int] | None  # the groups in flight at the end of forward, where max_inflight move after
    # end (the change moves none of them: as run after it, their places shift), else None


class Change:
    """A plan next to a :class:`Simulation`'s: the simulated plan with a move's decisions in
    place from group ``i`` on. As run, the simulated plan's groups ``first .. end - 1``
    become ``run`` (a module recomputed whole runs as one group, so their number may change)."""

    __slots__ = ("groups", "lo", "hi", "first", "end", "run", "cols", "checkpoints", "replay", "sums")

    def __init__(self, groups: tuple[GroupDecision, ...], lo: int, hi: int, first: int, end: int,
                 run: list[tuple[int, GroupProfile, GroupDecision]], cols: _Columns):
        self.groups, self.lo, self.hi = groups, lo, hi  # the decisions of groups lo .. hi - 1
        self.first, self.end, self.run, self.cols = first, end, run, cols
        self.checkpoints: tuple[list[_Piece], int, int, list[_Piece]] | None = None  # kept by :meth:`Simulation.peak_after`
        self.replay: _Replay | None = None  # its step, replayed and kept (:meth:`Simulation.step_after`)
        self.sums: tuple[float, float] | None = None  # :meth:`Simulation._sums_after`'s


class _Replay(NamedTuple):
    """A changed plan's step, replayed (:meth:`Simulation._replay`)."""

    step_s: float
    compute_end: float  # compute's clock at the end of forward
    copies_end: tuple[float, ...]  # the copies still running then
    in_place: set[int]  # the groups whose sources are used in place
    synced: int  # the group forward came back to the simulated plan's state at (-1: none)
    top: int  # the group backward was replayed from
    below: int  # the group backward came back to the simulated plan's state at (-1: none)
    ready: list[float]  # when each group's bytes were back (from the replay: those it reloaded)
    reloaded: list[int]  # the groups reloaded
    start: float  # compute's clock where backward began
    forward_states: list[_State]  # the states forward passed, from the change on (kept: else empty)
    passed: tuple[list[float], list[int]]  # compute's clock in backward, down, and where waits came close


class Simulation:
    """A plan simulated and kept, so that plans differing from it in a few consecutive
    groups (the search's moves) cost little to simulate: from where they differ.

    Memory: a changed plan's checkpoints are this plan's, shifted by what the change holds
    more under them (its bytes, those it has in flight), but for those next to the change,
    worked out afresh. Time: the step is replayed from the change on, from the state this
    plan was in there, and stops once it is back in a state this plan passed through (the
    rest is this plan's). Either way the arithmetic is that of simulating the changed plan
    afresh, in the same order: the same bytes, and the same seconds to the last bit.
    """

    __slots__ = ("profile", "groups", "max_inflight", "prefetch", "peak", "step_s", "_starts", "_run_of", "_cols",
                 "_forward_bytes", "_backward_bytes", "_loss", "_end", "_grads_from", "_movers", "_memory_around",
                 "_runs", "_starts_kept", "_fw", "_clock", "_forward_states", "_compute_end", "_copies_end",
                 "_in_place", "_margin", "_work", "_copies", "_xs", "_backward")

    def __init__(self, profile: Profile, groups: Sequence[GroupDecision], max_inflight: int, prefetch: int,
                 runs: dict[tuple[int, ...], tuple] | None = None):
        """``runs``: changes' groups as run (:meth:`change`), shared by the plans simulated
        for one search (a module recomputed whole is merged once)."""
        self.profile, self.groups = profile, tuple(groups)
        self.max_inflight, self.prefetch = max_inflight, prefetch
        run = _run(profile, self.groups)
        cols = _columns(profile, run)
        n = len(run)
        self._starts = [i for i, _, _ in run] + [len(self.groups)]  # first group of each group as run
        self._run_of = [k for k in range(n) for _ in range(self._starts[k + 1] - self._starts[k])]
        self._cols = cols
        marks = _checkpoints(profile, cols.rows, max_inflight, prefetch)
        self._forward_bytes = _Maxima(np.array(marks.forward, dtype=np.int64))
        self._backward_bytes = _Maxima(np.array(marks.backward, dtype=np.int64))
        self._loss, self._end = marks.loss, marks.end
        self._grads_from = list(accumulate((r[5] for r in reversed(cols.rows)), initial=0))[::-1]  # of groups k ..
        self._movers = [k for k, r in enumerate(cols.rows) if r[1]]
        self._memory_around: _Around | None = None
        self._runs = {} if runs is None else runs  # changes' groups as run, shared with the plans after
        self._starts_kept: list[float | None] | None = None
        self._fw = _forward_pairs(cols)
        self._clock: np.ndarray | None = None
        self._forward_states: list[_State] = []  # with a copy window (else the clock says all)
        if max_inflight:
            _, (self._compute_end, self._copies_end) = _forward(cols.forward_s, cols.out_s, max_inflight, 0,
                                                                (0.0, 0.0, ()), record=self._forward_states)
        else:
            self._compute_end, self._copies_end = float(self._forward_clock()[-1]), ()
        reloaded = self._movers[:len(self._movers) - len(self._copies_end)]  # the others are used in place
        self._in_place = set(self._movers[len(reloaded):])
        start = self._compute_end + profile.outside_s
        # what compute's clock goes through whatever the waits (a lower bound of the step), and
        # the copies' seconds (compute waits no longer than the copy streams run: with them, a
        # bound of every clock)
        self._work = (sum(cols.forward_s) + profile.outside_s + sum(cols.backward_s)
                      + (0.0 if max_inflight else sum(t or 0.0 for t in cols.out_s)
                         + (0.0 if prefetch else sum(t or 0.0 for t in cols.back_s))))
        self._copies = sum(t or 0.0 for t in cols.out_s) + sum(t or 0.0 for t in cols.back_s)
        self._margin = _CALM * (self._work + self._copies)
        passed: tuple[list[float], list[int]] = ([], [])
        self._xs = np.array(cols.backward_s)
        _, self.step_s, ready = _backward(cols.backward_s, self._xs, _reloads(cols.back_s, self._in_place, prefetch),
                                          reloaded, prefetch, n - 1, start, list(range(n)), self._margin, record=passed)
        self._backward = _Backward(passed[0][::-1], ready, reloaded, start, passed[1][::-1])
        self.peak = self._peak()

    @property
    def moves(self) -> bool:
        """Whether the plan moves bytes across the bus."""
        return bool(self._movers)

    @property
    def movers(self) -> int:
        """How many groups (as run) move bytes across the bus."""
        return len(self._movers)

    def movers_after(self, ch: Change) -> int:
        """How many groups (as run) of the plan after ``ch`` move bytes across the bus."""
        a, b, movers = ch.first, ch.end, self._movers
        moves = ch.cols.rows[0][1] > 0
        if b == a + 1:  # one group in place of one
            return len(movers) - (self._cols.rows[a][1] > 0) + moves
        return len(movers) - bisect_left(movers, b) + bisect_left(movers, a) + moves

    def plan(self) -> MemoryPlan:
        """The plan, costed (one that moves no bytes has one copy window: none)."""
        w, pf = (self.max_inflight, self.prefetch) if self.moves else (0, 0)
        return MemoryPlan(self.groups, w, pf, self.peak, self.step_s)

    def trace(self) -> list[tuple[str, int]]:
        """The modelled bytes at each checkpoint, in the order the step passes them."""
        forward, backward = self._forward_bytes.values.tolist(), self._backward_bytes.values.tolist()
        return ([(f"forward {i}", b) for i, b in enumerate(forward)] + [("loss", self._loss)]
                + [(f"backward {i}", backward[i]) for i in range(len(backward) - 1, -1, -1)])

    def change(self, i: int, move: Sequence[GroupDecision]) -> Change:
        """The plan with ``move``'s decisions in place of groups ``i ..``'s: one group as run
        (a group's own decision, or a module recomputed whole) in place of one or more."""
        first, end = self._run_of[i], self._run_of[i + len(move) - 1] + 1
        lo, hi = self._starts[first], self._starts[end]
        groups = self.groups[lo:i] + tuple(move) + self.groups[i + len(move):hi]
        key = (lo, *map(id, groups))
        known = self._runs.get(key)
        if known is None:  # the plans simulated from one another ask about the same few changes
            run = _run(self.profile, groups, lo)
            if len(run) != 1:
                raise ValueError(f"a change runs as one group, not {len(run)}: {groups}")
            known = self._runs[key] = (groups, run, _columns(self.profile, run))
        return Change(known[0], lo, hi, first, end, known[1], known[2])

    def peak_after(self, ch: Change, keep: bool = False) -> int:
        """The modelled peak of the plan after ``ch`` (``keep``: its checkpoints kept on ``ch``,
        for a change likely taken: :meth:`after` needs them)."""
        checkpoints = ch.checkpoints or self._checkpoints_after(ch)
        if keep:
            ch.checkpoints = checkpoints
        forward, loss, end, backward = checkpoints
        return _most(backward, _most(forward, max(self.profile.base, loss, end)))

    def peak_floor(self, i: int, parts: int = 1) -> int:
        """The most bytes at the checkpoints no change of groups ``i .. i + parts - 1`` moves:
        the peak of the plan after any such change is at least this, found at no cost.

        Forward, the checkpoints before the change count only the groups before it; backward,
        those below it do too (its bytes are freed there, its gradients the same whatever it
        does), where the sources held in flight at the end of forward stay those of groups after
        it (``max_inflight`` of them move after it)."""
        a = self._run_of[i]
        if not a:
            return _NONE
        floor = self._forward_bytes.before.item(a - 1)
        movers, w = self._movers, self.max_inflight
        if len(movers) - bisect_left(movers, self._run_of[i + parts - 1] + 1) >= w:
            floor = max(floor, self._backward_bytes.before.item(a - 1))
        return floor

    def least_step_after(self, ch: Change) -> float:
        """A step time the plan after ``ch`` cannot beat, costing next to nothing: compute's
        clock goes through every forward and backward (and, without a copy window, waits for
        every copy out, and without prefetch for every reload too), so a change adds at least
        what it adds to those; less what this plan waits beyond them (a change may spare those
        waits), and a margin far above rounding."""
        work, copies = self._sums_after(ch)
        return work - _CALM * (work + copies)

    def _sums_after(self, ch: Change) -> tuple[float, float]:
        """What compute's clock goes through whatever the waits in the plan after ``ch``, and
        its copies' seconds (kept on ``ch``)."""
        if ch.sums is not None:
            return ch.sums
        a, b, old, new = ch.first, ch.end, self._cols, ch.cols
        if b == a + 1 and len(new.rows) == 1:  # the sums below, of one group each
            work = new.forward_s[0] + new.backward_s[0] - old.forward_s[a] - old.backward_s[a]
            out = (new.out_s[0] or 0.0) - (old.out_s[a] or 0.0)
            back = (new.back_s[0] or 0.0) - (old.back_s[a] or 0.0)
        else:
            work = sum(new.forward_s) + sum(new.backward_s) - sum(old.forward_s[a:b]) - sum(old.backward_s[a:b])
            out = sum(t or 0.0 for t in new.out_s) - sum(t or 0.0 for t in old.out_s[a:b])
            back = sum(t or 0.0 for t in new.back_s) - sum(t or 0.0 for t in old.back_s[a:b])
        if not self.max_inflight:
            work += out + (0.0 if self.prefetch else back)
        ch.sums = self._work + work, self._copies + out + back
        return ch.sums

    def step_after(self, ch: Change, keep: bool = False) -> float:
        """The modelled step time of the plan after ``ch`` (``keep``: what :meth:`after` needs
        of its replay kept on ``ch``, for a change likely taken)."""
        replay = ch.replay or self._replay(ch, keep)
        if keep:
            ch.replay = replay
        return replay.step_s

    def after(self, ch: Change) -> Simulation:
        """The plan after ``ch``, simulated: this one's states and checkpoints where they
        stand, the rest replayed."""
        a, b, s, rows = ch.first, ch.end, len(ch.run) - (ch.end - ch.first), ch.cols.rows
        new = object.__new__(Simulation)
        new.profile, new.max_inflight, new.prefetch = self.profile, self.max_inflight, self.prefetch
        new._memory_around = None
        new._runs = self._runs
        new._starts_kept = None
        new.groups = self.groups[:ch.lo] + ch.groups + self.groups[ch.hi:]
        if len(ch.run) == 1 and b == a + 1:  # one group as run for one: the same groups run
            new._starts, new._run_of = self._starts, self._run_of
        else:
            new._starts = self._starts[:a] + [i for i, _, _ in ch.run] + self._starts[b:]
            new._run_of = (self._run_of[:ch.lo] + [a + k for k in range(len(ch.run))
                                                  for _ in range(new._starts[a + k + 1] - new._starts[a + k])]
                           + [r + s for r in self._run_of[ch.hi:]])
        new._cols = self._cols.spliced(a, b, ch.cols)
        if s:
            new._xs = np.concatenate((self._xs[:a], ch.cols.backward_s, self._xs[b:]))
            new._fw = np.concatenate((self._fw[:a], _forward_pairs(ch.cols), self._fw[b:]))
        else:
            new._xs = self._xs.copy()
            new._xs[a] = ch.cols.backward_s[0]
            if new._cols.forward_s is self._cols.forward_s and new._cols.out_s is self._cols.out_s:
                new._fw = self._fw  # the same forward (and without a copy window, the same clock)
            else:
                new._fw = self._fw.copy()
                new._fw[a] = ch.cols.forward_s[0], ch.cols.out_s[0] or 0.0
        forward, new._loss, new._end, backward = ch.checkpoints or self._checkpoints_after(ch)
        new._forward_bytes = _joined(forward, self._forward_bytes)
        new._backward_bytes = _joined(backward, self._backward_bytes)
        grads = self._grads_from  # those before the change stand: a module's gradients are its parts'
        new._grads_from = grads if len(rows) == 1 and b == a + 1 else (
            grads[:a] + list(accumulate((r[5] for r in reversed(rows)), initial=grads[b]))[:0:-1] + grads[b:])
        ka, kb = bisect_left(self._movers, a), bisect_left(self._movers, b)
        later = self._movers[kb:]
        new._movers = self._movers[:ka] + [a + k for k, r in enumerate(rows) if r[1]] + ([j + s for j in later] if s else later)
        replay = ch.replay or self._replay(ch, keep=True)
        new.step_s, new._compute_end, new._copies_end, new._in_place = replay[:4]
        synced, top, below = replay.synced, replay.top, replay.below
        new._clock = self._clock if new._fw is self._fw else None
        new._forward_states = (self._forward_states[:a] + replay.forward_states
                               + (self._forward_states[synced - s:] if synced >= 0 else [])) if self.max_inflight else []
        # below where backward came back, and above where it was replayed from, this plan's
        was, kept, above = self._backward, below + 1, top - s + 1
        started = max(kept - self.prefetch, 0)  # reloads started in the replay: from group started on
        compute, close = replay.passed
        new._backward = _Backward(
            was.compute[:kept] + compute[::-1] + was.compute[above:],
            was.ready[:started] + replay.ready[started:top + 1] + was.ready[above:], replay.reloaded,
            replay.start, was.close[:bisect_right(was.close, below)] + close[::-1]
            + [u + s for u in was.close[bisect_left(was.close, above):]])
        new._margin = self._margin  # the groups found calm were found so by it
        new._work, new._copies = self._sums_after(ch)
        new.peak = new._peak()
        return new

    def _peak(self) -> int:
        n = len(self._cols.rows)
        return max(self.profile.base, self._loss, self._end, self._forward_bytes.before.item(-1) if n else _NONE,
                   self._backward_bytes.before.item(-1) if n else _NONE)

    def _forward_clock(self) -> np.ndarray:
        """Without a copy window, compute's clock before each group (and at the end of
        forward): it adds each group's forward, then its copy's (compute waits for every copy)."""
        if self._clock is None:
            self._clock = np.add.accumulate(np.concatenate(((0.0,), self._fw.ravel())))[::2]
        return self._clock

    def _reload_starts(self) -> list[float | None]:
        """:func:`_reloads` of this plan, made once."""
        if self._starts_kept is None:
            self._starts_kept = _reloads(self._cols.back_s, self._in_place, self.prefetch)
        return self._starts_kept

    def _last_movers(self, ch: Change, last: int) -> list[int]:
        """The ``last`` groups (as run) of the plan after ``ch`` that move bytes."""
        if last <= 0:
            return []
        a, b, movers = ch.first, ch.end, self._movers
        s = a + 1 - b
        out = [j + s for j in movers[max(bisect_left(movers, b), len(movers) - last):]]
        if len(out) < last and ch.cols.rows[0][1]:
            out.insert(0, a)
        if len(out) < last:
            out = movers[:bisect_left(movers, a)][len(out) - last:] + out
        return out

    def _around(self, a: int, b: int) -> _Around:
        """This plan's memory around its groups ``a .. b - 1`` (as run), the latest kept."""
        known = self._memory_around
        if known is not None and known.first == a and known.end == b:
            return known
        rows, movers, fwd, bwd = self._cols.rows, self._movers, self._forward_bytes, self._backward_bytes
        w, n, base = self.max_inflight, len(rows), self.profile.base
        flying = flew = [0]
        forward: list[tuple[int, int, int | None]] = []
        start, ends = b, cast("list[int] | None", [])
        if w:
            ka, kb = bisect_left(movers, a), bisect_left(movers, b)
            flying, flew = _in_flight(rows, movers, ka, w), _in_flight(rows, movers, kb, w)
            for j in movers[kb:kb + w]:  # the most of these ranges when needed
                forward.append((start, j + 1, None))
                start = j + 1
            ends = [j + a + 1 - b for j in movers[len(movers) - w:]] if len(movers) - kb >= w else None
        forward.append((start, n, fwd.max(start, n) if start < n else _NONE))
        after = b + self.prefetch
        around = _Around(a, b, fwd.values.item(a) - base - flying[w] - rows[a][3],
                         (fwd.values.item(b) - rows[b][3] if b < n else self._end) - base - flew[w], flying, flew,
                         forward, fwd.max(0, a) if a else _NONE, bwd.max(0, a) if a else _NONE,
                         bwd.max(after, n) if after < n else _NONE, self._grads_from[b], ends)
        self._memory_around = around
        return around

    def _checkpoints_after(self, ch: Change) -> tuple[list[_Piece], int, int, list[_Piece]]:
        """The plan after ``ch``'s checkpoints (forward, loss, end, backward), as pieces of
        this plan's."""
        rows, movers, fwd, bwd = self._cols.rows, self._movers, self._forward_bytes, self._backward_bytes
        w, pf, a, b, base = self.max_inflight, self.prefetch, ch.first, ch.end, self.profile.base
        n, new, s = len(rows), ch.cols.rows[0], a + 1 - b
        around = self._around(a, b)
        # forward: as before up to the change; its group afresh, from what is held and in flight there
        changed = base + around.held + around.flying[w] + new[3]
        forward: list[_Piece] = [(fwd, 0, a, 0, around.forward_before), ([changed], 0, 0, 0, changed)]
        # after it, as before but for the bytes it holds more, and those it has more in flight
        # until w more groups have moved
        more = around.held + new[0] - around.held_was
        moved = new[1] if w else 0
        for since, (start, stop, most) in enumerate(around.forward):
            last = w - since  # of those in flight, the last ones moved before the change's end
            now = (moved + around.flying[last - 1] if moved else around.flying[last]) if last > 0 else 0
            flying = more + now - around.flew[max(last, 0)]
            forward.append((fwd, start, stop, flying, most))
        loss, end = self._loss + flying, self._end + flying
        # backward: sources in flight at the end of forward are held until their backward
        held = around.held
        if around.ends is not None:  # the same groups: max_inflight move after the change
            ends, shift = around.ends, more
            backward: list[_Piece] = [(bwd, 0, a, 0, around.backward_before)]
        else:
            ends, was = self._last_movers(ch, w), (movers[-w:] if w else [])
            # a group before the change that now holds its sources then (or no longer does)
            # holds them the more (the less) from its backward on, but for the groups counting
            # them as reloaded ahead
            backward, start, shift = [], 0, 0
            for j in sorted(set(ends) ^ set(was)):
                if j >= a:
                    break
                stop = min(j + pf + 1, a)
                backward.append((bwd, start, stop, shift, bwd.max(start, stop) if start < stop else _NONE))
                start, shift = stop, shift + (rows[j][1] if j in ends else -rows[j][1])
            backward.append((bwd, start, a, shift, around.backward_before if start == 0 else
                             bwd.max(start, a) if start < a else _NONE))
            shift += more + (new[1] if a in ends else 0) - sum(rows[j][1] for j in was if a <= j < b)
            held += sum(rows[j][1] for j in ends if j < a)
        # the change's group and the prefetch after it (what they reload ahead) afresh
        if not pf:  # the change's group alone, reloading nothing ahead
            at = base + held + around.grads + new[4]
            backward += [([at], 0, 0, 0, at), (bwd, b, n, shift, around.backward_from)]
            return forward, loss, end, backward
        lo = max(a - pf, 0)
        near = rows[lo:a] + [new] + rows[b:b + pf]  # the plan after's groups lo ..
        grads = around.grads + new[5]
        changed_back = []
        for t in range(a, lo + len(near)):
            r = near[t - lo]
            grads -= r[5]
            ahead = 0
            for u in range(max(t - pf, 0), t):
                if u not in ends:
                    ahead += near[u - lo][1]
            changed_back.append(base + held + ahead + grads + r[4])
            held += r[0] + (r[1] if t in ends else 0)
        backward += [(changed_back, 0, 0, 0, max(changed_back)), (bwd, b + pf, n, shift, around.backward_from)]
        return forward, loss, end, backward

    def _replay(self, ch: Change, keep: bool = False) -> _Replay:
        """The step time of the plan after ``ch``: forward replayed from the change until it is
        back in this plan's state; backward from where the change is first reloaded (from the
        top where forward did not come back), until it is back in this plan's state below the
        change, summing compute's clock over the runs of groups where this plan came nowhere
        near a wait. ``keep``: also the states passed, which :meth:`after` keeps."""
        a, b, w, pf = ch.first, ch.end, self.max_inflight, self.prefetch
        q = len(ch.run)
        s = q - (b - a)
        old, new = self._cols, ch.cols
        forward_states: list[_State] = []
        if w:
            synced, (compute_end, copies_end) = _forward(chain(new.forward_s, islice(old.forward_s, b, None)),
                                                         chain(new.out_s, islice(old.out_s, b, None)), w, a,
                                                         self._forward_states[a], (a + q, s, self._forward_states),
                                                         forward_states if keep else None)
        else:  # compute waits for each copy out: its clock adds each group's forward, then its copy's
            clock = self._forward_clock()
            c = float(clock[a]) + new.forward_s[0] + (new.out_s[0] or 0.0)
            synced = a + 1 if b < len(old.rows) and c == clock[b] else -1
            if synced < 0:  # (the pairs from group b on, after c in place of group b - 1's copy out)
                pairs = self._fw.ravel()[2 * b - 1:].copy()
                pairs[0] = c
                compute_end, copies_end = float(np.add.accumulate(pairs)[-1]), ()
        if synced >= 0:
            compute_end, copies_end = self._compute_end, self._copies_end
        movers, ka, kb = self._movers, bisect_left(self._movers, a), bisect_left(self._movers, b)
        if not s and (kb > ka) == (new.rows[0][1] > 0) and len(copies_end) == len(self._copies_end):
            reloaded, in_place = self._backward.reloaded, self._in_place  # the same groups move, as before
        else:
            later = movers[kb:]
            movers = movers[:ka] + ([a] if new.rows[0][1] else []) + ([j + s for j in later] if s else later)
            reloaded = movers[:len(movers) - len(copies_end)]  # the others are used in place
            in_place = set(movers[len(reloaded):])
        n = len(old.rows) + s
        was = self._backward
        state: tuple[float, float, list[float]] | float
        top = a + q - 1 + pf  # reaching it starts the change's last group's reload
        if synced >= 0 and top < n - 1:  # forward ended as this plan's: so did backward, down to top
            state, start = was.state(top - s, pf), was.start
        else:
            top, state = n - 1, compute_end + self.profile.outside_s
            start = state
        # passed exactly: the change's groups and those reloading them, where this plan came
        # near a wait, and the groups whose sources now are (or no longer are) used in place
        close = was.close
        i, j = bisect_left(close, a), bisect_left(close, b + pf)
        later_close = close[j:]
        exact = close[:i] + list(range(a, a + q + pf)) + ([u + s for u in later_close] if s else later_close)
        if in_place is self._in_place:
            moved_in_place: set[int] = set()
        else:
            moved_in_place = in_place ^ ({k + s if k >= b else k for k in self._in_place} if s else self._in_place)
        if moved_in_place:
            exact = sorted(set(exact) | {k + d for k in moved_in_place for d in (0, pf)})
        if _ROUNDING * sum(self._sums_after(ch)) > self._margin:  # clocks so long that rounding may tip a wait
            exact = range(n)  # type: ignore[assignment]
        # below the change, where the same groups run in place, backward may come back to this plan's states
        same_below = not moved_in_place or min(moved_in_place) >= a
        passed: tuple[list[float], list[int]] = ([], [])
        if s:  # a module now runs whole, or no longer: groups as run shift
            above = top - s + 1  # this plan's groups up to top
            backward_s = old.backward_s[:a] + new.backward_s + old.backward_s[b:above]
            xs = np.array(backward_s)
            starts = _reloads(old.back_s[:a] + new.back_s + old.back_s[b:above], in_place, pf)
        else:  # one group for one: this plan's lists, the changed plan's entries in them while replayed
            backward_s, xs, starts = old.backward_s, self._xs, self._reload_starts()
            seconds = backward_s[a]
            reloads = {k: starts[k + pf] for k in moved_in_place | {a}} if moved_in_place else {a: starts[a + pf]}
            backward_s[a] = xs[a] = new.backward_s[0]
            for k in reloads:
                starts[k + pf] = None if k in in_place else new.back_s[0] if k == a else old.back_s[k]
        try:
            below, step, ready = _backward(backward_s, xs, starts, reloaded, pf, top, state, exact, self._margin,
                                           (a if same_below else 0, was), passed if keep else None)
        finally:
            if not s:  # this plan's entries back
                backward_s[a] = xs[a] = seconds
                for k, t in reloads.items():
                    starts[k + pf] = t
        return _Replay(self.step_s if below >= 0 else step, compute_end, copies_end, in_place, synced, top, below,
                       ready, reloaded, start, forward_states, passed)


# ---------------------------------------------------------------- many plans at once
def simulate_each(profile: Profile, decisions: Sequence[GroupDecision], plans: np.ndarray,
                  windows: Sequence[tuple[int, int]]) -> list[tuple[list[int], list[float], list[bool]]]:
    """:func:`simulate` of many plans at once: in plan ``m``, group ``j`` takes
    ``decisions[plans[m, j]]`` (none recomputing a module whole: all plans run the same
    groups). For each copy window (max_inflight, prefetch), returns each plan's modelled
    peak, step seconds, and whether it moves bytes.

    Memory is :func:`_checkpoints` as sums over the groups; time is :func:`_forward` and
    :func:`_backward` group by group, each step taken for every plan at once: the same
    operations in the same order for each plan, so the same bytes and seconds to the last bit."""
    if any(d.action.whole for d in decisions):
        raise ValueError("plans recomputing a module whole run other groups: simulate them one by one")
    if not len(plans) or not profile.groups:  # no plans, or only the empty one
        out = []
        for w, pf in windows:
            peak, step = simulate(profile, (), w, pf)
            out.append(([peak] * len(plans), [step] * len(plans), [False] * len(plans)))
        return out
    figures = _Figures(profile, decisions, plans)
    moving = figures.mover.any(axis=1).tolist()
    return [(_peaks_each(profile, figures, w, pf).tolist(), _steps_each(profile, figures, w, pf).tolist(), moving)
            for w, pf in windows]


class _Figures:
    """What the model reads of each group in each plan of :func:`simulate_each` (plan by group),
    whatever the copy window."""

    def __init__(self, profile: Profile, decisions: Sequence[GroupDecision], plans: np.ndarray):
        table = [_columns(profile, [(j, g, d) for j, g in enumerate(profile.groups)]) for d in decisions]
        at = (plans, np.arange(len(profile.groups)))  # each plan's figure of each group, from the table
        rows = np.array([c.rows for c in table], dtype=np.int64)  # decision, group, _Row
        self.resident, self.moved, self.own_forward, self.own_backward = (rows[at + (k,)] for k in (0, 1, 3, 4))
        self.grads = rows[0, :, 5]  # a group's gradients, whatever its decision
        self.mover = self.moved > 0
        self.forward_s = table[0].forward_s  # a group's forward, whatever its decision
        self.backward_s = np.array([c.backward_s for c in table])[at]
        self.out_s = np.array([[t or 0.0 for t in c.out_s] for c in table])[at]
        self.back_s = np.array([[t or 0.0 for t in c.back_s] for c in table])[at]


def _peaks_each(profile: Profile, figures: _Figures, w: int, pf: int) -> np.ndarray:
    """:func:`_checkpoints`' peak of each plan (:func:`simulate_each`)."""
    resident, moved, grads = figures.resident, figures.moved, figures.grads
    many, n = moved.shape
    # the last w groups that moved before each group (-1: none), and those when backward begins
    last = np.maximum.accumulate(np.where(figures.mover, np.arange(n), -1), axis=1)
    before = [np.concatenate((np.full((many, 1), -1), last[:, :-1]), axis=1)]
    ends = [last[:, -1:]]
    for _ in range(1, w):
        before.append(np.where(before[-1] >= 0, np.take_along_axis(before[0], np.maximum(before[-1], 0), 1), -1))
        ends.append(np.where(ends[-1] >= 0, np.take_along_axis(before[0], np.maximum(ends[-1], 0), 1), -1))

    def moved_at(index: np.ndarray) -> np.ndarray:
        return np.where(index >= 0, np.take_along_axis(moved, np.maximum(index, 0), 1), 0)

    in_flight = sum((moved_at(b) for b in before[:w]), np.zeros((many, n), dtype=np.int64))
    held = np.cumsum(resident, axis=1) - resident  # by the groups before each
    forward = profile.base + held + in_flight + figures.own_forward
    end = profile.base + held[:, -1] + resident[:, -1] + sum((moved_at(e)[:, 0] for e in ends[:w]), 0)
    # sources in flight when backward begins are held until their backward, not counted reloaded ahead
    kept = np.zeros((many, n), dtype=bool)
    for e in ends[:w]:
        kept |= (np.arange(n) == e) & (e >= 0)
    resident_then = resident + np.where(kept, moved, 0)
    ahead = np.concatenate((np.zeros((many, pf + 1), dtype=np.int64),
                            np.cumsum(np.where(kept, 0, moved), axis=1)), axis=1)
    backward = (profile.base + np.cumsum(resident_then, axis=1) - resident_then + ahead[:, pf:pf + n] - ahead[:, :n]
                + (np.cumsum(grads[::-1])[::-1] - grads) + figures.own_backward)
    peaks = np.maximum(np.maximum(end + profile.outside_extra, end), profile.base)
    return np.maximum(peaks, np.maximum(forward.max(axis=1), backward.max(axis=1))) if n else peaks


def _steps_each(profile: Profile, figures: _Figures, w: int, pf: int) -> np.ndarray:
    """:func:`_forward` and :func:`_backward`'s step seconds of each plan (:func:`simulate_each`)."""
    mover, out_s = figures.mover, figures.out_s
    many, n = mover.shape
    compute, stream = np.zeros(many), np.zeros(many)
    copies = [np.full(many, np.inf)] * (w + 1)  # ends of copies out not known done, oldest first
    for k, f in enumerate(figures.forward_s):
        compute = compute + f
        starts = mover[:, k]
        if not w:  # compute waits for each copy: its clock adds the copy's time
            compute = np.where(starts, compute + out_s[:, k], compute)
            continue
        stream = np.where(starts, np.maximum(compute, stream) + out_s[:, k], stream)
        copies[w] = np.where(starts, stream, np.inf)
        copies = _sorted([np.where(c <= compute, np.inf, c) for c in copies])  # done: sources freed
        over = copies[w] < np.inf
        if over.any():  # compute waits for the oldest copy
            compute = np.where(over, np.maximum(compute, copies[0]), compute)
            copies = _sorted([np.where(over, np.inf, copies[0])] + copies[1:])
    # backward: copies still running are used in place (the last ones moved)
    running = np.sum([c < np.inf for c in copies], axis=0)
    reloads = mover & (np.cumsum(mover[:, ::-1], axis=1)[:, ::-1] > running[:, None])
    back_s = np.where(reloads, figures.back_s, 0.0)
    backward_s = figures.backward_s
    compute = compute + profile.outside_s
    stream, ready = compute.copy(), np.zeros((many, n))
    reloaded = reloads.any(axis=0).tolist()  # by group: whether any plan reloads it (else nothing to wait for)

    def reload(k: int) -> None:
        nonlocal stream
        if reloaded[k]:
            stream = np.where(reloads[:, k], np.maximum(compute, stream) + back_s[:, k], stream)
            ready[:, k] = np.where(reloads[:, k], stream, 0.0)

    for k in range(n - 1, max(n - 1 - pf, -1), -1):  # reaching the last group: prefetch's reloads
        reload(k)
    for j in range(n - 1, -1, -1):
        if j >= pf:
            reload(j - pf)
        compute = (np.maximum(compute, ready[:, j]) if reloaded[j] else compute) + backward_s[:, j]
    return compute


def _sorted(columns: list[np.ndarray]) -> list[np.ndarray]:
    """The few columns of a copy window sorted row by row (oldest first), by compare-exchanges
    between them (np.sort of a few columns costs per row)."""
    for last in range(len(columns) - 1, 0, -1):
        for k in range(last):
            columns[k], columns[k + 1] = np.minimum(columns[k], columns[k + 1]), np.maximum(columns[k], columns[k + 1])
    return columns


_AS_GROUP = {Action.RECOMPUTE_WHOLE: GroupDecision(Action.RECOMPUTE),
             Action.RECOMPUTE_WHOLE_OFFLOAD: GroupDecision(Action.RECOMPUTE_OFFLOAD)}


def _run(profile: Profile, groups: Sequence[GroupDecision],
         first: int = 0) -> list[tuple[int, GroupProfile, GroupDecision]]:
    """Groups ``first ..`` (``groups`` their decisions) as the step runs them: (its first
    group, its profile, its decision), each module recomputed whole as one group (its parts'
    bytes and times together, its first part's inputs), so that the model treats it like any
    recomputed group."""
    out = []
    k = 0
    while k < len(groups):
        p, i = groups[k], first + k
        if p.action.whole:
            whole = profile.whole_at[i]
            out.append((i, _whole(profile.groups[i:i + whole.parts], whole.inputs), _AS_GROUP[p.action]))
            k += whole.parts
        else:
            out.append((i, profile.groups[i], p))
            k += 1
    return out


def peak_at(profile: Profile, plan: MemoryPlan) -> str:
    """Where a plan's modelled peak falls: ``"forward 3"``, ``"loss"``, ``"backward 0"``."""
    trace: list[tuple[str, int]] = []
    simulate(profile, plan.groups, plan.max_inflight, plan.prefetch, trace)
    return max(trace, key=lambda t: t[1])[0] if trace else "start"


def as_run(profile: Profile, groups: Sequence[GroupDecision]) -> tuple[Profile, Sequence[GroupDecision]]:
    """The groups as the step runs them (:func:`_run`): each module recomputed whole becomes
    one group."""
    if not profile.wholes or not any(p.action.whole for p in groups):
        return profile, groups
    run = _run(profile, groups)
    return replace(profile, groups=tuple(g for _, g, _ in run), wholes=()), tuple(p for _, _, p in run)


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
        recompute_s=sum(g.recompute_time for g in parts), min_move=first.min_move,
        inputs_moving=with_inputs(first, inputs).inputs_moving)


def moves_bytes(profile: Profile, groups: Sequence[GroupDecision]) -> bool:
    """Whether a plan moves any bytes across the bus (what :func:`bus_bytes` counts, read group
    by group until one moves some, with no module run whole made into one group: the
    controller asks it of every candidate as a step begins, where adding up each one's
    :func:`bus_bytes` took 16-22 ms of host time for 330-575 candidates on the CPU)."""
    return any(d.action.moves and _moved_by(profile, i, d, g) > 0
               for i, (d, g) in enumerate(zip(groups, profile.groups)))


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
    largest first, and bytes that stay); ``inputs``: what it saved recomputed, and
    ``inputs_moving``, ``costly_moving``, ``attention_moving``: of those and of the outputs
    below, what the policy and the marks let move (:class:`GroupProfile`);
    ``forward_peak``: the most allocated during its forward above what was allocated when it
    opened; ``backward_peak``, ``recompute_peak``: the most allocated (absolute) during its
    backward and during its recomputation; ``host_s``: the host's time for its forward, and
    ``recompute_host_s`` for its recomputation (``None`` where the host is the device);
    ``costly``, ``costly_s``, ``costly_calls``: the bytes of each of its costly ops' outputs in
    its forward (of those its recomputation reached), their time in its recomputation, and how
    many it reached (:class:`actoffload.selective.OpMeter`; ``None``: not metered), and
    ``attention``, ``attention_s``, ``attention_calls`` the same of its fused attention calls;
    ``min_move``: the offloader's ``min_offload_bytes``.
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
    costly: tuple[int, ...] | None = None
    costly_s: float | None = None
    costly_calls: int | None = None
    min_move: int = 0
    attention: tuple[int, ...] | None = None
    attention_s: float | None = None
    attention_calls: int | None = None
    inputs_moving: int | None = None
    costly_moving: tuple[int, ...] | None = None
    attention_moving: tuple[int, ...] | None = None


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
                         recompute_s=m.recompute_s, reached=m.backward_s is not None, host_s=m.host_s,
                         recompute_host_s=m.recompute_host_s if m.recomputed else None,
                         costly=tuple(sorted(m.costly, reverse=True)) if m.recomputed and m.costly is not None else None,
                         costly_calls=m.costly_calls if m.recomputed else None,
                         costly_share=_share(m.costly_s, m.recompute_s) if m.recomputed else None,
                         attention=(tuple(sorted(m.attention, reverse=True))
                                    if m.recomputed and m.attention is not None else None),
                         attention_calls=m.attention_calls if m.recomputed else None,
                         attention_share=_share(m.attention_s, m.recompute_s) if m.recomputed else None,
                         dispatch_host_s=_dispatch_host(m),
                         inputs_moving=m.inputs_moving if m.recomputed else None,
                         costly_moving=m.costly_moving if m.recomputed and m.costly is not None else None,
                         attention_moving=m.attention_moving if m.recomputed and m.attention is not None else None)
        # profiling moved every input, small ones too (guarded: docs/budgets.md); plans then move as min_move says
        held += resident(profiling_decision(m.recomputed), g)
        groups.append(replace(g, min_move=m.min_move))
    return Profile(tuple(groups), step.base, max(step.outside_s, 0.0), step.d2h_bps, step.h2d_bps,
                   outside_extra=max(step.outside_peak - (step.base + held), 0),
                   wholes=tuple(w for w in step.wholes if w.first + w.parts <= len(groups)))


def _dispatch_host(m: MeasuredGroup) -> tuple[float, float] | None:
    """A metered group's host seconds forward and recomputing (``dispatch_host_s``). Its
    recomputation sends the forward's ops through the dispatch mode again, and no more: where
    its host took longer, the rest was a wait (for the device's queue, on the first step's
    pinning and allocations), which a plan's step does not repeat. On an H200 the 8B shape's
    last layer, recomputed first in backward, took 112.9 ms of the host's time against 5.8
    forward; the others 4.5-4.9 against 5.6-16.8 (``benchmarks/forced_plans_model_probe.py``)."""
    if not m.recomputed or m.costly is None or m.host_s is None or m.recompute_host_s is None:
        return None
    return m.host_s, min(m.recompute_host_s, m.host_s)


def scaled_times(pair: tuple[float, float] | None, factor: float) -> tuple[float, float] | None:
    """A pair of seconds (``dispatch_host_s``) times ``factor``; ``None`` stays."""
    return None if pair is None else (pair[0] * factor, pair[1] * factor)


def _share(part: float | None, whole: float | None) -> float | None:
    """``part`` of ``whole`` (at most all of it), where both were measured."""
    if part is None or whole is None:
        return None
    return min(part / whole, 1.0) if whole > 0 else 0.0


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


def _larger(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return b if a is None else a if b is None else max(a, b, key=sum)


def _with(a: tuple[int, ...] | None, b: tuple[int, ...] | None, of_a: Any, of_b: Any) -> Any:
    """What goes with the one of ``a`` and ``b`` that :func:`_larger` takes."""
    return of_a if _larger(a, b) is a and a is not None else of_b


def merged(a: Profile, b: Profile) -> Profile:
    """Two profiling steps of one workload: the faster time and the larger memory of each (the
    first also pins host memory and grows the allocator's pools: its times run long, its peaks
    do not lie). Whether the host set a group's pace is judged within one step: the host time
    goes with the faster forward's. The costly ops are metered in one of the two (the first):
    their figures come from it, their share of a recomputation applied to the faster one."""
    groups = tuple(replace(y, forward_s=min(x.forward_s, y.forward_s), backward_s=min(x.backward_s, y.backward_s),
                           recompute_s=_least(x.recompute_s, y.recompute_s),
                           host_s=x.host_s if x.forward_s < y.forward_s else y.host_s,
                           recompute_host_s=_least(x.recompute_host_s, y.recompute_host_s),
                           forward_extra=max(x.forward_extra, y.forward_extra),
                           backward_extra=max(x.backward_extra, y.backward_extra),
                           recompute_extra=max(x.recompute_extra, y.recompute_extra),
                           reached=x.reached or y.reached,
                           costly=_larger(x.costly, y.costly), costly_share=_least(x.costly_share, y.costly_share),
                           costly_moving=_with(x.costly, y.costly, x.costly_moving, y.costly_moving),
                           attention_moving=_with(x.attention, y.attention, x.attention_moving, y.attention_moving),
                           inputs_moving=_less_held(y.inputs or 0, max(x.held_inputs, y.held_inputs)),
                           dispatch_host_s=x.dispatch_host_s or y.dispatch_host_s,
                           costly_calls=x.costly_calls if x.costly is not None else y.costly_calls,
                           attention=_larger(x.attention, y.attention),
                           attention_share=_least(x.attention_share, y.attention_share),
                           attention_calls=x.attention_calls if x.attention is not None else y.attention_calls)
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
                host_s=None if g.host_s is None else g.host_s * factor,
                recompute_host_s=None if g.recompute_host_s is None else g.recompute_host_s * factor,
                dispatch_host_s=scaled_times(g.dispatch_host_s, factor))
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
