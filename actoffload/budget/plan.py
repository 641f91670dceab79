"""The memory budget as the plan the engine asks: each point of a step goes to the
controller (``controller.py``), which profiles, chooses and checks plans; docs/budgets.md
describes the algorithm."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .. import policy
from ..checkpointing import WouldSave
from ..plans import Opening, Plan
from ..records import Group
from ..selective import OpMeter
from ..settings import budget_of
from .actions import Action
from .controller import BudgetController
from .probe import Probe
from .workloads import UNKNOWN, Signature, Workloads, mode_of, signature_of


@dataclass
class _Planned:
    """A group's place in the controller's plan, and what it does there."""

    position: int
    decision: Any  # the controller's decision for it (its action and share)
    controller: BudgetController  # its step's (each workload has its own)
    would_save: WouldSave | None  # while profiling a recomputed group: what it would save


HOST_ROUNDING = 1.05  # host memory in use per byte moved, at most (R9)


class BudgetPlan(Plan):
    """Keep each step's peak device memory under ``budget`` bytes at the least step time.

    ``fast`` builds it from ``memory_budget``; ``stats()["plan"]`` shows the plan chosen, its
    predicted peak and time, and the last step's measured ones.

    Example::

        off = ao.Offloader(impl="fast", memory_budget="20GiB")
        ao.wrap(model.blocks, off)
        ...                                   # train as usual
        off.stats()["plan"]["groups"]         # [{'group': '0', 'action': 'keep', ...}, ...]
    """

    keep_last = 0  # the plan decides what stays
    stays_when_host_short = True  # its share was the room host memory seemed to have (move_at_most)

    def __init__(self, budget: int | str, device: torch.device):
        super().__init__()
        self.memory_budget: int | str = budget  # bytes, or a share of the device's memory ("auto", "90%")
        self.device = device
        # each workload's controller (workloads.py); made at the first step where the budget
        # is a share of the device's memory, once the model is there
        self.workloads: Workloads | None = Workloads(budget, device) if isinstance(budget, int) else None
        self.wants_inputs = True  # the next step's first inputs are to be read (ao.wrap hands them)
        self._inputs: Signature | None = None
        self._pending = False  # the engine began a step whose workload is not chosen yet
        self._opening: _Planned | None = None
        # positions whose module's inputs were written in place after its forward: always
        # guarded, and moved out where the plan would keep them (a kept input is the caller's)
        self._written: set[int] = set()
        self._fixed: Any = None  # a controller set by hand runs every step (no workloads)

    @property
    def controller(self) -> BudgetController:
        """The controller of the latest step's workload. Set, it runs every step in place of the
        workloads' (a test or a diagnostic driving a controller of its own)."""
        return self._fixed if self._fixed is not None else self._workloads().controller

    @controller.setter
    def controller(self, controller: Any) -> None:
        self._fixed = controller

    def _workloads(self) -> Workloads:
        if self.workloads is None:  # a share of the device's memory: read it now
            probe = Probe(self.device)
            total, outside = probe.memory_totals()
            self.workloads = Workloads(budget_of("memory_budget", self.memory_budget, total, outside),
                                       self.device, probe)
        if self.offloader is not None and self.workloads.host_cap is None:
            # the offloader's host budget bounds what a plan may move (the pool rounds each
            # block up by less than R9's 5%): a plan past it would raise HostMemoryError at every step
            self.workloads.host_cap = int(self.offloader.host_budget / HOST_ROUNDING)
            # a plan's first step that pinned nothing is timed like any other
            self.workloads.probe.count_host_allocations(self.offloader.host_allocations)
        return self.workloads

    # ------------------------------------------------------------------ a step and its workload
    def step_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module | None = None) -> None:
        if torch.is_grad_enabled():  # an evaluation forward (no_grad) is no step's
            self._inputs = signature_of(args, kwargs, mode_of(module, self.device.type))
            self.wants_inputs = False

    def step_begins(self) -> None:
        self._pending = True
        if torch.is_grad_enabled():
            self._begin()

    def _begin(self, in_backward: bool = False) -> None:
        """Choose the step's workload (its plan) and begin its step: where a step begins with
        gradients enabled, before its first group saves anything (``in_backward``: late, see
        :meth:`backward_begins`; a budget too small is then said at the next step's beginning)."""
        self.wants_inputs = False
        if self._fixed is not None:
            self._fixed.step_begins(may_raise=not in_backward)
        else:  # may raise: begun again at the next group
            self._workloads().begin(self._inputs or UNKNOWN, may_raise=not in_backward)
        self._pending, self._inputs = False, None

    def _planned(self) -> bool:
        """Whether the group opening now is a step's: not under ``no_grad`` (an evaluation
        forward saves nothing, and is no part of any step); the step's workload is chosen here
        where its first group came under ``no_grad``."""
        if not torch.is_grad_enabled():
            return False
        if self._pending:
            self._begin()
        return True

    def runs_whole(self, parts: int, inputs: int) -> bool:
        return self._planned() and self.controller.whole_next(parts, inputs)

    def whole_closed(self, parts: int) -> None:
        if torch.is_grad_enabled() and not self._pending:
            self.controller.whole_closed(parts)

    def opening(self, name: str, recomputable: bool, parts: int) -> Opening:
        if not self._planned():
            return Opening(hooked=False)  # autograd saves nothing here
        c = self.controller
        if c.unhooked_next():
            return Opening(hooked=False)
        position = c.next_position
        decision = c.action(recomputable, parts)
        action = Action(decision.action)
        recompute = recomputable and action.recomputes
        self._opening = _Planned(position, decision, c,
                                 WouldSave(self.offloader.device) if self.offloader is not None and recompute and c.profiling else None)
        # Inputs are guarded while profiling (its copies are synchronous anyway) and where a
        # write after the forward was seen; elsewhere their copies overlap compute as modelled.
        selective = recompute and action.selective
        return Opening(recompute=recompute, release_inputs=recompute, selective=selective,
                       selective_calls=c.costly_calls(position, action.attention_only) if selective else None,
                       selective_attention=selective and action.attention_only,
                       keep_all=action is Action.KEEP and not c.profiling,
                       guard_inputs=c.profiling or position in self._written)

    def op_meter(self, group: Group) -> OpMeter | None:
        planned: _Planned | None = group.plan_state
        return planned.controller.op_meter(planned.position) if planned is not None else None

    def opened(self, group: Group) -> None:
        group.plan_state, self._opening = self._opening, None
        if group.compiled and group.plan_state is not None:  # recomputed plainly: no meter, so never selective
            group.plan_state.controller.unmetered(group.plan_state.position)

    def closing(self, group: Group) -> None:
        group.plan_state.controller.group_closing(group.plan_state.position)

    def move_at_most(self, group: Group) -> int | None:
        planned = group.plan_state
        if planned is None or (group.recompute and planned.position in self._written):
            return None
        at_most = planned.controller.move_at_most(planned.position, planned.decision)
        if at_most == 0:
            return 0
        # No group moves more than the host budget has room for: a profiling step moves all it
        # can, and so does a group past its plan (a step opening more groups than planned), where
        # the plan's host cap reckons only with the groups it planned (budgets.md, "Candidate plans").
        assert self.offloader is not None
        room = int(self.offloader.host_room() / HOST_ROUNDING)
        return room if at_most is None else min(at_most, room)

    def inputs_written(self, group: Group) -> None:
        self._written.add(group.plan_state.position)

    def checkpoint_saves_observer(self, group: Group) -> Callable[[torch.Tensor], None] | None:
        would_save = group.plan_state.would_save
        return would_save.see if would_save is not None else None

    @contextlib.contextmanager
    def recomputation(self, group: Group) -> Iterator[None]:
        position, controller = group.plan_state.position, group.plan_state.controller
        controller.recompute_begins(position)
        try:
            yield
        finally:
            controller.recompute_ends(position)

    def committed(self, group: Group, saves: policy.SavePlan) -> None:
        planned: _Planned = group.plan_state
        off = self.offloader
        assert off is not None
        inner = None
        if planned.would_save is not None:  # what it would move, were it not recomputed
            inner = planned.would_save.plan(off.min_offload_bytes, off.policy)
            planned.would_save = None
        planned.controller.committed(planned.position, group.recompute, saves, inner, off.min_offload_bytes,
                                     off.policy)

    def reached(self, group: Group) -> None:
        group.plan_state.controller.backward_reaches(group.plan_state.position)

    def forward_cut_short(self) -> None:
        if self.workloads is not None or self._fixed is not None:
            self.controller.forward_cut_short()
        # the step beginning is the next forward's: where that is an evaluation under no_grad (no
        # step's), the first forward with gradients after it says the workload
        self.wants_inputs = True

    def group_failed(self) -> None:
        # the forward may be run again (a batch retried or skipped): its first inputs are read
        # again, for the step its next group begins
        self.wants_inputs = True

    def backward_begins(self) -> None:
        self.wants_inputs = True  # the next group opened outside backward begins a step
        if self._pending:
            # A backward pass of a step none of whose groups opened with gradients enabled: not an
            # evaluation, a forward whose groups all ran under reentrant checkpointing (which saves
            # nothing of theirs). The step begins here, with nothing for the plan to decide.
            self._begin(in_backward=True)

    def copy_window(self) -> tuple[int, int] | None:
        return self.controller.window() if self.workloads is not None or self._fixed is not None else None

    def stats(self) -> dict[str, Any]:
        if self._fixed is not None:
            return {"plan": self._fixed.stats()}
        if self.workloads is None:  # a share of the device's memory, not read yet (no step began)
            return {"plan": {"memory_budget": None, "memory_budget_setting": self.memory_budget, "margin": None,
                             "state": "profiling", "settled": False, "measured_peak_bytes": None,
                             "measured_reserved_peak_bytes": None, "measured_step_s": None}}
        out = self.controller.stats()
        if not isinstance(self.memory_budget, int):
            out["memory_budget_setting"] = self.memory_budget
        out["workload"] = self.workloads.describe()
        return {"plan": out}
