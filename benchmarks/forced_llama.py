"""The probes' shared rig: transformers' SDPA Llama of the sweep (``hf_llama_sdpa``, tiny on
the CPU), its steps timed on the host and in full, and ``fast`` under a memory budget whose
controller is made to run one action on every layer (``BudgetController.force``); and the loop
sweep's decoder (:func:`loop_decoder`); and each function's time a step under cProfile
(:func:`per_step`); and the device a probe's ``--device`` names (:func:`probe_device`)."""

from __future__ import annotations

import cProfile
import pstats
import time
from typing import Any, Sequence

import torch

import actoffload as ao
from actoffload.budget.actions import Action, GroupDecision
from actoffload.budget.controller import PROFILE_STEPS
from actoffload.budget.costmodel import Profile
from actoffload.tools import loop_sweep
from actoffload.tools.budget_sweep import _checkpointed
from actoffload.tools.sweep_models import hf_llama, plain


class ForcedLlama:
    """The model (``name``: another of the sweep's transformers Llamas), warmed up and profiled
    once by a budget's offloader (then unwrapped).

    Example::

        rig = ForcedLlama(torch.device("cuda"))
        host_ms, full_ms = rig.step(rig.checkpointed, 0)   # torch's checkpoint around each layer
        handle = rig.forced(Action.RECOMPUTE)              # fast, recomputing every layer
        rig.step(plain, 0); handle.remove()
    """

    def __init__(self, device: torch.device, name: str = "hf_llama_sdpa"):
        self.device = device
        self.workload = hf_llama(name, device, small=device.type == "cpu")
        self.checkpointed = _checkpointed(len(self.workload.blocks))
        for i in range(3):
            self.step(plain, i)
        self.offloader = ao.Offloader(memory_budget=1 << 40, device=device)
        handle = ao.wrap(self.workload.blocks, self.offloader)
        for i in range(PROFILE_STEPS + 2):
            self.step(plain, i)
        self._controller = self.offloader.plan.controller
        handle.remove()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, call: Any, i: int = 0) -> tuple[float, float]:
        """One training step with the layers called by ``call``: the host's ms to issue it
        (until ``backward()`` returns) and its full ms."""
        self._sync()
        t0 = time.perf_counter()
        self.workload.loss(call, i).backward()
        t1 = time.perf_counter()
        self._sync()
        t2 = time.perf_counter()
        for q in self.workload.trainable:
            q.grad = None
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    def forced(self, action: Action | GroupDecision | Sequence[Action | GroupDecision], max_inflight: int = 0,
               prefetch: int = 0) -> Any:
        """The layers wrapped again, the controller made to run ``action`` everywhere (or each
        layer its own of a sequence; a decision where a fraction is wanted) with this copy window
        (two steps in); the wrap's handle."""
        each = [action] * len(self.workload.blocks) if isinstance(action, (Action, GroupDecision)) else list(action)
        decisions = [a if isinstance(a, GroupDecision) else GroupDecision(a) for a in each]
        handle = ao.wrap(self.workload.blocks, self.offloader)
        self._controller.force(decisions, max_inflight, prefetch)
        self.step(plain, 0)
        self.step(plain, 1)
        return handle


def probe_device(probe: str, asked: str) -> tuple[torch.device, str]:
    """The device a probe's ``--device`` names, and the card's name ("CPU" on the CPU); the probe
    stops with a message where CUDA is asked for and there is none."""
    device = torch.device(asked)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{probe}: no CUDA device; --device cpu runs the tiny shape")
    return device, torch.cuda.get_device_name() if device.type == "cuda" else "CPU"


def loop_decoder(device_name: str, probe: str) -> loop_sweep.LoopWorkload:
    """The loop sweep's decoder on ``device_name`` (tiny on the CPU), having printed the card
    and torch it runs on; a ``probe`` asked for CUDA where there is none stops, saying so.

    Example::

        w = loop_decoder("cuda", "least_memory_probe")   # w.device, w.blocks, w.loss(...)
    """
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{probe}: no CUDA device; --device cpu runs the tiny decoder")
    w = loop_sweep.llama(device, small=device.type == "cpu")
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}")
    return w


def every_group(profile: Profile, action: Action) -> list[GroupDecision]:
    """``action`` on every group of ``profile``; an action on a whole module
    (``Action.RECOMPUTE_WHOLE``, ``..._OFFLOAD``) on every module whose parts the groups are,
    its other parts inside it."""
    if not action.whole:
        return [GroupDecision(action)] * len(profile.groups)
    firsts = {m.first for m in profile.wholes}
    return [GroupDecision(action if i in firsts else Action.INSIDE) for i in range(len(profile.groups))]


def force_every_workload(off: ao.Offloader, action: Action, max_inflight: int = 0, prefetch: int = 0) -> None:
    """Every workload's controller of ``off``'s memory budget that has a profile runs
    ``action`` on every group (:func:`every_group`, ``BudgetController.force``), with this copy window."""
    for wl in off.plan.workloads.workloads:
        c = wl.controller
        if c.profile is not None:
            c.force(every_group(c.profile, action), max_inflight, prefetch)


def per_step(profiler: cProfile.Profile, steps: int) -> dict[tuple[str, int, str], tuple[float, float, float]]:
    """Each function ``profiler`` saw over ``steps`` steps, by (file, line, name), the file's path
    from its package on: its calls, its own ms and its cumulative ms, a step.

    Example::

        before = per_step(profiler, 5)[("actoffload/engine.py", 156, "_enter")]   # (calls, own ms, cum ms)
    """
    out = {}
    for (f, line, name), (_, calls, tottime, cumtime, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        where = f.split("site-packages/")[-1].split("tree_main/")[-1]
        out[(where, line, name)] = (calls / steps, tottime / steps * 1e3, cumtime / steps * 1e3)
    return out
