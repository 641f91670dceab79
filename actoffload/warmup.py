"""The warm-up plan: a fresh offloader's first steps recompute instead of waiting on pinning.

Pinning host memory costs about as much per byte as copying it, so a first step that
offloads would run at a fraction of the steady pace. While the host blocks the first step
asked for are pinned on a background thread, modules given to ``ao.wrap`` run under
activation checkpointing (their inputs moved out: the least device memory of any plan);
the first step that begins with every block pinned offloads as usual. The first warm-up
step also learns what each recomputed group would move once it offloads, so that the
blocks it reserves are the ones those commits will take.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from . import policy
from .checkpointing import WouldSave
from .plans import OFFLOAD, Opening, Plan
from .records import Group


_RECOMPUTE = Opening(recompute=True)  # inputs guarded: the default


class WarmUp(Plan):
    """Recompute wrapped modules until the host memory the first step asked for is pinned.

    Example::

        off = ao.Offloader(impl="fast", warmup="recompute")   # fast builds this plan
        off.stats()["warmup"]   # {'warming_up': True, 'steps': 1, 'pinning_bytes': ..., 'error': None}
    """

    def __init__(self, active: bool = True):
        super().__init__()
        self.warming = active  # ``False``: offload from the first step (pinning as blocks are first needed)
        self.steps = 0  # steps begun while warming up
        self._sizing_step: int | None = None  # the step whose groups reserved host blocks
        self._sized: dict[int, Any] = {}  # storage key -> weak reference, sized in that step (R5: moved once)

    def step_begins(self) -> None:
        if not self.warming:
            return
        assert self.offloader is not None
        if self.steps and self.offloader.host_pinning()[0] == 0:
            self.warming = False  # what a whole step reserved is pinned (or reserving failed)
            self._sized = {}
        else:
            self.steps += 1

    def acts_at(self) -> frozenset[str]:
        # (a recomputed group commits at its exit, in the step that opened it: once warming is
        # over, no group is left for committed() to size)
        return super().acts_at() if self.warming else frozenset()

    def opening(self, name: str, recomputable: bool, parts: int) -> Opening:
        return _RECOMPUTE if self.warming and recomputable else OFFLOAD

    def opened(self, group: Group) -> None:
        if group.recompute and self._sizing():
            assert self.offloader is not None
            group.plan_state = WouldSave(self.offloader.device)

    def _sizing(self) -> bool:
        """Whether this step's recomputed groups size the host blocks (the first warm-up step's)."""
        return self.warming and self._sizing_step in (None, self.steps)

    def checkpoint_saves_observer(self, group: Group) -> Callable[[torch.Tensor], None] | None:
        return group.plan_state.see if isinstance(group.plan_state, WouldSave) else None

    def committed(self, group: Group, saves: policy.SavePlan) -> None:
        would = group.plan_state
        if not isinstance(would, WouldSave):
            return
        group.plan_state = None
        off = self.offloader
        assert off is not None
        # what this group will move once it offloads, as its commit would decide
        inner = would.plan(off.min_offload_bytes, off.policy, moved_earlier=self._sized_earlier)
        refs = would.storage_refs()
        for span in inner.spans:
            if span.storage_key in refs:
                self._sized[span.storage_key] = refs[span.storage_key]
        self._sizing_step = self.steps
        weakref.finalize(group, off.reserve_host_blocks([sp.nbytes for sp in inner.spans]))

    def _sized_earlier(self, key: int, aliases: list[policy.SavedFact]) -> bool:
        """An earlier group of the sizing step would move this storage, still alive (R5)."""
        ref = self._sized.get(key)
        return ref is not None and not ref.expired()

    def stats(self) -> dict[str, Any]:
        assert self.offloader is not None
        pinning, error = self.offloader.host_pinning()
        return {"warmup": {"warming_up": self.warming, "steps": self.steps, "pinning_bytes": pinning,
                           "error": None if error is None else str(error)}}
