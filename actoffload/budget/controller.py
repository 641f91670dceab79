"""Applying a memory budget: profile a step, plan, run the plan, check it, adapt.

The fast offloader calls these methods at the points of a step where it already does
work (a group opens or closes, is committed, is reached by backward). A step begins at
the first group opened after a backward pass began. The controller is a state machine
(:class:`State`):

- **profiling** (the first two steps, and again when the workload changes: another
  sequence length, or what is allocated when the step begins): the least-memory plan
  the offloader can run without knowing anything (:func:`~.costmodel.profiling_decision`:
  every wrapped module recomputed with its inputs moved out, every other group moved out
  whole, copies synchronous). Meanwhile it measures each group's compute time (the faster
  of the two steps: the first also pins host memory and grows the allocator's pools), the
  host's time for its forward (on CUDA: a forward that keeps the device waiting recomputes
  at the host's pace too), and its recomputation in backward (which stops once the last
  saved tensor is back, so it costs less than the forward), the bytes it would save, and
  the most memory its forward, its backward and its recomputation in backward allocate
  beyond them. The cost model turns that into a profile (:func:`~.costmodel.profile_of`).
- **exploring**: among the search's candidates, the fastest whose peak fits runs:
  measured for a plan that ran, modelled (plus the margin) for the others. Each step's
  measured peak is compared with the budget; an overshoot widens the margin of every plan
  not yet run by as much. A plan's steps are timed until it is measured; while the model
  rates an untried plan faster than the fastest measured, a few more are tried (in the
  search's order, :func:`~.search.simplest_first`), and where the fastest measured moves
  bytes, the fastest plan that moves none. A plan measured off the model corrects it
  (:func:`~.costmodel.calibrated`).
- **settled**: the plan is final (on CUDA: measured, with nothing left to try; on the CPU,
  where nothing is timed: once chosen). An overshoot may still move it back to exploring.
- **re-planning**: a step found the workload changed (more groups than profiled, a group
  saving more bytes, or less in ``LIGHTER_STEPS`` steps in a row, another base): the plan still
  runs to the end of this step, and the next step profiles again.

A step whose backward never ended (it raised) is closed when the next one begins, and
what was measured of it is dropped.

One controller plans one workload: ``workloads.py`` keeps one per step signature (the shapes
of the step's first inputs, its groups, its base) and hands each step to its own, so that a
step never runs a plan made for another signature; a workload's steps need not follow each
other.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import torch

from .. import compat, policy
from ..selective import OpMeter
from . import costmodel, search
from . import worker as planning
from .actions import Action, GroupDecision
from .buckets import SharedPredictions
from .costmodel import MeasuredGroup, MeasuredStep, MemoryPlan, Profile, Whole, moves_bytes, simulate
from .probe import Probe
from .reserve import AllocatorReserve
from .search import BudgetTooSmall
from .tolerances import (TIE, WORKLOAD_CHANGE, alike, base_tolerance, least_margin,
                         new_workload, off_model, overshoot_margin)

PROFILE_STEPS = 2  # the first also pins host memory and grows the allocator: its times run long
EXPLORE = 1  # plans beyond the model's first choice that may run to find a faster one (docs/budgets.md: settling)
TIMINGS = 3  # timed steps that measure a plan (its first among them only where it pinned nothing and grew no cache)
# a plan being measured beside one measured is left once this many of its timed steps (a majority of
# TIMINGS) each ran slower than that one: its median, its measured time, will be slower whatever its
# other steps show (on an H200 the MoE at 9.25 and 11.80 GiB timed three steps of a plan moving bytes
# 7% over the measured plan moving nothing, then went back to that one, and settled in 12 and 11 steps)
LEFT_AFTER = TIMINGS // 2 + 1
CALIBRATIONS = 3  # times the model may be corrected from a plan's measured step
# steps in a row saving less than profiled before the workload is profiled again (one saving more
# is profiled at the next step): a plan made for more stays within the budget, and variants of one
# signature taking turns (two LoRA adapters trained in alternation) would otherwise profile at each turn
LIGHTER_STEPS = 8

__all__ = ["BudgetController", "BudgetTooSmall", "Measured", "State", "PROFILE_STEPS", "EXPLORE", "TIMINGS",
           "LEFT_AFTER", "CALIBRATIONS", "LIGHTER_STEPS"]


class State(enum.Enum):
    """Where a :class:`BudgetController` is (see the module's docstring): ``PROFILING``, a
    step measures the profiling plan (or the next will); ``EXPLORING``, a plan runs and is
    measured, or others may be tried (none is chosen while none fits the budget: each step
    says so); ``SETTLED``, the plan is final; ``REPLANNING``, the plan runs to the end of a
    step that found the workload changed, and the next step profiles."""

    PROFILING = "profiling"
    EXPLORING = "exploring"
    SETTLED = "settled"
    REPLANNING = "re-planning"


class Measured(NamedTuple):
    """A plan that ran since the last profiling: ``steps`` it ran, its measured ``peak``
    (bytes, absolute; ``None`` until known), ``times`` of its timed steps and ``step_s``, their
    median once it is measured (``TIMINGS`` of them; ``None`` before)."""

    plan: MemoryPlan
    steps: int
    peak: int | None
    times: tuple[float, ...]
    step_s: float | None


@dataclass
class _Group:
    """What profiling sees of one group, as probe marks and bytes."""

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
    inputs_moving: int | None = None  # ... of which the policy and the marks let move (None: all)
    save_policy: str = "all"  # the offloader's policy, which with the marks says what may move
    moved: int = 0  # bytes it moved during profiling
    host_start: float | None = None  # the host's clock (CUDA only)
    host_end: float | None = None
    recompute_host_start: float | None = None
    recompute_host_end: float | None = None
    # its costly ops (what a selective recomputation keeps): measured in the first of the
    # profiling steps only, whose times run long anyway (metering ops costs host time)
    meter: OpMeter | None = None
    min_move: int = 0  # the offloader's min_offload_bytes


@dataclass
class _Step:
    """A profiling step being measured."""

    start: Any = None
    base: int = 0
    groups: list[_Group] = field(default_factory=list)
    last_touch: int | None = None
    last_exit: Any = None
    backward_end: Any = None
    outside_peak: int = 0
    wholes: list[Whole] = field(default_factory=list)  # modules whose parts were its groups
    open_whole: Whole | None = None  # such a module's forward is running


PlanKey = tuple[tuple[GroupDecision, ...], int, int]


class BudgetController:
    """Keeps a fast offloader's peak device memory under ``budget`` bytes at the least step time.

    ``probe`` reads the device's memory and time (default: a :class:`~.probe.Probe` of
    ``device``); a test or a diagnostic may pass its own.
    """

    def __init__(self, budget: int, device: torch.device, probe: Probe | None = None,
                 reserve: AllocatorReserve | None = None):
        self._budget = budget
        self._probe = Probe(device) if probe is None else probe
        # what the allocator reserves beyond the allocated peak, measured (shared by the
        # controllers of one allocator's workloads): added to every plan's peak
        self._reserve = AllocatorReserve() if reserve is None else reserve
        self._state = State.PROFILING
        # bytes the model's peaks are raised by: the sum of its overshoots. Not per copy window:
        # a misjudged plan family would overshoot under each window, one after the other
        self._margin = 0
        # the most bytes a plan may hold in host memory (the offloader's host budget, less what
        # its pool may round up: R9), set by the plan; None: no bound
        self.host_cap: int | None = None
        self._host_of: dict[PlanKey, int] = {}  # plan -> its host bytes (costmodel.host_bytes), as asked
        self._moves_of: dict[PlanKey, bool] = {}  # plan -> whether it moves bytes (costmodel.moves_bytes), as asked
        self._host_bound: int | None = None  # costmodel.most_host_bytes of the profile
        self._profile: Profile | None = None
        self._plans: list[MemoryPlan] = []
        # a prediction's search not yet made (keeping everything fitted): that plan, the copy window
        # and the predictions the search would be shared by (:meth:`_search_if_owed`)
        self._owed: tuple[PlanKey, tuple[int, int] | None, SharedPredictions | None] | None = None
        self._index: dict[PlanKey, list[int]] | None = None  # plan -> its places in _plans (made when asked)
        self._plan: MemoryPlan | None = None
        self._forced: tuple[tuple[GroupDecision, ...], int, int] | None = None
        self.measured_peak: int | None = None  # the latest step's
        # and what the allocator held at most meanwhile: what the budget bounds
        self.measured_reserved_peak: int | None = None
        self.measured_step_s: float | None = None
        self.profiled_peak: int | None = None  # the profiling step's peak (the least-memory plan)
        self._peaks: dict[PlanKey, int] = {}  # plan -> the most it allocated above the base, measured
        self._reserve_judged = 0  # the shared reserve when this workload's plan was last judged
        self._trims_judged = 0  # ... and its trims (any workload's step may give the cache back)
        self._over_on_own_cache: set[PlanKey] = set()  # plans whose step went over on a cache given back before it
        # plan -> (the cache it ran on: the shared reserve's trims then, the most it reserved there),
        # where that was within the budget (:meth:`_served_now`)
        self._served: dict[PlanKey, tuple[int, int]] = {}
        self._went_over: set[PlanKey] = set()  # plans a step of which reserved over the budget
        self._host_at_start: int | None = None  # the offloader's host allocations as the step began
        self._runs: dict[PlanKey, int] = {}  # plan -> steps it ran
        self._unheld: set[PlanKey] = set()  # those not held until timed: a quick search's, forced ones
        self._times: dict[PlanKey, list[float]] = {}  # plan -> measured step seconds (its first: see _at_its_pace)
        self._left: set[PlanKey] = set()  # plans measured before TIMINGS steps: slower than one measured (_leaves)
        self._untimed: list[tuple[PlanKey, Any, Any]] = []  # (plan, start, end) of steps to time, in order
        self._step: _Step | None = None  # the profiling step being measured
        self._partial: Profile | None = None  # the first profiling step's, until the next is done
        # a first profiling step found to be another workload's (:meth:`take_displaced`)
        self._displaced: tuple[Profile, int | None, tuple[MeasuredStep, ...]] | None = None
        self._measured_steps: tuple[MeasuredStep, ...] = ()  # what the latest profile was made of
        self._pending_steps: list[MeasuredStep] = []
        self._step_start: Any = None
        self._step_number = 0
        self._step_key: PlanKey | None = None  # the plan the latest step began with (None: profiling)
        self._last_run: PlanKey | None = None  # the plan this workload's latest step ran (profiling: the profiled plan)
        self._step_backwards = 0  # backward passes of the latest step that ended
        # a step of this workload ended more than one backward pass (pipelined micro-batches,
        # losses backwarded one by one): only the next step's beginning knows it is over
        self._several_backwards = False
        self._position = 0
        self._bandwidth: tuple[float, float] | None = None
        self._awaiting_end = False  # a backward pass of this step reached a group and has not ended
        self._cut_short = False  # this step's forward was cut short by an exception and began again
        self._last_span: tuple[Any, Any] | None = None  # (start, end) marks of the latest step
        self._calibrated = 0  # times the model was corrected from a measured step
        self._kept_first: dict[int, int] = {}  # position -> bytes a kept group saved the first time
        self._kept_carried: dict[int, int] = {}  # ... raised by a step that saved more: the next profile's
        self._lighter_steps = 0  # steps in a row, the latest included, that saved less than profiled
        self._lighter_now = False  # the step running saved less than profiled (and counted so)
        self._hooked = 0  # the kept group that keeps its hooks: the first whose saves backward unpacks
        # BudgetTooSmall is raised once, where a step begins (the first choice under a profile, the
        # step after a choice made in backward found no plan fits, or a step whose plan another
        # workload's growth of the shared reserve left without one); then the least memory runs
        self.too_small: str | None = None  # its message, once raised
        self._raise_next: str | None = None  # found by choosing: raised where it may be (_raise_found)
        self._beginning = False  # inside a step_begins that may raise
        self.predicted = False  # the profile was predicted from another workload's, not measured
        # per group, the least share of its predicted saved bytes that its own may be and still be
        # the workload predicted (predict.least_shares); none for a profile measured (1)
        self._least_shares: tuple[float, ...] = ()
        # ... and of what every group saves, for a profile predicted at its length bucket's tokens
        # beyond its own (the square of the ratio: bytes with the square of the tokens); else 1
        self._bucket_share = 1.0
        self._explore = EXPLORE  # plans that may run beyond the model's first choice
        self.planning_s = 0.0  # host seconds spent making and choosing plans, all told
        self.planning_by: collections.defaultdict[str, float] = collections.defaultdict(float)  # ... by what
        # the whole search runs in a helper process where one serves (CUDA: the step's device
        # work goes on while the host plans); until it answers, a quick one's plans (:meth:`_plan_all`)
        self._worker = _worker_for(self._probe)
        self._pending: tuple[int, Profile, bool] | None = None  # (ticket, the profile searched, just adopted)
        self._quick_due = False  # a profile adopted as another step began: quick plans, if needed, as its own begins
        self._unwanted: Any = None  # lets the planning process drop the pending answer should this controller go
        self.background_planning_s = 0.0  # the helper's seconds searching for this workload

    # ------------------------------------------------------------------ what it knows
    @property
    def budget(self) -> int:
        return self._budget

    @property
    def probe(self) -> Probe:
        return self._probe

    @property
    def state(self) -> State:
        return self._state

    @property
    def profiling(self) -> bool:
        """Whether this step is a profiling step."""
        return self._step is not None

    @property
    def settled(self) -> bool:
        """Whether the plan is final: profiled, chosen, and on CUDA measured with nothing left
        to try, so that the steps from now on run as the plan will (until a step goes over
        the budget or the workload changes). Known from the step after the deciding one."""
        return self._state is State.SETTLED

    @property
    def profile(self) -> Profile | None:
        """The profile plans are modelled on (``None`` until profiled)."""
        return self._profile

    @property
    def plans(self) -> tuple[MemoryPlan, ...]:
        """Every plan considered under the profile: the search's candidates, the profiled plan last
        (a prediction whose plan keeping everything fits: that plan and the profiled one, until a
        search is made)."""
        return tuple(self._plans)

    @property
    def plan(self) -> MemoryPlan | None:
        """The plan that runs (``None`` while none was chosen)."""
        return self._plan

    @property
    def reserve(self) -> AllocatorReserve:
        """What the allocator reserves beyond the allocated peak (:mod:`~.reserve`)."""
        return self._reserve

    @property
    def margin(self) -> int:
        """Bytes the model's peaks are raised by for its overshoots so far (beyond the least
        margin, :func:`~.tolerances.least_margin`)."""
        return self._margin

    @property
    def profiling_steps(self) -> tuple[MeasuredStep, ...]:
        """What the profiling steps behind the current profile measured, oldest first."""
        return self._measured_steps

    def measured_plans(self) -> list[Measured]:
        """Each plan that ran since the last profiling, in the order of :attr:`plans`."""
        out, seen = [], set()
        base = self._profile.base if self._profile is not None else 0
        for p in self._plans:
            k = p.key
            if k in self._runs and k not in seen:
                seen.add(k)
                times = tuple(self._times.get(k, ()))
                out.append(Measured(p, self._runs[k], self._peaks[k] + base if k in self._peaks else None, times,
                                    self._time_of(p) if self._timed(k) else None))
        return out

    @property
    def next_position(self) -> int:
        """The place in the plan of the group opening next (a module run whole takes its parts')."""
        return self._position

    def window(self) -> tuple[int, int] | None:
        """``(max_inflight, prefetch)`` the plan sets, or ``None`` to use the settings."""
        if self._step is not None:
            return 0, 0
        return (self._plan.max_inflight, self._plan.prefetch) if self._plan is not None else None

    # ------------------------------------------------------------------ what it is told
    def adopt_profile(self, profile: Profile, profiled_peak: int | None = None) -> None:
        """Plan from ``profile`` as if profiling steps had just measured it (``profiled_peak``:
        the peak they measured, bytes, by which the profiled plan is then judged). What the
        end of profiling does; a driver with a profile of its own (a test) calls it."""
        self._adopt_measured(profile, profiled_peak)
        self._raise_found()  # the caller's: it may hear that no plan fits

    @property
    def has_first_step(self) -> bool:
        """Whether it ran its first profiling step and not yet its second (nor another since)."""
        return self._partial is not None and self._step is None and self._profile is None

    def profile_from_first_step(self) -> bool:
        """Plan from the first profiling step alone, its second not yet run (whether it did: a
        profile is then adopted). For a workload whose next step may never come: where the step
        after it is another's (lengths drawn per step from a continuous range, each seen once),
        waiting for a second would leave every workload profiling and none to predict from. Its
        times are the first step's (pinning, the allocator's growth), which the plans' measured
        steps correct as for any profile.

        Example::

            if controller.profile_from_first_step():
                controller.profile          # measured from one step"""
        if not self.has_first_step:
            return False
        assert self._partial is not None
        profile, self._partial = self._partial, None
        self._measured_steps, self._pending_steps = tuple(self._pending_steps), []
        self._adopt_measured(profile, self.profiled_peak if self._probe.cuda else None, defer=True)
        return True

    def take_displaced(self) -> tuple[Profile, int | None, tuple[MeasuredStep, ...]] | None:
        """The first profiling step this controller measured and then let go, as another
        workload's (its profile, its peak, its measured step), once; else ``None``."""
        displaced, self._displaced = self._displaced, None
        return displaced

    def adopt_displaced(self, profile: Profile, profiled_peak: int | None, steps: tuple[MeasuredStep, ...]) -> None:
        """Plan from a profiling step another workload's controller measured and let go (one of
        this workload's steps that it took while profiling, then found to be another's): as from
        this workload's own profiling, of one step. Should no plan fit, that is raised as this
        workload's next step begins."""
        self._measured_steps = steps
        self._adopt_measured(profile, profiled_peak, defer=True)  # (as another workload's step begins)

    def _adopt_measured(self, profile: Profile, profiled_peak: int | None, defer: bool = False) -> None:
        """Plan from a measured profile; ``defer``: its first choice waits for this workload's
        next step to begin (:meth:`_step_begins`), by when the planning process may have answered."""
        self.predicted, self._explore, self._least_shares, self._bucket_share = False, EXPLORE, (), 1.0
        self._adopt(profile, profiled_peak, defer=defer)
        if not self._quick_due:
            self._choose_first()

    def _choose_first(self) -> None:
        """The first choice under a profile measured."""
        if self._pending is not None and all(q > self._budget for q in self._judged_peaks(False)):
            self._collect(wait=True)  # whether the budget is too small is the search's to say
        else:
            self._choose()

    def adopt_prediction(self, profile: Profile, window: tuple[int, int] | None = None,
                         least_shares: Sequence[float] = (), shared: SharedPredictions | None = None,
                         bucket_share: float = 1.0) -> bool:
        """Plan from a profile predicted for this workload (:mod:`~.predict`) before it ran: only
        where a plan's modelled peak, with the least margin, fits the budget (else ``False``,
        and nothing changes: the step profiles, running the plan that needs the least memory).
        The plan chosen is the fastest that fits, as for a profile measured; ``window``: the
        ``(max_inflight, prefetch)`` the paths of the search keep (the hand-written plans keep theirs);
        ``least_shares``: per group, the least share of its predicted saved bytes that its own may
        turn out to be and still be this workload (:func:`~.predict.least_shares`: fewer, it is
        profiled; a group not given, ``bucket_share``); ``shared``: where the search made for this
        profile (the same object) under the same windows and limits is kept, it is not made again
        (:mod:`~.buckets`); ``bucket_share``: the least share of its predicted bytes that any group
        may save, the profile predicted at more tokens than the workload's (its length bucket's),
        for a recomputed group's inputs and kept outputs too."""
        if self._profile is not None or self._step is not None:
            raise RuntimeError("a prediction is adopted by a controller that has neither profile nor profiling step")
        with self.planning_time("candidates"):
            keeping = search.keeping_everything(profile)
        if self._fits_by_model(keeping):
            # the fastest plan of all fits: searching would find it again, tens of milliseconds
            # of a step's host time per length bucket (searched once it no longer fits: _choose)
            plans, quick, owed = [keeping], False, True
        else:
            plans, quick = self._predicted_candidates(profile, window, shared)
            owed = False
            if not any(self._fits_by_model(p) for p in plans):
                return False
        self._adopt(profile, None, plans)
        self._owed = (keeping.key, window, shared) if owed else None
        self._ask_whole_search(window, quick)
        self.predicted, self._least_shares, self._bucket_share = True, tuple(least_shares), bucket_share
        # the profile it was predicted from was explored and calibrated already: its model's
        # first choice runs, and is measured like any plan (its peak checked, its time taken)
        self._explore = 0
        self._choose()
        return True

    def _fits_by_model(self, plan: MemoryPlan) -> bool:
        """Whether a plan fits the budget by its modelled peak, the least margin and the reserve:
        as a prediction is adopted, before any step of it ran (no margin, nothing measured)."""
        return plan.peak + least_margin(self._budget) + self._reserve.bytes <= self._budget

    def _predicted_candidates(self, profile: Profile, window: tuple[int, int] | None,
                              shared: SharedPredictions | None, quick: bool = True) -> tuple[list[MemoryPlan], bool]:
        """The candidates for a predicted profile, and whether they are a quick search's (the whole
        search then asked of the planning process: :meth:`_ask_whole_search`): under the copy
        window its source settled on (a ninth of the paths); where the planning process serves
        (and ``quick``), that path alone here, and the hand-written families from the process (but
        the whole search says whether none fits, and searches here should it not answer)."""
        windows = None if window is None else [window]

        def searched(limits: Sequence[int] | None) -> list[MemoryPlan]:  # (None: the quick search)
            def make() -> list[MemoryPlan]:
                with self.planning_time("prediction's search"):
                    return (search.quick_candidates(profile, window) if limits is None
                            else search.candidates(profile, windows, limits=limits))
            return make() if shared is None else shared.search(profile, windows, limits, make)

        quick = quick and self._worker is not None
        plans = searched(None if quick else self._limits())
        if quick and not any(self._fits_by_model(p) for p in plans):
            plans, quick = searched(self._limits()), False
        return plans, quick

    def _ask_whole_search(self, window: tuple[int, int] | None, quick: bool) -> None:
        """After a quick search's plans: the whole search, from the planning process (else here)."""
        if not quick:
            return
        assert self._profile is not None
        windows = None if window is None else [window]
        if not self._ask(windows, fresh=True):
            self._plan_all(search.candidates(self._profile, windows, limits=self._limits()))

    def _search_if_owed(self) -> None:
        """A prediction adopted with keeping everything alone (it fitted) is searched once that
        no longer fits: the reserve grew, or it ran over the budget."""
        if self._owed is None or self._forced is not None or self._profile is None:
            return
        keeping, window, shared = self._owed
        if any(p.key == keeping for p in self._fitting()):
            return
        plans, quick = self._predicted_candidates(self._profile, window, shared)
        self._plan_all(plans)
        quick_keys = {p.key for p in plans}
        if quick and not any(p.key in quick_keys for p in self._fitting()):
            # the quick plans judged as every candidate is (the margin an overshoot of keeping
            # everything raised, its measured peak): none fits, so the whole search is made here,
            # which says whether any plan does
            plans, quick = self._predicted_candidates(self._profile, window, shared, quick=False)
            self._plan_all(plans)
        self._ask_whole_search(window, quick)

    def _adopt(self, profile: Profile, profiled_peak: int | None, plans: list[MemoryPlan] | None = None,
               defer: bool = False) -> None:
        self._step, self._partial = None, None
        self._profile, self.profiled_peak, self._margin = profile, profiled_peak, 0
        self._peaks, self._times, self._runs, self._calibrated = {}, {}, {}, 0
        self._left = set()
        self._unheld = set()
        self._kept_first, self._host_of, self._moves_of, self._host_bound = self._kept_carried, {}, {}, None
        self._kept_carried = {}
        self._lighter_steps, self._lighter_now = 0, False
        self._served, self._went_over = {}, set()
        self._hooked = next((i for i, g in enumerate(profile.groups) if g.reached), 0)
        self._untimed = []  # steps of the old profile's plans, maybe not over when profiling began
        self._plan_all(plans, fresh=True, defer=defer)
        self._last_run = None
        if profiled_peak is not None:  # it ran: its peak is known
            self._peaks[self._plans[-1].key] = profiled_peak - profile.base
            self._last_run = self._plans[-1].key
        self._plan, self._state = None, State.EXPLORING

    def force(self, groups: Sequence[GroupDecision] | None, max_inflight: int = 0, prefetch: int = 0) -> None:
        """Run this plan from now on (after profiling, once a profile is known), whatever the
        budget and the model say; ``None``: choose again. For diagnostics and tests that
        measure one plan."""
        self._forced = None if groups is None else (tuple(groups), max_inflight, prefetch)
        if self._profile is not None and self._step is None:
            self._choose_before_step()  # should no plan fit, the least memory is chosen first
            self._raise_found()  # the caller's: it may hear that no plan fits

    def backward_ends(self) -> None:
        """The step's backward pass is over. The controller asks autograd to call this at the
        end of the backward pass that first reaches a group; a driver without autograd (a
        test) calls it itself."""
        self._backward_ended(self._step_number)

    # ------------------------------------------------------------------ a step
    def finish_step(self) -> None:
        """The latest step is over: another step, of any workload, is beginning. A profiling
        step's measurements become the profile now, not when this workload's next step begins,
        so that a workload never seen, beginning next, can be predicted from it. (Not at the end
        of the backward pass: a step may run several, one per micro-batch.)"""
        if self._step is not None and not self._awaiting_end and not self._cut_short:
            self._finish_profiling(self._probe.mark())

    def step_begins(self, may_raise: bool = True) -> None:
        """The first group of a step is opening: close the last step, set up this one. Raises
        :class:`~.search.BudgetTooSmall` (once) where no plan fits the budget (``may_raise=False``:
        a step begun in backward, where raising would break the pass: at the next that may)."""
        self._beginning = may_raise
        try:
            self._step_begins()
        finally:
            self._beginning = False

    def _step_begins(self) -> None:
        now = self._probe.mark()
        # its backward raised, or its forward was cut short: what it measured is no step's
        unfinished = self.unfinished_step
        self._awaiting_end = self._cut_short = False
        self._step_number += 1
        if not self._lighter_now:
            self._lighter_steps = 0
        self._lighter_now = False
        if self._step is not None:
            if unfinished:
                self._step = None  # what it measured is dropped: profile again
            else:
                self._finish_profiling(now)
        else:
            self._time_steps(wait=self._measurement_pending())
        base = self._probe.allocated()
        if self._profile is not None and abs(base - self._profile.base) > base_tolerance(self._budget):
            # What is allocated when the first group opens changed: gradients kept from the last
            # step (then backward accumulates into them, allocating nothing), optimizer state made
            # after the first. The profile's peaks no longer hold, and shifting them would count
            # kept gradients twice: measure again.
            self._replan()
        if self._state in (State.EXPLORING, State.SETTLED):
            self._collect()
        if self._quick_due and self._state in (State.EXPLORING, State.SETTLED) and self._profile is not None:
            # profiled as another workload's step began, and the planning process has not answered
            # yet: its quick search's plans until it does (where it has, as on an H200 in the loop
            # sweep's decoder, whose profile is made as a shorter step begins, no quick search ran)
            with self.planning_time("quick search"):
                quick = search.quick_candidates(self._profile)
            self._plan_all(quick)
            self._choose_first()
        if self._state in (State.PROFILING, State.REPLANNING):
            if self._beginning:
                # before a profiling step is set up: the step begun again would finish it, empty
                self._raise_found()
            self._state = State.PROFILING
            self._reserve.bind(self, False)  # no plan of its runs: it binds no other workload's
            self._quick_due = False
            self._step = _Step(start=self._probe.mark(), base=base)
        elif self._plan is None and self._profile is not None:
            self._choose()  # no plan was chosen (no plan fitted the budget where it was raised)
        elif (self._plan is not None and self._forced is None and self.too_small is None
              and self._reserve.bytes > self._reserve_judged):
            # another workload's step grew the reserve (one allocator): judged again before it runs
            self._reserve_judged = self._reserve.bytes
            if not self._fits_now(self._plan):
                self._choose_before_step()
        if self._beginning:
            self._raise_found()  # found choosing above, or where raising would have broken a pass
        self._reserve.step_begins(self._probe, self._budget, reachable=self._reaches_budget,
                                  needs=self._needs_on_a_new_cache,
                                  profiling=len(self._pending_steps) + 1 if self._step is not None else 0)
        if (self._reserve.trims != self._trims_judged and self._step is None and self._plan is not None
                and self._forced is None and self._plan.key in self._served):
            # it may have been judged on a cache given back since (as this step began, or in another
            # workload's step): judged again as on a cache of its own
            self._trims_judged = self._reserve.trims
            if not self._fits_now(self._plan):
                self._choose_before_step()
                if self._beginning:
                    self._raise_found()
        self._probe.reset_peak()
        # after choosing (tens of milliseconds of host time while plans are tried, the device
        # idle): a step's measured time is the plan's, not the controller's
        self._step_start = self._probe.mark()
        self._host_at_start = self._host_allocations()
        self._position = 0
        self._step_backwards = 0
        self._step_key = self._plan.key if self._step is None and self._plan is not None else None
        if self._step_key is not None:
            self._runs[self._step_key] = self._runs.get(self._step_key, 0) + 1
            self._last_run = self._step_key

    def _reaches_budget(self) -> bool:
        """Whether this step's plan may stay within the budget on a cache of its own: a cache
        over the budget is then given back as the step begins, being no use to it. So where
        the plan is judged within it (a step profiling: not known, taken to), and where it runs
        over it by the model (no plan reaches it; the least memory where the margins rule out
        every plan; a forced plan) until it has gone over on a cache given back just before it:
        from then on emptying the cache at every step would change nothing."""
        if self._plan is None or self._step is not None:
            return True
        if self.too_small is None and self._forced is None and self._fits_now(self._plan):
            return True
        return self._plan.key not in self._over_on_own_cache

    def _needs_on_a_new_cache(self) -> int | None:
        """The reserved peak this step's plan is judged by (bytes), as :meth:`_fitting` judges it
        on a cache of its own, where it has not run on the cache as it stands (one that served it
        serves it again) and may stay within the budget on a cache of its own
        (:meth:`_reaches_budget`: also a plan over it by the model, the least memory where no plan
        fits, until it went over on such a cache); else ``None`` (a forced plan). On an H200 the
        decoder's 2048 tokens at checkpointing's peak, the least memory there, reserved 5.67 GiB on
        caches their own steps built, and 7.86 on one 1536-token steps had built after the cache
        was given back: 1.70 over. A profiling step's need is not known (``None``): a workload's
        first begins on a cache of its own wherever steps of other lengths grew the one there
        (:meth:`~.reserve.AllocatorReserve.step_begins`, docs/budgets.md "The reserve on a GPU");
        its second on the cache as it stands (its times are the profile's, without the
        allocator's growth)."""
        if self._step is not None:
            return None
        plan = self._plan
        if plan is None or self._profile is None or self._forced is not None:
            return None
        if plan.key in self._served_now() or not self._reaches_budget():
            return None
        with self.planning_time("choosing"):  # (asked only where shorter steps grew the cache)
            judged = self._judged_peaks(True, by_cache=False)
            return min((q for p, q in zip(self._plans, judged) if p.key == plan.key), default=None)

    def _raise_found(self) -> None:
        """Raise the :class:`BudgetTooSmall` choosing found (having chosen the least memory) since
        the last raise, once."""
        if self._raise_next is not None:
            message, self._raise_next = self._raise_next, None
            raise BudgetTooSmall(message)

    def _choose_before_step(self) -> None:
        """Choose again as a step begins: should no plan fit, the least memory is chosen first
        and the error raised after (``_raise_next``, below the call), and only the whole search
        says so (a planning process's answer still to come is waited for, as after profiling)."""
        if self._pending is not None and all(q > self._budget for q in self._judged_peaks(False)):
            self._collect(wait=True)
        else:
            self._choose()

    def _at_its_pace(self) -> bool:
        """Whether the step ending, its plan's first, allocated no host memory (as counted by
        the probe; uncounted: assumed it did) and grew no cache: then it is timed like the steps
        after it."""
        now = self._host_allocations()
        return now is not None and now == self._host_at_start and not self._reserve.cache_grew

    def _host_allocations(self) -> int | None:
        """The probe's count of the offloader's host allocations (a probe of one's own without
        the count: not counted)."""
        count = getattr(self._probe, "host_allocations", None)
        return None if count is None else count()

    def _replan(self) -> None:
        """The workload changed: the plan runs to the end of this step, the next profiles."""
        if self._state is not State.PROFILING:
            self._state = State.REPLANNING

    def _saves_differ(self, more: bool) -> None:
        """A group of this step saves another workload's bytes: ``more`` than profiled, profile
        at the next step; less, once ``LIGHTER_STEPS`` steps in a row did (a predicted profile's
        bound from above aside: it is profiled at once, as its plan was made for a guess)."""
        if more or self.predicted:
            self._replan()
        elif not self._lighter_now:
            self._lighter_now = True
            self._lighter_steps += 1
            if self._lighter_steps >= LIGHTER_STEPS:
                self._replan()

    def whole_next(self, parts: int, inputs: int) -> bool:
        """Whether the module opening now, whose ``parts`` are groups, runs whole as one
        recomputed group (saving its ``inputs``, bytes). While profiling its parts are the
        groups, and it is noted once its forward opened exactly those."""
        i = self._position
        if self._step is not None:
            self._step.open_whole = Whole(i, parts, inputs)
            return False
        whole = self._profile.whole_at.get(i) if self._profile is not None else None
        if self._plan is None or whole is None or whole.parts != parts:
            return False
        return self._plan.groups[i].action.whole

    def whole_closed(self, parts: int) -> None:
        """A module whose parts are groups, not run whole, is done: while profiling, it may be
        run whole later if its forward opened its parts and nothing else."""
        step = self._step
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
        if self._step is not None or self._plan is None or i >= len(self._plan.groups):
            return False
        if self._plan.groups[i].action is not Action.KEEP or i == self._hooked:
            return False
        self._position += 1
        return True

    def action(self, recomputable: bool, parts: int = 0) -> GroupDecision:
        """What the next group of this step does (it is opening; ``parts``: a module run whole)."""
        i = self._position
        self._position += parts or 1
        if self._step is not None:
            meter = OpMeter(self._probe.mark, self._probe.seconds) if recomputable and self._partial is None else None
            self._step.groups.append(_Group(recomputed=recomputable, start=self._probe.mark(),
                                            allocated_at_start=self._probe.allocated(),
                                            host_start=self._probe.host_clock(), meter=meter))
            self._probe.reset_peak()
            return costmodel.profiling_decision(recomputable)
        assert self._plan is not None and self._profile is not None
        planned = self._plan.groups[i] if i < len(self._plan.groups) else None
        if (planned is None or (planned.action.recomputes and not recomputable)
                or planned.action is Action.INSIDE or planned.action.whole != bool(parts)):
            # more groups than profiled, another kind, or a module's parts run without it: a new workload
            self._replan()
            return GroupDecision(Action.OFFLOAD)
        return planned

    def costly_calls(self, position: int, attention_only: bool = False) -> int | None:
        """How many of the costly ops of the group at ``position`` (its fused attention calls,
        ``attention_only``) its recomputation reaches, as profiled (a selective recomputation
        keeps only their outputs); ``None``: all."""
        profile = self._profile
        if profile is None or position >= len(profile.groups):
            return None
        g = profile.groups[position]
        return g.attention_calls if attention_only else g.costly_calls

    @property
    def unfinished_step(self) -> bool:
        """Whether the latest step's forward was cut short, or its backward raised: the groups it
        opened say nothing of how many its workload's steps open."""
        return self._awaiting_end or self._cut_short

    def forward_cut_short(self) -> None:
        """This step's forward was cut short by an exception and begins again: what it measured
        is dropped as the next step begins (a profiling step profiles again), as for a step whose
        backward raised."""
        self._cut_short = True

    def unmetered(self, position: int) -> None:
        """The group at ``position`` runs compiled code: its ops are not metered (profiling), so
        that no plan recomputes it selectively (both run the forward under a dispatch mode)."""
        step = self._step
        if step is not None and position < len(step.groups):
            step.groups[position].meter = None

    def op_meter(self, position: int) -> OpMeter | None:
        """The meter of the costly ops of the group at ``position`` (profiling), else ``None``."""
        step = self._step
        return step.groups[position].meter if step is not None and position < len(step.groups) else None

    def group_closing(self, position: int) -> None:
        if self._step is not None and position < len(self._step.groups):
            m = self._step.groups[position]
            m.end = self._step.last_exit = self._probe.mark()
            m.host_end = self._probe.host_clock()
            m.forward_peak = max(0, self._probe.peak() - m.allocated_at_start)
            self._probe.reset_peak()

    def move_at_most(self, position: int, decision: GroupDecision) -> int | None:
        """Bytes the plan lets the group at ``position`` move (``None``: all it can)."""
        if not decision.action.moves:
            return 0
        if ((decision.action.moves_inputs and not decision.action.selective) or self._step is not None or self._profile is None
                or position >= len(self._profile.groups)):  # more groups than profiled: all it can
            return None
        return costmodel.moved(decision, self._profile.groups[position])

    def committed(self, position: int, recomputed: bool, plan: policy.SavePlan, would_save: policy.SavePlan | None,
                  min_move: int = 0, save_policy: str = "all") -> None:
        """A group's commit: what it saved (profiling), or whether the workload changed;
        ``min_move``: the offloader's ``min_offload_bytes`` (a smaller span stays); ``save_policy``:
        its ``policy``, which with the marks says what may move (R3, R4)."""
        moved = sum(s.nbytes for s in plan.spans)
        kept = sum(n for reason, n in plan.stayed if reason not in ("parameter",))
        if self._step is not None:
            if position >= len(self._step.groups):
                return
            m = self._step.groups[position]
            m.moved, m.min_move = moved, min_move
            if recomputed:
                m.inputs = moved + kept
                held = sum(n for reason, n in plan.stayed if reason in policy.HELD_BY_MARKS)
                m.inputs_moving = m.inputs - held if held else None
                m.save_policy = save_policy
                if m.meter is not None:  # its outputs that live still are marked as they will be
                    m.meter.read_marks()
                inner = would_save or policy.SavePlan([], [])
                m.spans = tuple(sorted((s.nbytes for s in inner.spans), reverse=True))
                m.kept = sum(n for reason, n in inner.stayed if reason != "parameter")
            else:
                # what stayed for want of host room (move_at_most) may move under a plan: its spans too
                short = [n for reason, n in plan.stayed if reason == "budget"]
                m.spans = tuple(sorted([s.nbytes for s in plan.spans] + short, reverse=True))
                m.kept = kept - sum(short)
            return
        if self._profile is None or position >= len(self._profile.groups):
            return
        decision = self._plan.groups[position] if self._plan is not None else None
        if decision is not None and decision.action is Action.KEEP:
            # counted by whole storages, not spans: compared with its own first count
            kept = sum(n for r, n in plan.stayed if r == "budget")
            first = self._kept_first.setdefault(position, kept)
            if new_workload(kept, first):
                if kept > first:
                    # counted against the first step under the plan, not the profile: the next
                    # profile's steps count from this one, so that a lighter variant's first step,
                    # where variants take turns, does not set them a count the heavier one passes
                    self._kept_first[position] = kept
                    self._kept_carried = dict(self._kept_first)
                self._saves_differ(more=kept > first)
            return
        g = self._profile.groups[position]
        now = (moved + kept) if recomputed else (moved + sum(n for r, n in plan.stayed if r == "budget"))
        then = (g.inputs or 0) if recomputed else g.offloadable
        if decision is not None and decision.action.selective:  # its costly outputs are its saves too
            then += g.kept_bytes(decision.action.attention_only)
        if decision is not None and decision.action.whole:
            then = self._profile.whole_at[position].inputs
        # a predicted group's saved bytes, where they are the bound from above, may come in lower,
        # as low as the model allows, and be the workload predicted (its plan, made for more, stays
        # within the budget); its inputs are predicted as they are, but at the bucket's tokens
        least = (self._least_shares[position] if not recomputed and position < len(self._least_shares)
                 else self._bucket_share)
        if new_workload(now, then) and not then * least * (1 - WORKLOAD_CHANGE) <= now < then:
            self._saves_differ(more=now > then)

    def backward_reaches(self, position: int) -> None:
        if not self._awaiting_end:
            self._awaiting_end = True
            number = self._step_number
            compat.at_backward_end(lambda: self._backward_ended(number))
        step = self._step
        if step is None or position >= len(step.groups):
            return
        now = self._probe.mark()
        peak = self._probe.peak()
        self._probe.reset_peak()
        if step.last_touch is None:
            step.outside_peak = peak  # the head and loss, between the last group and backward
        else:
            step.groups[step.last_touch].backward_peak = max(step.groups[step.last_touch].backward_peak, peak)
        step.groups[position].touched = now
        step.last_touch = position

    def recompute_begins(self, position: int) -> None:
        """Backward recomputes the group at ``position``: what came before is its backward's."""
        step = self._step
        if step is None or position >= len(step.groups):
            return
        m = step.groups[position]
        m.backward_peak = max(m.backward_peak, self._probe.peak())
        self._probe.reset_peak()
        if m.recompute_start is None:
            m.recompute_start = self._probe.mark()
            m.recompute_host_start = self._probe.host_clock()

    def recompute_ends(self, position: int) -> None:
        step = self._step
        if step is None or position >= len(step.groups):
            return
        m = step.groups[position]
        m.recompute_peak = max(m.recompute_peak, self._probe.peak())
        self._probe.reset_peak()
        if m.recompute_end is None:
            m.recompute_end = self._probe.mark()
            m.recompute_host_end = self._probe.host_clock()

    def _backward_ended(self, number: int) -> None:
        """The step's backward pass is over: its peak (and, while profiling, the end of the
        first group's backward). An overshoot of the budget widens the margin."""
        if number != self._step_number:
            return  # a step already closed (its backward ended after the next step began)
        self._awaiting_end = False
        self._step_backwards += 1
        self._several_backwards |= self._step_backwards > 1
        now = self._probe.mark()
        if self._step is not None:
            step = self._step
            step.backward_end = now
            if step.last_touch is not None:  # the first group's backward ran until now
                last = step.groups[step.last_touch]
                last.backward_peak = max(last.backward_peak, self._probe.peak())
            # the peak counters were reset group by group; what the allocator reserves only grows
            # within a step (nothing gives its cache back before this), so its peak is what it holds now
            self._reserve.step_ended(self._probe, self._budget, _profiled_peak(step),
                                     max(self._probe.peak_reserved(), self._probe.reserved()))
            return
        self.measured_peak = self._probe.peak()
        self.measured_reserved_peak = self._probe.peak_reserved()
        grew = self._reserve.step_ended(self._probe, self._budget, self.measured_peak, self.measured_reserved_peak)
        misjudged = self._step_key is not None and self._note_cache(self._step_key, self.measured_reserved_peak)
        self._last_span = (self._step_start, now)
        if self._plan is None or self._profile is None:
            return
        if not self._probe.cuda:  # host time says nothing of a device's pace
            return
        key = self._step_key
        if key is None:
            return
        # a first step that pinned host memory or grew the cache is not its plan's pace; once
        # measured, choosing again at every step would cost host time for nothing; a step that
        # found another workload is not this plan's
        runs = self._runs.get(key, 0)
        this_step = bool(self._untimed) and self._untimed[-1][1] is self._step_start
        if ((runs >= 2 or (runs == 1 and self._at_its_pace())) and not self._timed(key)
                and self._state is not State.REPLANNING):
            if this_step:
                self._untimed[-1] = (key, self._step_start, now)  # the step's later backward pass
            else:
                self._untimed.append((key, self._step_start, now))
        elif this_step and runs == 1:
            self._untimed.pop()  # a later backward pass of its first step pinned or grew: not its pace
        before = self._peaks.get(key)
        self._peaks[key] = max(before or 0, self.measured_peak - self._profile.base)
        if not self._several_backwards and self._measurement_pending():
            # the step that completes the plan's measurement: waited for here (once a plan, the
            # host then issues the next step's work behind the device), so that the next step
            # already runs what the measurement chooses, not one more of this plan
            self._time_steps(wait=True)
        if self.too_small is not None:
            # no plan reaches the budget (nor will: margins only grow), but which needs the least
            # memory may change with what this step measured (:meth:`_least_memory`)
            if self._peaks[key] != before or misjudged:
                self._choose()
            return
        if self.measured_peak > self._budget:  # the model misjudged the plan's allocated bytes
            self._margin += overshoot_margin(self._budget, self.measured_peak)
            self._choose()
        elif (grew or self._peaks[key] != before) and self.measured_peak + self._reserve.bytes > self._budget:
            self._choose()  # with what the allocator adds, it no longer fits (it did when chosen)
        elif misjudged:
            self._choose()  # its cache did not serve it again: judged by the reserve from now on

    # ------------------------------------------------------------------ planning
    def _finish_profiling(self, end: Any) -> None:
        step, self._step = self._step, None
        assert step is not None
        if not step.groups:
            # Every group of the step opened under saved-tensor hooks that own its saves
            # (activation checkpointing around it): none is the plan's to decide, and the whole
            # step's peak is outside the groups. Profiled as such, its plan (of no groups) settles
            # rather than profiling for ever; a budget under that peak is too small.
            step.outside_peak = max(step.outside_peak, self._probe.peak())
        peak = _profiled_peak(step)
        if any(m.end is None for m in step.groups):
            self._partial, self._pending_steps = None, []  # profile again
            return
        measured = self._measured_step(step, end)
        profile = costmodel.profile_of(measured)
        self._pending_steps.append(measured)
        if self._partial is not None:
            if costmodel.same_workload(self._partial, profile, base_tolerance(self._budget)):
                profile = costmodel.merged(self._partial, profile)
                peak = max(peak, self.profiled_peak or 0)
            else:  # the latest alone: its workload and base hold from now on
                # the first was another base's (a micro-batch's that began with no gradients, say):
                # kept for whoever keeps the workloads, to plan that one from it
                self._displaced = (self._partial, self.profiled_peak, tuple(self._pending_steps[:-1]))
                self._pending_steps = [measured]
            self._partial = None
        elif PROFILE_STEPS > 1:  # the first of the profiling steps
            self._partial, self.profiled_peak = profile, peak
            return
        self._measured_steps, self._pending_steps = tuple(self._pending_steps), []
        # (made as the next step begins, of any workload: a workload never seen is predicted from
        # it now, its own plans are chosen as its own next step begins)
        self._adopt_measured(profile, peak if self._probe.cuda else None, defer=True)

    def _measured_step(self, step: _Step, end: Any) -> MeasuredStep:
        """What one profiling step's marks say, in seconds and bytes."""
        if self._bandwidth is None:
            self._bandwidth = self._probe.bandwidth()
        d2h, h2d = self._bandwidth
        seconds = self._probe.seconds
        touches = [m.touched for m in step.groups]
        groups = []
        for i, m in enumerate(step.groups):
            after = touches[i - 1] if i > 0 and touches[i - 1] is not None else (step.backward_end or end)
            groups.append(MeasuredGroup(
                recomputed=m.recomputed, forward_s=seconds(m.start, m.end),
                backward_s=seconds(m.touched, after) if m.touched is not None else None,
                recompute_s=(seconds(m.recompute_start, m.recompute_end)
                             if m.recompute_start is not None and m.recompute_end is not None else None),
                moved=m.moved, spans=m.spans, kept=m.kept, inputs=m.inputs, inputs_moving=m.inputs_moving,
                costly_moving=_moving(m.meter, m.save_policy, False), attention_moving=_moving(m.meter, m.save_policy, True),
                forward_peak=m.forward_peak,
                backward_peak=m.backward_peak, recompute_peak=m.recompute_peak,
                host_s=_between(m.host_start, m.host_end), recompute_host_s=_between(m.recompute_host_start,
                                                                                     m.recompute_host_end),
                costly=tuple(m.meter.costly) if m.meter is not None else None,
                costly_calls=m.meter.reached if m.meter is not None else None, min_move=m.min_move,
                costly_s=m.meter.costly_s() if m.meter is not None and m.recompute_end is not None else None,
                attention=tuple(m.meter.attention) if m.meter is not None else None,
                attention_calls=m.meter.attention_reached if m.meter is not None else None,
                attention_s=m.meter.attention_s() if m.meter is not None and m.recompute_end is not None else None))
        outside = 0.0
        if step.last_exit is not None and touches[-1] is not None:
            outside = seconds(step.last_exit, touches[-1])
        return MeasuredStep(step.base, tuple(groups), outside, step.outside_peak, d2h, h2d, tuple(step.wholes))

    def _plan_all(self, plans: list[MemoryPlan] | None = None, fresh: bool = False, defer: bool = False) -> None:
        """Every candidate plan under the current profile, the profiled plan last. ``plans``:
        the search's, made already; else searched here, or asked of the planning process
        (:meth:`_ask`), and until it answers (:meth:`_collect`) the candidates stay as they were,
        or for a ``fresh`` profile are those of a quick search (:func:`~.search.quick_candidates`);
        ``defer``: made as this workload's next step begins, should the answer not be there by
        then (:meth:`_step_begins`), the profiled plan alone until then."""
        assert self._profile is not None
        self._quick_due, self._owed = False, None
        if plans is None and self._ask(fresh=fresh):
            if not fresh:
                return
            if defer:
                self._quick_due, plans = True, []
            else:
                with self.planning_time("quick search"):
                    plans = search.quick_candidates(self._profile)
        with self.planning_time("search" if plans is None else "candidates"):
            self._plans = search.candidates(self._profile, limits=self._limits()) if plans is None else list(plans)
            self._index = None
            # a plan that ran stays a candidate, should the search no longer propose it (the
            # profile was calibrated): what it measured still stands
            profiled = costmodel.profiled_plan(self._profile)
            known = {p.key for p in self._plans} | {(profiled, 0, 0)}
            for groups, max_inflight, prefetch in [k for k in self._runs if k not in known]:
                self._plans.append(MemoryPlan(groups, max_inflight, prefetch,
                                              *simulate(self._profile, groups, max_inflight, prefetch)))
            self._plans.append(MemoryPlan(profiled, 0, 0, *simulate(self._profile, profiled, 0, 0)))

    def _ask(self, windows: Sequence[tuple[int, int]] | None = None, fresh: bool = False) -> bool:
        """Ask the planning process for the current profile's candidates (``windows``: as
        :func:`~.search.candidates` takes them; ``fresh``: a profile just adopted, whose quick
        search's plans run meanwhile; a request still unanswered is dropped: its profile is
        replaced); whether it took the request."""
        if self._worker is None:
            return False
        # a request replacing one for a profile just adopted (a calibration's, its quick plans
        # measured meanwhile) answers for that profile's quick plans too
        fresh = fresh or (self._pending is not None and self._pending[2])
        self._drop_pending()
        assert self._profile is not None
        try:
            with self.planning_time("asking"):
                ticket = self._worker.submit(self._profile, windows, self._limits())
        except planning.WorkerFailed as e:
            self._lose_worker(e)
            return False
        self._pending = (ticket, self._profile, fresh)
        self._unwanted = weakref.finalize(self, self._worker.forget, ticket)
        return True

    def _drop_pending(self) -> None:
        if self._pending is not None and self._worker is not None:
            self._worker.forget(self._pending[0])
        if self._unwanted is not None:
            self._unwanted.detach()
        self._pending, self._unwanted = None, None

    def _collect(self, wait: bool = False) -> None:
        """Take the planning process's answer, where it came (``wait``: wait for it), and choose
        among the new candidates: trying them as after a profiling step's own search."""
        if self._pending is None or self._worker is None:
            return
        ticket, profile, fresh = self._pending
        try:
            with self.planning_time("answer"):
                answer = self._worker.result(ticket, wait)
        except planning.WorkerFailed as e:  # searched here instead
            self._lose_worker(e)
            answer = None
            wait = True
        if answer is None and not wait:
            return
        self._drop_pending()
        if profile is not self._profile:
            return  # a later profile's request replaced it (_ask); none is left when it is not
        if answer is not None:
            plans, seconds = answer
            self.background_planning_s += seconds
            self._plan_all(plans)
        else:
            self._plan_all()
        if fresh:
            # the quick search's plans that ran meanwhile are not held until timed, and are no
            # tries of the whole search's model: its first choice (one of them or not), and
            # EXPLORE more, may still run (a predicted profile's plan moving nothing and its first
            # choice, as they would have: counted as tries, the quick plans had left a predicted
            # profile on two plans moving bytes, the bus modelled from another workload's, never
            # trying one that moves none); the plan the whole search opens with, where it ran
            # among them, stays held
            with self.planning_time("choosing"):
                fitting = self._fitting()
                opening: PlanKey | None = None  # what the whole search runs first (_fastest)
                if fitting:
                    first = self._first_choice(fitting)
                    still = self._still_to_try(fitting, first, None)
                    opening = (first if still is None else still).key
            quick = set(self._runs) - {opening}
            self._unheld |= quick
            self._explore += len(quick)
        if self._state is State.SETTLED:
            self._state = State.EXPLORING
        self._choose()

    def _lose_worker(self, error: BaseException) -> None:
        self._drop_pending()
        if self._worker is not None:
            planning.failed(self._worker, error)
        self._worker = None

    @contextlib.contextmanager
    def planning_time(self, what: str) -> Iterator[None]:
        """Counts the host time of making or choosing plans in :attr:`planning_s`, and by ``what``
        it was spent on in :attr:`planning_by` (``stats()["plan"]["planning_by"]``: what slows the
        steps that choose).

        Example::

            with controller.planning_time("predicting"):
                profile = predict.predicted(...)
        """
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.planning_s += seconds
            self.planning_by[what] += seconds

    def _choose(self) -> None:
        self._search_if_owed()
        before = self._plan.key if self._plan is not None else None
        with self.planning_time("choosing"):
            self._choose_plan()
        if self._plan is not None and self._plan.key != before:
            self._reserve.plan_changed(self._probe)

    def _choose_plan(self) -> None:
        """The fastest plan for the budget less the margin. A plan that has run is judged by
        its measured peak, against the budget itself (the margin covers the model's error,
        and a measured peak has none). The budget itself must be reachable (else the error
        names the smallest peak); where only the margin makes it unreachable, the plan that
        needs the least memory runs."""
        assert self._profile is not None
        if self._forced is not None:
            self._plan = self._forced_plan(*self._forced)
            self._unheld.add(self._plan.key)  # run as told: once let go, not held until timed
            self._reserve.bind(self, False)
            self._settle()
            return
        if self.too_small is None and all(q > self._budget for q in self._judged_peaks(False)):
            try:  # raises, naming the smallest reachable peak
                search.choose(self._profile, self._budget, self._judged(False))
            except BudgetTooSmall as e:
                # raised once the least memory is chosen, where raising is safe (_raise_found: this
                # step's beginning, else the next's); raised here, it left the plan that no longer
                # fits to run (too_small set, nothing judges it again)
                self.too_small = self._raise_next = str(e)
        fitting = self._fitting()
        # within the budget, if at all, only on the cache as it stands: the other workloads then
        # keep the plans that built it (_fastest)
        bound = not fitting
        if not fitting:
            chosen = self._least_memory()
        else:
            chosen = self._fastest(fitting)
            served = self._served_now()  # (a read of the allocator's counters: once, not per plan)
            if all(self._fits_only_on_its_cache(p.key, served) for p in fitting):
                # only plans judged by the cache they ran on fit: where the least memory (over the
                # budget by the model, as it ran before any did) is faster, it runs, and is judged
                # by its own steps from then on (else a slow plan that happened to run first would
                # stay: the decoder's 2048 tokens ran 165 ms a step at its smallest reachable
                # budget where the least memory ran 130)
                least = self._least_memory()
                if least.key not in self._went_over and self._pace(least) < self._pace(chosen):
                    chosen = least
            bound = self._fits_only_on_its_cache(chosen.key, served)
        self._plan = next(p for p in self._plans if p.key == chosen.key)
        self._reserve_judged, self._trims_judged = self._reserve.bytes, self._reserve.trims
        self._reserve.bind(self, self._probe.cuda and bound)  # (a GPU's cache: on the CPU none is bound)
        self._settle()

    def _least_memory(self) -> MemoryPlan:
        """The plan that runs where none fits: the least peak, and of the plans at it the one the
        model rates fastest; within the host budget where a plan is. A plan that ran is judged by
        its measured peak, one not yet run by its model and the most any plan that ran measured
        over its own model (not by the margins: they judge what fits, and would rank every plan
        not yet run behind one that ran at the same peak). On the loop sweep's decoder on an H200
        the profiled plan (every part recomputed with its inputs moved out) measured the peak the
        model gives every block recomputed whole so (the peak is the loss's), which runs 123 ms a
        step where the profiled plan ran 155, with the same 5.62 GiB reserved. Peaks here are
        allocated bytes: a plan tied with the least may still hold more in the allocator's cache
        (one with copies in flight reserved 0.5 GiB more on that decoder), which only its steps show."""
        # (its index of plans by identity made, as for every choice); by allocated bytes, not
        # by what a cache served: that ranks no plan's needs, and only plans that ran have it
        peaks = self._judged_peaks(False, by_cache=False)
        assert self._index is not None and self._profile is not None
        base, ran, under = self._profile.base, set(), 0
        for key, peak in self._peaks.items():
            for i in self._index.get(key, ()):
                ran.add(i)
                under = max(under, peak + base - self._plans[i].peak)  # the model's error, as measured
        if under:
            peaks = [q if i in ran else q + under for i, q in enumerate(peaks)]
        allowed = self._within_host(self._plans)
        places: Iterable[int] = range(len(peaks))
        if allowed is not self._plans and allowed:  # the host budget rules some out
            ids = {id(p) for p in allowed}
            places = [i for i, p in enumerate(self._plans) if id(p) in ids]
        best = min(places, key=lambda i: (peaks[i], self._plans[i].step_s))
        return replace(self._plans[best], peak=peaks[best])

    def _fits_now(self, plan: MemoryPlan) -> bool:
        """Whether ``plan`` fits the budget with the reserve as it is now, as :meth:`_fitting`
        judges it (asked only when the reserve grew, the cache was given back, or a step begins on
        a cache over the budget, so judging every candidate is no cost to speak of; a plan no
        longer a candidate does not fit)."""
        with self.planning_time("choosing"):
            judged = self._judged_peaks(True)
            return any(q <= self._budget for p, q in zip(self._plans, judged) if p.key == plan.key)

    def _limits(self) -> tuple[int]:
        """The modelled peak a plan not yet run may reach, as :meth:`_fitting` judges it now: the
        search improves its fastest plan within it (:func:`~.search.improved_within`). Asked with
        the reserve as it is when the search is made; a reserve grown since leaves that plan out
        of what fits, as any other."""
        return (self._budget - self._reserve.bytes - self._margin - least_margin(self._budget),)

    def _judged_peaks(self, with_margins: bool, by_cache: bool = True) -> list[int]:
        """Each candidate's peak as the allocator will reserve it, in the order of the
        candidates: the allocated bytes (measured where a plan ran, else modelled, ``with_margins``
        raised by the margin) and the reserve; or, ``by_cache``, what a plan that ran on the
        cache as it stands reserved there (:meth:`_served_now`) where that is less."""
        assert self._profile is not None
        base, reserve = self._profile.base, self._reserve.bytes
        unmeasured = reserve + (self._margin + least_margin(self._budget) if with_margins else 0)
        out = [p.peak + unmeasured for p in self._plans]
        if self._index is None:  # a plan's identity is hashed once per set of candidates, not per choice
            self._index = {}
            for i, p in enumerate(self._plans):  # a plan may be a candidate twice (the profiled one, say)
                self._index.setdefault(p.key, []).append(i)
        served = self._served_now() if by_cache else {}
        for key, peak in self._peaks.items():
            judged = peak + base + reserve
            if key in served:
                judged = min(judged, served[key])
            for i in self._index.get(key, ()):
                out[i] = judged
        return out

    def _note_cache(self, key: PlanKey, reserved_peak: int) -> bool:
        """What a step of plan ``key`` reserved at most (bytes) on the cache it ran on: whether
        it went over the budget after a step of it had stayed within it on a cache (that cache
        no longer says anything of it)."""
        over = reserved_peak > self._budget
        if over and self._reserve.fresh:
            self._over_on_own_cache.add(key)
        if not self._probe.cuda:  # nothing reserved to read
            return False
        if over:  # judged by the reserve again (which, never shrinking, will not choose it again)
            self._went_over.add(key)
            return self._served.pop(key, None) is not None
        trims = self._reserve.trims
        before = self._served.get(key)
        most = before[1] if before is not None and before[0] == trims else 0
        self._served[key] = (trims, max(most, reserved_peak))
        return False

    def _fits_only_on_its_cache(self, key: PlanKey, served: dict[PlanKey, int] | None = None) -> bool:
        """Whether a plan fits the budget by what it reserved on the cache as it stands
        (``served``: :meth:`_served_now`, read here if not given) but not by its measured
        allocated peak and the reserve."""
        assert self._profile is not None
        judged = (self._served_now() if served is None else served).get(key)
        return (judged is not None and judged <= self._budget and key in self._peaks
                and self._peaks[key] + self._profile.base + self._reserve.bytes > self._budget)

    def _served_now(self) -> dict[PlanKey, int]:
        """What each plan that ran on the cache as it stands (none given back since) will reserve:
        the most it reserved there, or what the cache holds now if more (with the base
        tolerance for noise). That cache served it once and has only grown since, so it serves
        it again; the reserve, measured on other steps' caches, would judge it by their spare
        blocks (on the loop sweep's decoder every 2048-token plan stayed at 5.67 GiB reserved,
        under a 6.16 GiB budget that the reserve, 2.47 GiB from a 512-token step, said none fit).
        A plan that goes over is left out until it runs within the budget again, and so is every
        plan where the cache holds less than it reserved (given back outside the offloader:
        ``torch.cuda.empty_cache()`` in the program, or by the allocator itself)."""
        if not self._served or not self._probe.cuda:
            return {}
        trims, now = self._reserve.trims, self._probe.reserved()
        slack = base_tolerance(self._budget)
        return {key: max(most, now) + slack for key, (at, most) in self._served.items()
                if at == trims and now + slack >= most}

    def _judged(self, with_margins: bool) -> list[MemoryPlan]:
        """The candidates with their peaks as :meth:`_judged_peaks` gives them."""
        return [replace(p, peak=q) for p, q in zip(self._plans, self._judged_peaks(with_margins))]

    def _fitting(self) -> list[MemoryPlan]:
        """The candidates that fit the budget, judged with the margins (made only for those:
        a choice is made at most steps while a plan is tried, among hundreds of candidates),
        and the host budget."""
        budget = self._budget
        # (made field by field: dataclasses.replace took a third of a choice)
        return self._within_host([MemoryPlan(p.groups, p.max_inflight, p.prefetch, q, p.step_s)
                                  for p, q in zip(self._plans, self._judged_peaks(True)) if q <= budget])

    def _within_host(self, plans: list[MemoryPlan]) -> list[MemoryPlan]:
        """``plans`` less those that would hold more host memory than :attr:`host_cap` (a commit
        of theirs would raise HostMemoryError, step after step)."""
        cap, profile = self.host_cap, self._profile
        if cap is None or profile is None:
            return plans
        if self._host_bound is None:
            self._host_bound = costmodel.most_host_bytes(profile)
        if self._host_bound <= cap:  # no plan comes near it (the usual case: most of the machine's RAM)
            return plans
        out = []
        for p in plans:
            if p.key in self._peaks:  # it ran a step to its end: its commits had their host memory
                out.append(p)
                continue
            if self._moved(p) <= cap:
                out.append(p)
        return out

    def _first_choice(self, fitting: list[MemoryPlan]) -> MemoryPlan:
        """The model's choice among plans that fit, should nothing be measured."""
        assert self._profile is not None
        return next(search.simplest_first(self._profile, fitting))

    def undo_replan(self, state: State) -> None:
        """The step that found a new workload was another workload's (:mod:`~.workloads` knows it
        by its signature, and plans it apart): back to ``state``, the plan running as before."""
        if self._state is State.REPLANNING and state in (State.EXPLORING, State.SETTLED):
            self._state = state

    @property
    def step_groups(self) -> int:
        """Places in the plan the latest step opened so far (a module run whole counts its parts)."""
        return self._position

    def _settle(self) -> None:
        """Exploring or settled, as the plan chosen is measured or not (only while a plan runs
        for the profile: profiling and re-planning stay)."""
        if self._state in (State.EXPLORING, State.SETTLED) and self._plan is not None:
            done = (not self._probe.cuda or self._timed(self._plan.key)) and self._pending is None
            self._state = State.SETTLED if done else State.EXPLORING

    def _forced_plan(self, groups: tuple[GroupDecision, ...], max_inflight: int, prefetch: int) -> MemoryPlan:
        assert self._profile is not None
        if len(groups) != len(self._profile.groups):
            raise ValueError(f"a forced plan has one decision per group: {len(groups)} given, "
                             f"{len(self._profile.groups)} groups profiled")
        _check_wholes(self._profile, groups)
        for p in self._plans:
            if p.key == (groups, max_inflight, prefetch):
                return p
        plan = MemoryPlan(groups, max_inflight, prefetch, *simulate(self._profile, groups, max_inflight, prefetch))
        self._plans.insert(len(self._plans) - 1, plan)  # the profiled plan stays last
        self._index = None
        return plan

    def _fastest(self, fitting: list[MemoryPlan]) -> MemoryPlan:
        """Among plans that fit: the fastest measured one, unless one more may run (at most
        ``EXPLORE`` beyond the model's first choice (none for a predicted profile, but the plan
        that moves nothing, below), each ``TIMINGS`` steps, or one more where its first pinned
        host memory or grew the cache). First, where the fastest measured plan moves bytes, the
        fastest plan that moves none (what checkpointing by hand gives), unless the model's first
        choice is being measured: the bus and recomputation are both modelled from the profiling
        steps, and an error in either must not keep the slower. Where the model's first choice
        moves bytes and nothing is measured yet, that plan moving nothing runs before it, on a
        GPU (:meth:`_still_to_try`).
        Then a plan the model rates faster than the fastest measured (:meth:`_promises`). While
        another workload is bound to the cache (:meth:`~.reserve.AllocatorReserve.bind`), none of
        this: the plan this workload ran last (after profiling, its profiled plan). The model misses costs
        it cannot see (hooks, packing, contention, a step that waits on the host); measuring
        finds them, and few tries keep the first steps few."""
        assert self._profile is not None
        profile = self._profile
        # on a GPU a plan being measured runs until it is timed (but a quick search's, which the
        # whole search's plans replace, or one forced): choosing again meanwhile (a calibration,
        # say) may make another plan the one to try, and leaving it would waste its steps and
        # keep a slower plan (on an H200 the MoE at 11.80 GiB left a plan after one step of
        # 158.9 ms, another moving nothing now rated faster, and settled on the 193.6 ms plan
        # measured before it)
        # (but one whose median will be slower than a plan measured is left now: :meth:`_leaves`)
        running = self._plan
        if (self._probe.cuda and running is not None and running.key in self._runs
                and running.key not in self._unheld and not self._timed(running.key)):
            if self._leaves(running, fitting):
                self._left.add(running.key)
            else:
                for p in fitting:
                    if p.key == running.key:
                        return p
        if self._pending is None and self._last_run not in self._unheld and self._reserve.bound_besides(self):
            # another workload sharing the allocator stays within the budget only on the cache as
            # it stands (bound to it: see reserve.py), and what this workload's plan leaves allocated
            # shapes that cache: the plan it ran last runs on while it fits, none new is tried
            for p in fitting:
                if p.key == self._last_run:
                    return p
        by_model = search.simplest_first(profile, fitting)
        first = next(by_model)  # the model's choice, should nothing be measured (_first_choice)
        measured = self._measured_keys()
        timed = [p for p in fitting if p.key in measured]
        best = min(timed, key=lambda p: self._time_of(p)) if timed else None
        still = self._still_to_try(fitting, first, best)
        # the plan moving nothing before a first choice not yet run (a calibration may make
        # another plan that moves bytes the first choice; a predicted profile's bus is another
        # workload's), after one being measured
        if still is None:
            ahead: tuple[MemoryPlan, ...] = (first,)
        elif self.predicted and best is None:
            ahead = (still, first)  # (its first choice may have run as a quick plan: not measured, not held)
        else:
            ahead = (first, still) if first.key in self._runs else (still, first)
        excess = self._bus_excess() if best is not None and not self._moved(best) else 0.0  # (as _promises asks)
        # a plan promises only what the model rates under the fastest measured time, and the
        # model's order yields none more than the tie below one yielded before: past such a
        # plan (and the plan moving nothing, which is not in that order) none is left to promise
        # (on the CPU, replaying the H200 loops' profiles, a choice reading all 600 took 50-210
        # ms where none promised; stopping here, 2-3 ms, the same plan chosen)
        beyond = self._time_of(best) * (1 + TIE) if best is not None else None
        still_seen = still is None
        for p in itertools.chain(ahead, by_model):
            still_seen = still_seen or p is still
            if p.key in measured or (p is not still and best is not None and not self._promises(p, best, excess)):
                if still_seen and p is not still and beyond is not None and p.step_s >= beyond:
                    break
                continue  # measured, or the model promises nothing faster than what was
            # a predicted profile tries no plan beyond the one moving nothing and its first
            # choice, that one where the model rates it faster than the other ran (above), each
            # whatever ran before it: a quick plan, timed before the whole search answered, or a
            # plan moving nothing that went over the budget before it was measured (the next one
            # moving nothing runs then, and would have left the first choice no try)
            opener = self.predicted and (p is still or p is first)
            if p.key in self._runs or opener or self._tries(measured) <= self._explore:  # running, or one more may
                return p
            break
        return best if best is not None else first

    def _tries(self, measured: set[PlanKey]) -> int:
        """The plans that ran as tries of the exploration: one that went over the budget before it
        was measured was none (its time is not known; the next plan moving nothing runs in its
        place, and the first choice keeps its try after it)."""
        return sum(1 for k in self._runs if k in measured or k not in self._went_over)

    def _still_to_try(self, fitting: list[MemoryPlan], first: MemoryPlan,
                      best: MemoryPlan | None) -> MemoryPlan | None:
        """The fastest plan moving nothing among ``fitting``, to try beside ``first``, the model's
        choice (``best``: the fastest measured): where ``best`` moves bytes, or where nothing is
        measured yet and ``first`` moves bytes; else ``None``.

        On a GPU the plan moving nothing runs first, and the first choice only where the model
        rates it faster than that plan ran: the model overrates moving bytes. (On the CPU, where
        nothing is timed, only a predicted profile's does, as before.) In the 23 loop sweeps
        committed from 2026-11-29 to 30 on an H200, a predicted workload's plans moving bytes
        ran slower than its plan moving nothing in 144 of the 187 that ran both (by a median 12%
        a step; the decoder's 1536 tokens at checkpointing's peak 127.7 ms against 86.5), 84 of
        which the model, against the plan moving nothing as it ran, would not have tried; of the
        43 faster, 18 (by a median 3%, at most 10%). A profile measured at the workload's own
        steps fared alike: in the 30 loop sweeps committed up to 2026-12-01, its plan moving
        nothing was the faster in 39 of the 46 workloads that measured both (the decoder's 2048
        tokens at checkpointing's peak at 3f67cd2: 123.0 ms against 139.8, where the model said
        156.6 against 139.8; its profiling steps' forwards ran at the host's pace, which the
        model then charged every recomputation: since b068338 it charges the recomputation's
        own), and the other 7 by 1-10%."""
        profile = self._profile
        assert profile is not None
        if best is not None:
            if not self._moves(best):
                return None
        elif not (self._moves(first) and (self.predicted or self._probe.cuda)):
            return None  # (on the CPU nothing is timed: a measured profile's first choice settles)
        still_plans = [p for p in fitting if not self._moves(p)]
        return search.fastest(profile, still_plans) if still_plans else None

    def _promises(self, plan: MemoryPlan, best: MemoryPlan, excess: float | None = None) -> bool:
        """Whether the model rates ``plan`` faster than ``best``, the fastest measured: than its
        measured time where ``best`` ran off the model as it stands (a cost the model missed,
        which a plan may escape; a calibration makes it agree), or where ``best`` moves bytes and
        ``plan`` moves fewer (what it took beyond its model may be the bus's); else than both its
        modelled time, beyond the tie, and its measured time: ``best`` ran as modelled within
        noise, and a plan the model rates alike to it is no faster (on an H200 a d4096 plan
        modelled at 376 ms ran 385, and two plans modelled alike to it were tried for six steps,
        to run 384 and 385). A plan moving bytes, against a ``best`` moving none, is rated with
        what the workload's plans moving bytes took beyond their model (``excess``, else
        :meth:`_bus_excess`)."""
        assert self._profile is not None
        measured, step = self._time_of(best), plan.step_s
        if self._moved(plan) and not self._moved(best):
            step *= 1 + (self._bus_excess() if excess is None else excess)
        if off_model(measured, best.step_s) or self._moved(plan) < self._moved(best):
            return step < measured
        return not alike(step, best.step_s) and step < measured

    def _bus_excess(self) -> float:
        """What this workload's measured plans that move bytes took beyond their model, the most
        of them (0 where none did): a plan moving bytes is judged against one moving none with
        it, as the calibration's slack leaves up to 5% of it unmodelled (on an H200 the decoder
        at 9.33 GiB ran its first plan moving bytes 3.8% over its model, then tried another
        modelled 2.0% faster than the measured plan moving none; it ran 1.7% slower)."""
        measured = self._measured_keys()
        excess = [self._time_of(p) / p.step_s - 1 for p in self._plans
                  if p.key in measured and p.step_s > 0 and self._moved(p)]
        return max([0.0, *excess])

    def _moved(self, plan: MemoryPlan) -> int:
        """The bytes a plan moves to host memory (:func:`~.costmodel.host_bytes`), worked out once."""
        assert self._profile is not None
        held = self._host_of.get(plan.key)
        if held is None:
            held = self._host_of[plan.key] = costmodel.host_bytes(self._profile, plan.groups)
        return held

    def _moves(self, plan: MemoryPlan) -> bool:
        """Whether a plan moves bytes (:func:`~.costmodel.moves_bytes`), worked out once: asked
        of every candidate that fits while the fastest measured plan moves bytes."""
        held = self._moves_of.get(plan.key)
        if held is None:
            assert self._profile is not None
            held = self._moves_of[plan.key] = moves_bytes(self._profile, plan.groups)
        return held

    def _timed(self, key: PlanKey) -> bool:
        """Whether the plan of ``key`` is measured: ``TIMINGS`` of its steps were timed, or fewer
        that left it (:meth:`_leaves`)."""
        return len(self._times.get(key, ())) >= TIMINGS or key in self._left

    def _measured_keys(self) -> set[PlanKey]:
        """The plans :meth:`_timed` says are measured (a few), to look candidates up in (hundreds)."""
        return {key for key in self._times if self._timed(key)}

    def _leaves(self, plan: MemoryPlan, fitting: list[MemoryPlan]) -> bool:
        """Whether ``plan``, being measured, is measured already: ``LEFT_AFTER`` of its steps
        timed so far each ran slower than a plan measured that fits, so that its median will be
        slower than that plan's whatever its further steps show, each at that cost."""
        measured = self._measured_keys()
        times = [self._time_of(p) for p in fitting if p.key in measured and p.key != plan.key]
        if not times:
            return False
        fastest = min(times)
        return sum(t > fastest for t in self._times.get(plan.key, [])) >= LEFT_AFTER

    def _pace(self, plan: MemoryPlan) -> float:
        """A plan's step time: measured where it was, else modelled."""
        return self._time_of(plan) if plan.key in self._measured_keys() else plan.step_s

    def _time_of(self, plan: MemoryPlan) -> float:
        """A plan's measured step time: the median of its timed steps (a plan that moves bytes
        runs at one of two paces, as its copies happen to hide behind compute or not; the least
        of them would pick the lucky); for a plan left before its last (:meth:`_leaves`), the
        least of them, the least its median could have come to (of two steps, one slow by a
        cache regrown would otherwise set half of it)."""
        times = self._times[plan.key]
        return min(times) if plan.key in self._left else statistics.median(times)

    def _measurement_pending(self) -> bool:
        """Whether the steps waiting to be timed complete a plan's measurement, or may (a plan
        timed beside one measured may be left from its ``LEFT_AFTER``-th timed step on: :meth:`_leaves`)."""
        counts = collections.Counter(k for k, _, _ in self._untimed)
        beside = any(len(t) >= TIMINGS for t in self._times.values())
        return any(len(self._times.get(k, ())) + n >= (LEFT_AFTER if beside else TIMINGS) for k, n in counts.items())

    def _time_steps(self, wait: bool = False) -> None:
        """Record the times of the planned steps the device has finished, in order (``wait``:
        all of them, waiting for the device), and choose again with them. A step is timed from
        its first group's opening to its backward's end: the host is usually a step ahead, so
        a step's end is seldom reached when the next begins, and several may wait here."""
        recorded = False
        while self._untimed:
            key, start, end = self._untimed[0]
            if self._probe.cuda and not wait and not end.query():
                break
            self._untimed.pop(0)
            times = self._times.setdefault(key, [])
            if self._timed(key):
                continue  # measured already
            times.append(self._probe.seconds(start, end))
            recorded = True
            if len(times) == TIMINGS and self._profile is not None:  # just measured: the model agrees with its median
                self._calibrate(next(p for p in self._plans if p.key == key), statistics.median(times))
        if recorded and self._profile is not None:
            self._choose()  # a plan measured: the model's next promise may run

    def _calibrate(self, plan: MemoryPlan, seconds: float) -> None:
        """Make the model agree with a plan's measured time, and plan again (a few times at
        most): :func:`~.costmodel.calibrated`."""
        assert self._profile is not None
        # a predicted profile tries no other plan but the one that moves nothing, whatever the
        # model says, and once the plans that may run have run the fastest measured stays: a
        # corrected model would change no choice, and making every plan again costs host time
        # (and, while the planning process makes them, a step before the plan is settled)
        answer_pending = self._pending is not None and self._pending[2]  # its answer may add tries (_collect)
        if (self.predicted or self._calibrated >= CALIBRATIONS or not self._explore
                or (len(self._runs) > self._explore and not answer_pending)):
            return
        profile = costmodel.calibrated(self._profile, plan, seconds)
        if profile is None:
            return
        self._profile = profile
        self._calibrated += 1
        self._plan_all()

    # ------------------------------------------------------------------ reporting
    @property
    def last_step_s(self) -> float | None:
        """The latest step's time, from its first group's opening to its backward's end (no wait:
        ``None`` while still running)."""
        if self._last_span is None or (self._probe.cuda and not self._last_span[1].query()):
            return self.measured_step_s
        self.measured_step_s = self._probe.seconds(*self._last_span)
        return self.measured_step_s

    def stats(self) -> dict[str, Any]:
        cuda = self._probe.cuda
        out: dict[str, Any] = {"memory_budget": self._budget, "margin": self._margin + least_margin(self._budget),
                               "allocator_reserve_bytes": self._reserve.bytes if cuda else None,
                               "cache_trims": self._reserve.trims if cuda else None,
                               "cache_trims_by": dict(self._reserve.trims_by) if cuda else None,
                               "allocator_reclaim": self._reserve.reclaim if cuda else None,
                               "planning_s": self.planning_s,
                               "planning_by": dict(self.planning_by),
                               "background_planning_s": self.background_planning_s,
                               "planning_in_background": self._pending is not None,
                               "state": self._state.value, "settled": self.settled,
                               # its plan stays within the budget only on the cache as it stands
                               "cache_bound": self._reserve.is_bound(self) if cuda else None}
        if self.too_small is not None:
            out["budget_too_small"] = self.too_small
        if self._plan is not None and self._profile is not None:
            plan, profile = self._plan, self._profile
            out.update(groups=plan.describe(profile), max_inflight=plan.max_inflight,
                       prefetch=plan.prefetch, predicted_peak_bytes=plan.peak,
                       predicted_step_s=plan.step_s,
                       smallest_reachable_bytes=min(p.peak for p in self._plans) + self._reserve.bytes,
                       plans_tried=len(self._runs), peak_at=costmodel.peak_at(profile, plan),
                       tried=[{"actions": [g.action.value for g in m.plan.groups],
                               "max_inflight": m.plan.max_inflight, "prefetch": m.plan.prefetch,
                               "steps": m.steps, "predicted_peak_bytes": m.plan.peak,
                               "measured_peak_bytes": m.peak, "predicted_step_s": m.plan.step_s,
                               # what it reserved at most on the cache as it stands, within the budget
                               "cache_served_bytes": self._served[m.plan.key][1]
                               if cuda and m.plan.key in self._served else None,
                               "measured_step_s": m.step_s if m.step_s is not None
                               else statistics.median(m.times) if m.times else None}
                              for m in self.measured_plans()],
                       profile=asdict(profile),
                       profiled_peak_bytes=self.profiled_peak if cuda else None)
        out.update(measured_peak_bytes=self.measured_peak if cuda else None,
                   measured_reserved_peak_bytes=self.measured_reserved_peak if cuda else None,
                   measured_step_s=self.last_step_s if cuda else None)
        return out


def _check_wholes(profile: Profile, groups: Sequence[GroupDecision]) -> None:
    """Raise ValueError where ``groups`` recompute a module whole other than as its parts allow:
    a whole action only at a module's first part, followed by ``inside`` for its other parts,
    and ``inside`` nowhere else (what the step runs, and what the model and the host bytes
    count, would differ)."""
    inside: set[int] = set()
    for i, d in enumerate(groups):
        if not d.action.whole:
            continue
        whole = profile.whole_at.get(i)
        if whole is None:
            raise ValueError(f"group {i} ({d.action.value}) is not the first part of a module that may be "
                             f"recomputed whole; recompute it on its own, or force the module's first part")
        later = range(i + 1, i + whole.parts)
        if any(groups[j].action is not Action.INSIDE for j in later):
            raise ValueError(f"group {i} recomputes its module whole: its other parts (groups "
                             f"{i + 1}..{i + whole.parts - 1}) take {Action.INSIDE.value!r}")
        inside.update(later)
    stray = [i for i, d in enumerate(groups) if d.action is Action.INSIDE and i not in inside]
    if stray:
        raise ValueError(f"groups {stray} are {Action.INSIDE.value!r} without their module recomputed whole "
                         f"at its first part")


def _worker_for(probe: Any) -> planning.PlanWorker | None:
    """The planning process a controller asks (see :mod:`~.worker`): the process's one where
    the device runs asynchronously from the host (CUDA), none on the CPU, where the step's work
    is the host's own and a search beside it would only compete for the cores (a probe of a
    test's own says by ``asynchronous``, else none)."""
    return planning.shared() if getattr(probe, "asynchronous", False) else None


def _profiled_peak(step: _Step) -> int:
    """The most a profiling step allocated, from its groups' readings (the counters are reset
    group by group)."""
    return max([step.outside_peak] + [m.allocated_at_start + m.forward_peak for m in step.groups]
               + [max(m.backward_peak, m.recompute_peak) for m in step.groups])


def _moving(meter: OpMeter | None, save_policy: str, attention_only: bool) -> tuple[int, ...] | None:
    """Of the outputs a selective recomputation keeps, those that may move, largest first;
    ``None`` where every one may (or none was metered)."""
    if meter is None:
        return None
    moving = meter.moving(save_policy, attention_only)
    kept = meter.attention if attention_only else meter.costly
    return None if len(moving) == len(kept) else tuple(sorted(moving, reverse=True))


def _between(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None
