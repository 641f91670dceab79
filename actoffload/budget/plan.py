"""The memory budget as the plan the engine asks: each point of a step goes to the
controller (``controller.py``), which profiles, chooses and checks plans; docs/budgets.md
describes the algorithm."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .. import policy
from ..checkpointing import WouldSave
from ..plans import Opening, Plan
from ..records import Group
from .actions import Action
from .controller import BudgetController


@dataclass
class _Planned:
    """A group's place in the controller's plan, and what it does there."""

    position: int
    decision: Any  # the controller's decision for it (its action and share)
    would_save: WouldSave | None  # while profiling a recomputed group: what it would save


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

    def __init__(self, budget: int, device: torch.device):
        super().__init__()
        self.controller = BudgetController(budget, device)
        self._opening: _Planned | None = None
        # positions whose module's inputs were written in place after its forward: always
        # guarded, and moved out where the plan would keep them (a kept input is the caller's)
        self._written: set[int] = set()

    def step_begins(self) -> None:
        self.controller.step_begins()

    def runs_whole(self, parts: int, inputs: int) -> bool:
        return self.controller.whole_next(parts, inputs)

    def whole_closed(self, parts: int) -> None:
        self.controller.whole_closed(parts)

    def opening(self, name: str, recomputable: bool, parts: int) -> Opening:
        c = self.controller
        if c.unhooked_next():
            return Opening(hooked=False)
        position = c.next_position
        decision = c.action(recomputable, parts)
        action = Action(decision.action)
        recompute = recomputable and action.recomputes
        self._opening = _Planned(position, decision,
                                 WouldSave(self.offloader.device) if self.offloader is not None and recompute and c.profiling else None)
        # Inputs are guarded while profiling (its copies are synchronous anyway) and where a
        # write after the forward was seen; elsewhere their copies overlap compute as modelled.
        return Opening(recompute=recompute, release_inputs=recompute,
                       keep_all=action is Action.KEEP and not c.profiling,
                       guard_inputs=c.profiling or position in self._written)

    def opened(self, group: Group) -> None:
        group.plan_state, self._opening = self._opening, None

    def closing(self, group: Group) -> None:
        self.controller.group_closing(group.plan_state.position)

    def move_at_most(self, group: Group) -> int | None:
        planned = group.plan_state
        if planned is None or (group.recompute and planned.position in self._written):
            return None
        return self.controller.move_at_most(planned.position, planned.decision)

    def inputs_written(self, group: Group) -> None:
        self._written.add(group.plan_state.position)

    def saved_under_checkpoint(self, group: Group, t: torch.Tensor) -> None:
        if group.plan_state.would_save is not None:
            group.plan_state.would_save.see(t)

    @contextlib.contextmanager
    def recomputation(self, group: Group) -> Iterator[None]:
        position = group.plan_state.position
        self.controller.recompute_begins(position)
        try:
            yield
        finally:
            self.controller.recompute_ends(position)

    def committed(self, group: Group, saves: policy.SavePlan) -> None:
        planned: _Planned = group.plan_state
        inner = None
        if planned.would_save is not None:  # what it would move, were it not recomputed
            off = self.offloader
            assert off is not None
            inner = policy.plan_facts(planned.would_save.facts, min_offload_bytes=off.min_offload_bytes,
                                      policy=off.policy, committed=True)
            planned.would_save = None
        self.controller.committed(planned.position, group.recompute, saves, inner)

    def reached(self, group: Group) -> None:
        self.controller.backward_reaches(group.plan_state.position)

    def copy_window(self) -> tuple[int, int] | None:
        return self.controller.window()

    def stats(self) -> dict[str, Any]:
        return {"plan": self.controller.stats()}
