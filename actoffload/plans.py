"""Plans: what each group of a step does. The engine asks one plan object, at the points of
a step where it already works, and tells it what happened.

The engine moves what a group saves as the policy says (``policy.py``); a plan decides,
around that, whether a group opens at all, whether its module is recomputed instead
(under activation checkpointing), how many bytes it may move, and how far an
implementation's copies may run ahead. Offloading everything is :class:`Plan` itself; the
warm-up (``warmup.py``) and a memory budget (``budget/plan.py``) are plans too, and a new
one is a subclass in a file of its own.

Example (a plan that offloads only the groups whose names match)::

    import re
    import actoffload as ao

    class Matching(ao.Plan):
        def __init__(self, pattern):
            super().__init__()
            self.pattern = re.compile(pattern)

        def opening(self, name, recomputable, parts):
            return ao.Opening() if self.pattern.fullmatch(name) else ao.Opening(hooked=False)

    off = ao.Offloader(plan=Matching(r"mlp.*"))
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from .settings import budget_of, device_memory, parse_memory_budget

if TYPE_CHECKING:
    from .engine import Engine
    from .policy import SavePlan
    from .records import Group
    from .selective import OpMeter


@dataclass(frozen=True)
class Opening:
    """What a group that is opening does.

    ``hooked=False``: it opens no group; autograd keeps what it saves, as without an
    offloader. ``recompute``: its module (one given to ``ao.wrap``) runs under activation
    checkpointing, saving only its inputs, which the group then handles like any save.
    ``release_inputs``: those inputs are let go once recomputed from (a second backward
    through the module then needs the first to keep the graph). ``keep_all``: it keeps
    everything it saves and only counts the bytes (a plan noticing a new workload).
    ``guard_inputs`` (a recomputed group): its module's inputs are copied when its forward
    ends, before any later work can write them in place (small ones too; those that may
    not move, a vetoed one say, are cloned), so that the recomputation reads what the
    forward read (``h += block(h)`` is allowed where autograd saved no ``h``); ``False``
    lets their copies run alongside
    compute, for a plan that saw no such write (the engine reports one to
    :meth:`Plan.inputs_written`). ``selective`` (a recomputed group): its forward keeps the
    outputs of its costly ops (matmuls, attention) on the device, and its recomputation runs
    only the other ops again (:mod:`actoffload.selective`); ``selective_calls``: only those of
    its first this many costly ops (the ones its recomputation reaches before it stops), else all;
    ``selective_attention``: of its fused attention calls only (the matmuls run again too).
    """

    hooked: bool = True
    recompute: bool = False
    release_inputs: bool = False
    keep_all: bool = False
    guard_inputs: bool = True
    selective: bool = False
    selective_calls: int | None = None
    selective_attention: bool = False


# The points of a step where a plan may act: its methods of these names.
POINTS = ("opening", "opened", "closing", "move_at_most", "committed", "reached", "backward_begins", "copy_window")

# What a group does unless a plan says otherwise: one object, which the engine knows by identity
# (a group opened with it keeps every default, with nothing to read or set).
OFFLOAD = Opening()


class Plan:
    """Offload every group as the policy says: the plan of an offloader given none.

    Subclasses override the points they act at; each default does what offloading
    everything needs (nothing). The engine calls them on the thread that runs the forward,
    and ``reached`` and ``recomputation`` in backward.
    """

    keep_last: int | None = None  # overrides the offloader's keep_last (R4) where set
    # what the plan keeps a step's device memory under (bytes, or a share of the device's
    # memory: "auto", "90%"), reported in the offloader's settings; None: it keeps none
    memory_budget: int | str | None = None
    wants_inputs: bool = False  # ao.wrap calls step_inputs while this is set (a plan sets it when it needs them)
    # where a commit cannot have the host memory it asked for: False, HostMemoryError is raised
    # into the forward (R10); True, the group stays on the device, moving nothing, and it goes on
    stays_when_host_short: bool = False

    def __init__(self) -> None:
        self.offloader: Engine | None = None

    @property
    def decides_openings(self) -> bool:
        """Whether this plan says what a group does as it opens (its class overrides
        :meth:`opening`): only such a plan recomputes a group."""
        return type(self).opening is not Plan.opening

    def acts_at(self) -> frozenset[str]:
        """The points (:data:`POINTS`) where this plan acts now: the engine asks it only there,
        reading this when the plan is attached and at the beginning of each step (a step may open
        thousands of groups, and asking a plan that does nothing costs a call at each). By
        default, the points its class overrides."""
        return frozenset(n for n in POINTS if getattr(type(self), n) is not getattr(Plan, n))

    def attach(self, offloader: Engine) -> None:
        """The offloader this plan serves (once, when the offloader is made)."""
        if self.offloader is not None and self.offloader is not offloader:
            raise ValueError(f"this {type(self).__name__} already serves another offloader; make one per offloader")
        self.offloader = offloader

    def step_begins(self) -> None:
        """A step's first group is opening (the first after a backward pass began, or the step's
        first group again after an exception cut its forward short: :meth:`forward_cut_short`)."""

    def group_failed(self) -> None:
        """An exception closed a group: the forward it ran in was cut short, unless it catches
        the exception itself (R8)."""

    def forward_cut_short(self) -> None:
        """The step's forward was cut short by an exception and began again (R8): its step is
        over, without a backward pass; :meth:`step_begins` comes next."""

    def step_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module | None = None) -> None:
        """``module``, given to ``ao.wrap``, is called with ``args`` and ``kwargs`` (outside
        backward), before its group opens; called only while :attr:`wants_inputs` is set, so
        that a plan may read the shapes of a step's first inputs (and the module's mode) before
        its first group opens (and before :meth:`step_begins`, where that group begins the step)."""

    def runs_whole(self, parts: int, inputs: int) -> bool:
        """Whether the module opening now, whose ``parts`` are groups of their own, instead runs
        whole as one recomputed group saving its ``inputs`` (bytes)."""
        return False

    def whole_closed(self, parts: int) -> None:
        """A module whose ``parts`` were the groups (it did not run whole) is done."""

    def opening(self, name: str, recomputable: bool, parts: int) -> Opening:
        """What the group opening now does; ``recomputable``: a wrapped module that can run under
        checkpointing; ``parts``: a module run whole in place of that many parts."""
        return OFFLOAD

    def opened(self, group: Group) -> None:
        """``group`` (hooked) was opened as :meth:`opening` said; a plan may keep state in
        ``group.plan_state``."""

    def closing(self, group: Group) -> None:
        """``group``'s forward is over (before its commit)."""

    def move_at_most(self, group: Group) -> int | None:
        """Bytes ``group`` may move at its commit, largest spans first (``None``: no limit)."""
        return None

    def checkpoint_saves_observer(self, group: Group) -> Callable[[torch.Tensor], None] | None:
        """What is shown each tensor the checkpointed forward of recomputed ``group`` saves
        (checkpoint drops them), or ``None``: nothing watches (asked once per forward, so
        that the saves of a plan that does not watch cost no call)."""
        return None

    def recomputation(self, group: Group) -> ContextManager[Any]:
        """Entered around each recomputation of ``group``'s forward in backward."""
        return contextlib.nullcontext()

    def op_meter(self, group: Group) -> OpMeter | None:
        """A meter of the costly ops in recomputed ``group``'s forward and recomputation
        (:class:`actoffload.selective.OpMeter`: what a selective recomputation of it would keep
        and skip), or ``None``: asked when its checkpoint begins."""
        return None

    def committed(self, group: Group, saves: SavePlan) -> None:
        """``group`` was committed: ``saves`` is what moved and what stayed."""

    def inputs_written(self, group: Group) -> None:
        """An input recomputed ``group`` saved was written in place after its forward (its
        recomputation read the copy, or failed where the plan kept the input unguarded)."""

    def reached(self, group: Group) -> None:
        """Backward unpacked something ``group`` saved, for the first time in this pass."""

    def backward_begins(self) -> None:
        """A backward pass began (once per step: at its first unpack of the step's saves, those
        handed to checkpointing included, or where checkpointing runs a group's forward
        again); the next group opened outside backward begins a step."""

    def copy_window(self) -> tuple[int, int] | None:
        """``(max_inflight, prefetch)`` for implementations that copy ahead (``None``: their
        settings). Under a window a plan sets, fast reloads the groups ahead whole, as a memory
        budget's model counts them; under its own settings, half of each."""
        return None

    def stats(self) -> dict[str, Any]:
        """Entries for the offloader's ``stats()``."""
        return {}


WARMUPS = ("auto", "offload", "recompute")


def for_fast(*, warmup: str, memory_budget: int | str | None, device: torch.device, plan: Plan | None,
             window: tuple[int, int] = (1, 1), keep_last: int = 1) -> Plan:
    """The plan ``fast``'s settings ask for: a memory budget's, else the warm-up
    (``warmup="auto"``: recompute on CUDA, where host memory is pinned, else offload), unless
    the caller gives a ``plan`` of its own. ``memory_budget`` is checked here, before any work,
    and so are the settings a budget's plan chooses itself (the copy ``window``,
    ``(max_inflight, prefetch)``, and ``keep_last``): given other than their defaults, they would
    be overruled without a word."""
    if memory_budget is not None:
        memory_budget = parse_memory_budget("memory_budget", memory_budget)
        if isinstance(memory_budget, str):  # a share that leaves nothing of all there is: said now, not at a step
            budget_of("memory_budget", memory_budget, device_memory(device), 0)
    if plan is not None:
        if memory_budget is not None:
            raise ValueError("give either memory_budget or a plan, not both: a memory budget is a plan itself")
        return plan
    if memory_budget is not None:
        if warmup == "recompute":
            raise ValueError("warmup='recompute' does not apply with a memory_budget: a budget's first "
                             "steps profile by recomputing already; leave warmup at its default")
        given = [f"{name}={value}" for name, value, default in (
            ("max_inflight", window[0], (1,)), ("prefetch", window[1], (1,)), ("keep_last", keep_last, (0, 1)))
            if value not in default]
        if given:
            raise ValueError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with a memory_budget: "
                             "its plan chooses the copy window (max_inflight, prefetch) and what stays on the device "
                             "step by step; leave them at their defaults")
        from .budget.plan import BudgetPlan  # imported only where a budget is asked for

        return BudgetPlan(memory_budget, device)
    from .warmup import WarmUp

    return WarmUp(active=warmup == "recompute" or (warmup == "auto" and device.type == "cuda"))
