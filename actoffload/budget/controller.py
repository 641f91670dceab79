"""Applying a memory budget: profile a step, plan, run the plan, check it, adapt.

The fast offloader calls these methods at the points of a step where it already does
work (a group opens or closes, is committed, is reached by backward). A step begins at
the first group opened after a backward pass began.

- **Profiling** (the first two steps, and again when the workload changes: another
  sequence length, or what is allocated when the step begins): the least-memory plan
  the offloader can run without knowing anything: every wrapped module recomputed with
  its inputs moved out, every other group moved out whole, copies synchronous
  (``max_inflight=0``, ``prefetch=0``). Meanwhile it measures each group's compute time
  (the faster of the two steps: the first also pins host memory and grows the
  allocator's pools), the host's time for its forward (on CUDA: a forward that keeps the
  device waiting recomputes at the host's pace too), and its recomputation in backward
  (which stops once the last saved tensor is back, so it costs less than the forward),
  the bytes it would save, and the most memory its forward, its backward and its recomputation in
  backward allocate beyond them.
- **Planning**: among the planner's candidates, the fastest whose peak fits: measured for
  a plan that ran, modelled (plus the margin) for the others.
- **Checking**: each step's measured peak is compared with the budget; an overshoot
  widens the margin of every plan not yet run by as much. A plan's steps are timed
  until it is measured; while the model rates an untried plan faster than the fastest
  measured, a few more are tried (of those the model rates alike, the one moving fewest
  bytes first, then the one with fewest groups that hook or recompute), and where the
  fastest measured moves bytes, the fastest plan that moves none. A plan that moved
  bytes slower than modelled slows the modelled bus; one faster than modelled shrinks the
  modelled compute.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import torch

from .. import compat, policy
from .planner import (WHOLE, BudgetTooSmall, GroupPlan, GroupProfile, Plan, Profile, Whole, Work, candidates,
                      choose, fastest, moves_bytes, simulate, unmodelled_work)
from .probe import Probe

PROFILE_STEPS = 2  # the first also pins host memory and grows the allocator: its times run long
WORKLOAD_CHANGE = 0.10  # a group saving 10% more or less than profiled means a new workload
EXPLORE = 4  # plans beyond the model's first choice that may run to find a faster one
TIMINGS = 3  # timed steps that measure a plan (after its first, which pins host memory)
TIE = 0.01  # modelled step times this close are equal: the plan doing less the model cannot see goes first
CALIBRATIONS = 3  # times the model may be corrected from a plan's measured step
CALIBRATION_SLACK = 0.05  # a step this much off the model is noise


@dataclass
class _Measured:
    """What profiling saw of one group."""

    recomputed: bool
    start: Any = None
    end: Any = None
    touched: Any = None  # backward reached it
    allocated_at_start: int = 0
    forward_peak: int = 0  # above allocated_at_start
    backward_peak: int = 0  # absolute, while its backward ran (its recomputation aside)
    recompute_peak: int = 0  # absolute, while its forward ran again in backward
    recompute_start: Any = None  # its forward run again in backward: the time it takes
    recompute_end: Any = None
    spans: tuple[int, ...] = ()  # offloadable bytes it would save (not recomputed)
    kept: int = 0
    inputs: int = 0  # bytes it saved while recomputed
    moved: int = 0  # bytes it moved during profiling
    host_start: float | None = None  # the host's clock (CUDA only)
    host_end: float | None = None


@dataclass
class _Step:
    start: Any = None
    base: int = 0
    groups: list[_Measured] = field(default_factory=list)
    last_touch: Any = None
    last_exit: Any = None
    backward_end: Any = None
    outside_peak: int = 0
    wholes: list[Whole] = field(default_factory=list)  # modules whose parts were its groups
    open_whole: Whole | None = None  # such a module's forward is running


def _new_workload(now: int, then: int) -> bool:
    """Bytes saved now against then: more than ``WORKLOAD_CHANGE`` apart is another workload."""
    return abs(now - then) > WORKLOAD_CHANGE * max(then, 1)


def _same_workload(a: Profile, b: Profile, base_tolerance: int) -> bool:
    """Two profiling steps saw one workload: the same groups saving about the same bytes
    (within ``WORKLOAD_CHANGE``), on about the same base (gradients kept from the first step
    would otherwise count in its backward and in the second's base)."""
    if len(a.groups) != len(b.groups) or abs(a.base - b.base) > base_tolerance or a.wholes != b.wholes:
        return False
    for x, y in zip(a.groups, b.groups):
        if (x.inputs is None) != (y.inputs is None) or _new_workload(y.offloadable + y.kept, x.offloadable + x.kept):
            return False
    return True


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _merged(a: Profile, b: Profile) -> Profile:
    """Two profiling steps of one workload: the faster time and the larger memory of each."""
    groups = tuple(replace(y, forward_s=min(x.forward_s, y.forward_s), backward_s=min(x.backward_s, y.backward_s),
                           recompute_s=_least(x.recompute_s, y.recompute_s),
                           # whether the host set the pace: host and device time of one step
                           host_s=x.host_s if x.forward_s < y.forward_s else y.host_s,
                           forward_extra=max(x.forward_extra, y.forward_extra),
                           backward_extra=max(x.backward_extra, y.backward_extra),
                           recompute_extra=max(x.recompute_extra, y.recompute_extra),
                           reached=x.reached or y.reached)
                   for x, y in zip(a.groups, b.groups))
    return replace(b, groups=groups, outside_s=min(a.outside_s, b.outside_s),
                   outside_extra=max(a.outside_extra, b.outside_extra))


def _simplest_first(plans: list[Plan], profile: Profile) -> Iterator[Plan]:
    """``plans`` by modelled step time, where those within ``TIE`` of the fastest left go in the
    order of the work the model does not see (:class:`~.planner.Work`: bus bytes, then groups
    that hook or recompute): among plans it rates alike, the one that leans least on what
    it cannot see runs fastest. Lazily: choosing reads the first few of a thousand plans,
    during a step."""
    work: dict[int, Work] = {}

    def unseen(p: Plan) -> Work:
        if id(p) not in work:
            work[id(p)] = unmodelled_work(profile, p.groups)
        return work[id(p)]

    left = sorted(plans, key=lambda p: p.step_s)
    while left:
        near = 1
        while near < len(left) and left[near].step_s <= left[0].step_s * (1 + TIE):
            near += 1
        first = min(range(near), key=lambda i: (unseen(left[i]), left[i].step_s, left[i].peak))
        yield left.pop(first)


def _window(plan: Plan) -> tuple[int, int]:
    """A plan's copy window: ``(max_inflight, prefetch)``."""
    return plan.max_inflight, plan.prefetch


def _key(plan: Plan) -> tuple[Any, ...]:
    """A plan's identity: what each group does and the copy window."""
    return (plan.groups, *_window(plan))


class BudgetController:
    """Keeps a fast offloader's peak device memory under ``budget`` bytes at the least step time."""

    def __init__(self, budget: int, device: torch.device):
        self.budget = budget
        self.probe = Probe(device)
        # bytes the model's peaks are raised by: the sum of its overshoots. Not per copy window:
        # a misjudged plan family would overshoot under each window, one after the other (as a
        # d8192 stack's first parts recomputed with their inputs kept did, 384 MiB on an H200,
        # before those inputs were let go once recomputed from)
        self.margin = 0
        self.profile: Profile | None = None
        self.plans: list[Plan] = []
        self.plan: Plan | None = None
        self.measured_peak: int | None = None
        self.measured_step_s: float | None = None
        self.profiled_peak: int | None = None  # the profiling step's peak (the least-memory plan)
        self._measured: dict[Any, int] = {}  # plan -> the most it allocated above the base, measured
        self._profiling: _Step | None = None
        self._reprofile = True
        self._step_start: Any = None
        self._position = 0
        self._bandwidth: tuple[float, float] | None = None
        self._awaiting_backward_end = False
        self._last_span: tuple[Any, Any] | None = None  # (start, end) marks of the latest step
        self._runs: dict[Any, int] = {}  # plan -> steps it ran
        self._times: dict[Any, list[float]] = {}  # plan -> measured step seconds (not its first step)
        self._untimed: tuple[Any, Any, Any] | None = None  # (plan, start, end) of a step to time
        self._profiled: tuple[GroupPlan, ...] = ()  # what the profiling step ran
        self._partial: Profile | None = None  # the first profiling step's, until the next is done
        self._calibrated = 0  # times the model was corrected from a measured step
        self._kept_first: dict[int, int] = {}  # position -> bytes a kept group saved the first time
        self._hooked = 0  # the kept group that keeps its hooks: the first whose saves backward unpacks

    # ------------------------------------------------------------------ a step
    def step_begins(self) -> None:
        """The first group of a step is opening: close the last step, set up this one."""
        now = self.probe.mark()
        if self._profiling is not None:
            self._finish_profiling(now)
        else:
            self._time_last_step()
        base = self.probe.allocated()
        if self.profile is not None and abs(base - self.profile.base) > self._base_tolerance():
            # What is allocated when the first group opens changed: gradients kept from the last
            # step (then backward accumulates into them, allocating nothing), optimizer state made
            # after the first. The profile's peaks no longer hold, and shifting them would count
            # kept gradients twice: measure again.
            self._reprofile = True
        if self._reprofile:
            self._profiling = _Step(start=self.probe.mark(), base=base)
            self._reprofile = False
        if self._profiling is None and self.plan is None and self.profile is not None:
            self._choose()  # no plan fitted the budget: say so again, as clearly
        self.probe.reset_peak()
        # after choosing (tens of milliseconds of host time while plans are tried, the device
        # idle): a step's measured time is the plan's, not the controller's
        self._step_start = self.probe.mark()
        self._position = 0
        if self._profiling is None and self.plan is not None:
            self._runs[_key(self.plan)] = self._runs.get(_key(self.plan), 0) + 1

    def _least_margin(self) -> int:
        """What the model never sees, allowed for before any overshoot: the allocator's rounding,
        a library's workspace (every plan of a d2048 stack on an H200 measured 1 MiB over it)."""
        return max(1 << 20, self.budget // 1000)

    def _base_tolerance(self) -> int:
        """How much what is allocated when a step begins may move before the profile is stale."""
        return max(1 << 20, self.budget // 100)

    @property
    def next_position(self) -> int:
        """The place in the plan of the group opening next (a module run whole takes its parts')."""
        return self._position

    def whole_next(self, parts: int, inputs: int) -> bool:
        """Whether the module opening now, whose ``parts`` are groups, runs whole as one
        recomputed group (saving its ``inputs``, bytes). While profiling its parts are the
        groups, and it is noted once its forward opened exactly those."""
        i = self._position
        if self._profiling is not None:
            self._profiling.open_whole = Whole(i, parts, inputs)
            return False
        whole = self.profile.whole_at.get(i) if self.profile is not None else None
        if self.plan is None or whole is None or whole.parts != parts:
            return False
        return self.plan.groups[i].action in WHOLE

    def whole_closed(self, parts: int) -> None:
        """A module whose parts are groups, not run whole, is done: while profiling, it may be
        run whole later if its forward opened its parts and nothing else."""
        step = self._profiling
        if step is None or step.open_whole is None:
            return
        whole, step.open_whole = step.open_whole, None
        if whole.parts == parts and self._position - whole.first == parts:
            step.wholes.append(whole)

    def unhooked_next(self) -> bool:
        """Whether the group opening now runs with no hooks at all: the plan keeps everything
        it saves. A step's hooks cost host time per group and per save, which a model that
        waits on the host (a MoE's routing) pays in full. The first group keeps its hooks: its
        saved bytes show a new workload, and its backward ends the step (the first one whose
        saves backward unpacked while profiling: a frozen first block's may not be)."""
        i = self._position
        if self._profiling is not None or self.plan is None or i >= len(self.plan.groups):
            return False
        if self.plan.groups[i].action != "keep" or i == self._hooked:
            return False
        self._position += 1
        return True

    def action(self, recomputable: bool, parts: int = 0) -> GroupPlan:
        """What the next group of this step does (it is opening; ``parts``: a module run whole)."""
        i = self._position
        self._position += parts or 1
        if self._profiling is not None:
            action = GroupPlan("recompute_offload" if recomputable else "offload")
            self._profiling.groups.append(_Measured(recomputed=recomputable, start=self.probe.mark(),
                                                    allocated_at_start=self.probe.allocated(),
                                                    host_start=self.probe.host_clock()))
            self.probe.reset_peak()
            return action
        assert self.plan is not None and self.profile is not None
        planned = self.plan.groups[i] if i < len(self.plan.groups) else None
        if (planned is None or (planned.action.startswith("recompute") and not recomputable)
                or (planned.action == "inside") or ((planned.action in WHOLE) != bool(parts))):
            # more groups than profiled, another kind, or a module's parts run without it: a new workload
            self._reprofile = True
            return GroupPlan("offload")
        return planned

    def group_closing(self, position: int) -> None:
        if self._profiling is not None and position < len(self._profiling.groups):
            m = self._profiling.groups[position]
            m.end = self._profiling.last_exit = self.probe.mark()
            m.host_end = self.probe.host_clock()
            m.forward_peak = max(0, self.probe.peak() - m.allocated_at_start)
            self.probe.reset_peak()

    def move_at_most(self, position: int, action: GroupPlan) -> int | None:
        """Bytes the plan lets the group at ``position`` move (``None``: all it can)."""
        if action.action in ("recompute", "recompute_whole", "keep"):
            return 0
        if (action.action in ("recompute_offload", "recompute_whole_offload") or self._profiling is not None
                or self.profile is None
                or position >= len(self.profile.groups)):  # more groups than profiled: all it can
            return None
        return action.moved(self.profile.groups[position])

    def committed(self, position: int, recomputed: bool, plan: policy.SavePlan, would_save: policy.SavePlan | None) -> None:
        """A group's commit: what it saved (profiling), or whether the workload changed."""
        moved = sum(s.nbytes for s in plan.spans)
        kept = sum(n for reason, n in plan.stayed if reason not in ("parameter",))
        if self._profiling is not None:
            if position >= len(self._profiling.groups):
                return
            m = self._profiling.groups[position]
            m.moved = moved
            if recomputed:
                m.inputs = moved + kept
                inner = would_save or policy.SavePlan([], [])
                m.spans = tuple(sorted((s.nbytes for s in inner.spans), reverse=True))
                m.kept = sum(n for reason, n in inner.stayed if reason != "parameter")
            else:
                m.spans = tuple(sorted((s.nbytes for s in plan.spans), reverse=True))
                m.kept = kept
            return
        if self.profile is None or position >= len(self.profile.groups):
            return
        if self.plan is not None and self.plan.groups[position].action == "keep":
            # counted by whole storages, not spans: compared with its own first count
            kept = sum(n for r, n in plan.stayed if r == "budget")
            first = self._kept_first.setdefault(position, kept)
            if _new_workload(kept, first):
                self._reprofile = True
            return
        g = self.profile.groups[position]
        now = (moved + kept) if recomputed else (moved + sum(n for r, n in plan.stayed if r == "budget"))
        then = (g.inputs or 0) if recomputed else g.offloadable
        if self.plan is not None and self.plan.groups[position].action in WHOLE:
            then = self.profile.whole_at[position].inputs
        if _new_workload(now, then):
            self._reprofile = True

    def backward_reaches(self, position: int) -> None:
        if not self._awaiting_backward_end:
            self._awaiting_backward_end = True
            compat.at_backward_end(self._backward_ended)
        step = self._profiling
        if step is None or position >= len(step.groups):
            return
        now = self.probe.mark()
        peak = self.probe.peak()
        self.probe.reset_peak()
        if step.last_touch is None:
            step.outside_peak = peak  # the head and loss, between the last group and backward
        else:
            step.groups[step.last_touch].backward_peak = max(step.groups[step.last_touch].backward_peak, peak)
        step.groups[position].touched = now
        step.last_touch = position

    def recompute_begins(self, position: int) -> None:
        """Backward recomputes the group at ``position``: what came before is its backward's."""
        step = self._profiling
        if step is None or position >= len(step.groups):
            return
        m = step.groups[position]
        m.backward_peak = max(m.backward_peak, self.probe.peak())
        self.probe.reset_peak()
        if m.recompute_start is None:
            m.recompute_start = self.probe.mark()

    def recompute_ends(self, position: int) -> None:
        step = self._profiling
        if step is None or position >= len(step.groups):
            return
        m = step.groups[position]
        m.recompute_peak = max(m.recompute_peak, self.probe.peak())
        self.probe.reset_peak()
        if m.recompute_end is None:
            m.recompute_end = self.probe.mark()

    def window(self) -> tuple[int, int] | None:
        """``(max_inflight, prefetch)`` the plan sets, or ``None`` to use the settings."""
        if self._profiling is not None:
            return 0, 0
        return _window(self.plan) if self.plan is not None else None

    @property
    def profiling(self) -> bool:
        return self._profiling is not None

    @property
    def settled(self) -> bool:
        """Whether the plan is final: profiled, chosen, and on CUDA measured with nothing left
        to try, so that the steps from now on run as the plan will (until a step goes over
        the budget or the workload changes). Known from the step after the deciding one."""
        return (self._profiling is None and self.plan is not None
                and (not self.probe.cuda or self._timed(self.plan)))

    # ------------------------------------------------------------------ planning
    def _finish_profiling(self, end: Any) -> None:
        step, self._profiling = self._profiling, None
        assert step is not None
        if step.last_touch is not None and step.backward_end is None:  # no end seen: up to now
            last = step.groups[step.last_touch]
            last.backward_peak = max(last.backward_peak, self.probe.peak())
        peak = max([step.outside_peak] + [m.allocated_at_start + m.forward_peak for m in step.groups]
                   + [max(m.backward_peak, m.recompute_peak) for m in step.groups])
        if not step.groups or any(m.end is None for m in step.groups):
            self._reprofile, self._partial = True, None
            return
        profile = self._profile_of(step, end)
        if self._partial is not None:
            if _same_workload(self._partial, profile, self._base_tolerance()):
                profile = _merged(self._partial, profile)
                peak = max(peak, self.profiled_peak or 0)
            self._partial = None  # otherwise the latest alone: its workload and base hold from now on
        elif PROFILE_STEPS > 1:  # the first of the profiling steps
            self._partial, self.profiled_peak, self._reprofile = profile, peak, True
            return
        self.profile, self.profiled_peak, self.margin = profile, peak, 0
        self._profiled = tuple(GroupPlan("recompute_offload" if g.inputs is not None else "offload")
                               for g in profile.groups)
        self._measured, self._times, self._runs, self._calibrated = {}, {}, {}, 0
        self._kept_first = {}
        self._hooked = next((i for i, g in enumerate(profile.groups) if g.reached), 0)
        self._untimed = None  # a step of the old profile's plans, maybe not over when profiling began
        self._plan_all()
        if self.probe.cuda:  # it ran: its peak is known
            self._measured[_key(self.plans[-1])] = peak - profile.base
        self._choose()

    def _profile_of(self, step: _Step, end: Any) -> Profile:
        """What one profiling step measured, as the planner reads it."""
        if self._bandwidth is None:
            self._bandwidth = self.probe.bandwidth()
        d2h, h2d = self._bandwidth
        groups: list[GroupProfile] = []
        held = 0
        touches = [m.touched for m in step.groups]
        for i, m in enumerate(step.groups):
            fwd = self.probe.seconds(m.start, m.end)
            measured_recompute = None
            if m.recompute_start is not None and m.recompute_end is not None:
                measured_recompute = self.probe.seconds(m.recompute_start, m.recompute_end)
            recompute = measured_recompute if measured_recompute is not None else (fwd if m.recomputed else 0.0)
            after = touches[i - 1] if i > 0 and touches[i - 1] is not None else (step.backward_end or end)
            bwd = self.probe.seconds(m.touched, after) if m.touched is not None else 2 * fwd
            bwd -= m.moved / h2d + recompute  # its reload and its recompute
            saves = sum(m.spans) + m.kept
            forward_extra = m.forward_peak
            backward_extra = m.backward_peak - (step.base + held + saves)
            groups.append(GroupProfile(str(i), m.spans, m.kept, m.inputs if m.recomputed else None,
                                       max(fwd, 0.0), max(bwd, 0.0), max(forward_extra, 0), max(backward_extra, 0),
                                       recompute_extra=max(m.recompute_peak - m.backward_peak, 0),
                                       recompute_s=measured_recompute, reached=m.touched is not None,
                                       host_s=(m.host_end - m.host_start
                                               if m.host_end is not None and m.host_start is not None else None)))
            held += 0 if m.recomputed else m.kept
        outside = 0.0
        if step.last_exit is not None and touches[-1] is not None:
            outside = self.probe.seconds(step.last_exit, touches[-1])
        return Profile(tuple(groups), step.base, max(outside, 0.0), d2h, h2d,
                       outside_extra=max(step.outside_peak - (step.base + held), 0),
                       wholes=tuple(w for w in step.wholes if w.first + w.parts <= len(groups)))

    def _plan_all(self) -> None:
        """Every candidate plan under the current profile; the profiled plan last."""
        assert self.profile is not None
        self.plans = candidates(self.profile)
        peak, step_s = simulate(self.profile, self._profiled, 0, 0)
        self.plans.append(Plan(self._profiled, 0, 0, peak, step_s))

    def _choose(self) -> None:
        """The fastest plan for the budget less the margin. A plan that has run is judged by
        its measured peak, against the budget itself (the margin covers the model's error,
        and a measured peak has none). The budget itself must be reachable (else the error
        names the smallest peak); where only the margin makes it unreachable, the plan that
        needs the least memory runs."""
        assert self.profile is not None
        base = self.profile.base

        margin = self.margin + self._least_margin()

        def judged(with_margins: bool) -> list[Plan]:
            return [replace(p, peak=self._measured[_key(p)] + base) if _key(p) in self._measured
                    else replace(p, peak=p.peak + (margin if with_margins else 0)) for p in self.plans]

        plain = judged(False)
        if all(p.peak > self.budget for p in plain):
            choose(self.profile, self.budget, plain)  # raises, naming the smallest reachable peak
        with_margins = judged(True)
        fitting = [p for p in with_margins if p.peak <= self.budget]
        if not fitting:
            chosen = min(with_margins, key=lambda p: (p.peak, p.step_s))
        else:
            chosen = self._fastest(fitting)
        self.plan = next(p for p in self.plans if _key(p) == _key(chosen))

    def _fastest(self, fitting: list[Plan]) -> Plan:
        """Among plans that fit: the fastest measured one, unless the model promises a faster
        one not yet measured and fewer than ``EXPLORE`` others were tried (each runs
        ``TIMINGS`` + 1 steps: its first pins host memory), and the fastest plan that moves
        no bytes is measured too. The model misses costs it cannot see (hooks, packing,
        contention, a step that waits on the host); measuring finds them."""
        assert self.profile is not None
        profile = self.profile
        by_model = _simplest_first(fitting, profile)
        first = next(by_model)  # the model's choice, should nothing be measured
        timed = [p for p in fitting if self._timed(p)]
        best = min(timed, key=lambda p: self._time_of(p)) if timed else None
        for p in itertools.chain((first,), by_model):
            if self._timed(p) or (best is not None and p.step_s >= self._time_of(best)):
                continue  # measured, or the model promises nothing faster than what was
            if _key(p) in self._runs or len(self._runs) <= EXPLORE:  # running, or one more may
                return p
            break
        # The bus and recomputation are both modelled from the profiling steps; where the
        # model prefers moving bytes, the fastest plan that moves none (what checkpointing by
        # hand would give) is measured too, once, so an error in either cannot keep the
        # slower one.
        still_plans = [p for p in fitting if not moves_bytes(profile, p.groups)]
        still = fastest(profile, still_plans) if still_plans else None
        if (best is not None and moves_bytes(profile, best.groups) and still is not None
                and not self._timed(still) and (_key(still) in self._runs or len(self._runs) <= EXPLORE + 1)):
            return still
        return best if best is not None else first

    def _timed(self, plan: Plan) -> bool:
        """Measured: ``TIMINGS`` of its steps were timed."""
        return len(self._times.get(_key(plan), ())) >= TIMINGS

    def _time_of(self, plan: Plan) -> float:
        """A plan's measured step time: the median of its timed steps (a plan that moves bytes
        runs at one of two paces, as its copies happen to hide behind compute or not; the
        least of them would pick the lucky)."""
        return statistics.median(self._times[_key(plan)])

    def _time_last_step(self) -> None:
        """Record the latest planned step's time once it is known (never waits), and choose
        again with it."""
        if self._untimed is None:
            return
        key, start, end = self._untimed
        if self.probe.cuda and not end.query():
            return
        self._untimed = None
        seconds = self.probe.seconds(start, end)
        times = self._times.setdefault(key, [])
        times.append(seconds)
        if self.profile is not None:
            if len(times) == TIMINGS:  # just measured: the model agrees with its median
                self._calibrate(next(p for p in self.plans if _key(p) == key), statistics.median(times))
            self._choose()  # a plan measured: the model's next promise may run

    def _calibrate(self, plan: Plan, seconds: float) -> None:
        """Make the model agree with a plan's measured time, and plan again (a few times
        at most). Slower than modelled while moving bytes: what moving costs beyond the
        copies (hooks, packing, contention with compute) shows as a slower bus. Faster than
        modelled: the profile's compute times ran long (in a step that waits on the host,
        profiling's own host work shows between kernels), so they shrink."""
        assert self.profile is not None
        profile = self.profile
        if self._calibrated >= CALIBRATIONS:
            return
        bus = seconds > plan.step_s * (1 + CALIBRATION_SLACK) and moves_bytes(profile, plan.groups)
        if bus:
            def scaled(f: float) -> Profile:  # a factor on both bandwidths
                return replace(profile, d2h_bps=profile.d2h_bps * f, h2d_bps=profile.h2d_bps * f)
        elif seconds < plan.step_s * (1 - CALIBRATION_SLACK):
            def scaled(f: float) -> Profile:  # a factor on every compute time
                return replace(profile, outside_s=profile.outside_s * f, groups=tuple(
                    replace(g, forward_s=g.forward_s * f, backward_s=g.backward_s * f,
                            recompute_s=None if g.recompute_s is None else g.recompute_s * f,
                            host_s=None if g.host_s is None else g.host_s * f)
                    for g in profile.groups))
        else:
            return
        # bus: the model's time falls as the factor grows; compute: it grows with the factor,
        # by at most a half (where halving compute cannot reach the time, the bus bounds it)
        lo, hi = (1e-3, 1.0) if bus else (0.5, 1.0)
        if not bus and simulate(scaled(lo), plan.groups, plan.max_inflight, plan.prefetch)[1] > seconds:
            return
        for _ in range(20):
            mid = (lo + hi) / 2
            if (simulate(scaled(mid), plan.groups, plan.max_inflight, plan.prefetch)[1] > seconds) == bus:
                lo = mid
            else:
                hi = mid
        self.profile = scaled(hi if bus else lo)
        self._calibrated += 1
        self._plan_all()

    def _backward_ended(self) -> None:
        """The step's backward pass is over: its peak (and, while profiling, the end of the
        first group's backward). An overshoot of the budget widens the margin."""
        self._awaiting_backward_end = False
        now = self.probe.mark()
        if self._profiling is not None:
            step = self._profiling
            step.backward_end = now
            if step.last_touch is not None:  # the first group's backward ran until now
                last = step.groups[step.last_touch]
                last.backward_peak = max(last.backward_peak, self.probe.peak())
            return
        self.measured_peak = self.probe.peak()
        self._last_span = (self._step_start, now)
        if self.plan is None or self.profile is None:
            return
        if not self.probe.cuda:  # host time says nothing of a device's pace
            return
        key = _key(self.plan)
        # its first step pinned host memory: not its pace; once measured, choosing again at
        # every step would cost host time for nothing
        if self._runs.get(key, 0) >= 2 and not self._timed(self.plan):
            self._untimed = (key, self._step_start, now)
        self._measured[key] = max(self._measured.get(key, 0), self.measured_peak - self.profile.base)
        if self.measured_peak > self.budget:
            self.margin += self.measured_peak - self.budget + max(1 << 20, self.budget // 400)
            self._choose()

    # ------------------------------------------------------------------ reporting
    def _tried(self) -> list[dict[str, Any]]:
        """Each plan that ran since profiling: what the model said and what was measured."""
        out, seen = [], set()
        for p in self.plans:
            k = _key(p)
            if k in self._runs and k not in seen:
                seen.add(k)
                out.append({"actions": [g.action for g in p.groups], "max_inflight": p.max_inflight,
                            "prefetch": p.prefetch, "steps": self._runs[k], "predicted_peak_bytes": p.peak,
                            "measured_peak_bytes": (self._measured[k] + self.profile.base  # type: ignore[union-attr]
                                                    if k in self._measured else None),
                            "predicted_step_s": p.step_s,
                            "measured_step_s": statistics.median(self._times[k]) if k in self._times else None})
        return out

    def _peak_at(self) -> str:
        """Where the chosen plan's modelled peak falls: ``"forward 3"``, ``"loss"``, ``"backward 0"``."""
        assert self.plan is not None and self.profile is not None
        trace: list[tuple[str, int]] = []
        simulate(self.profile, self.plan.groups, self.plan.max_inflight, self.plan.prefetch, trace)
        return max(trace, key=lambda t: t[1])[0] if trace else "start"

    @property
    def last_step_s(self) -> float | None:
        """The latest step's time, from its first group's opening to its backward's end (no wait:
        ``None`` while still running)."""
        if self._last_span is None or (self.probe.cuda and not self._last_span[1].query()):
            return self.measured_step_s
        self.measured_step_s = self.probe.seconds(*self._last_span)
        return self.measured_step_s

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memory_budget": self.budget, "margin": self.margin + self._least_margin(),
                               "state": "profiling" if self._profiling is not None or self.plan is None else "planned",
                               "settled": self.settled}
        if self.plan is not None and self.profile is not None:
            out.update(groups=self.plan.describe(self.profile), max_inflight=self.plan.max_inflight,
                       prefetch=self.plan.prefetch, predicted_peak_bytes=self.plan.peak,
                       predicted_step_s=self.plan.step_s,
                       smallest_reachable_bytes=min(p.peak for p in self.plans),
                       plans_tried=len(self._runs), peak_at=self._peak_at(), tried=self._tried(),
                       profile=asdict(self.profile),
                       profiled_peak_bytes=self.profiled_peak if self.probe.cuda else None)
        out.update(measured_peak_bytes=self.measured_peak if self.probe.cuda else None,
                   measured_step_s=self.last_step_s if self.probe.cuda else None)
        return out
