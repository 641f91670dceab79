"""What the caching allocator holds idle when a step's forward ends, and what giving it back
there (``torch.cuda.empty_cache()`` before the head and the loss) does to the step's reserved
peak and its time (a diagnostic, not a test; CUDA).

On transformers' 8B-shaped Llama at 32k tokens (``hf_8b_32k``) checkpointing every layer
allocates at most 15.9 GiB and reserves 21.0-21.8 (with and without deterministic algorithms):
the blocks the layers' forwards freed stay cached, and, as we read it, the loss's float32
logits (3.9 GiB blocks) cannot reuse them. Each method runs as a block of
steps on a cache of its own (given back before its first step), with and without a forward hook
on the model's final norm, which runs once every layer's forward has, giving the idle cache
back; it prints each block's median step, its allocated and reserved peaks, and what the hook
found idle.

    PYTHONPATH=benchmarks:. python benchmarks/idle_cache_probe.py [--name hf_8b_32k] [--steps 4] [--device cpu] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from actoffload.budget.actions import Action
from actoffload.tools.budget_sweep import _checkpointed
from actoffload.tools.sweep_models import plain
from forced_llama import ForcedLlama, probe_device

GiB = 2**30


class IdleRelease:
    """A forward hook on ``module`` that gives the allocator's idle cache back (while on) and
    notes how much was idle each time."""

    def __init__(self, module: torch.nn.Module, cuda: bool):
        self.on, self.cuda, self.idle = False, cuda, []
        module.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        if not (self.on and self.cuda and torch.is_grad_enabled()):
            return
        self.idle.append(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        torch.cuda.empty_cache()


def block(rig: ForcedLlama, call: Any, steps: int) -> tuple[float, float, float]:
    """``steps`` steps after one on a fresh cache: the median full ms, and the most allocated
    and reserved GiB of any of them (0 on the CPU)."""
    cuda = rig.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    rig.step(call, 0)
    times, alloc, reserved = [], 0, 0
    for i in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times.append(rig.step(call, i + 1)[1])
        if cuda:
            alloc = max(alloc, torch.cuda.max_memory_allocated())
            reserved = max(reserved, torch.cuda.max_memory_reserved())
    return statistics.median(times), alloc / GiB, reserved / GiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="hf_8b_32k")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device, card = probe_device("idle_cache_probe", args.device)
    print(f"{card}, torch {torch.__version__}, {args.name}")
    rig = ForcedLlama(device, args.name)
    n = len(rig.workload.blocks)
    release = IdleRelease(rig.workload.model.model.norm, device.type == "cuda")
    methods: list[tuple[str, Any]] = [
        ("none", lambda: (plain, None)),
        ("checkpoint every layer", lambda: (_checkpointed(n), None)),
        ("selective checkpointing", lambda: (_checkpointed(n, "selective"), None)),
        ("fast: recompute every layer", lambda: (plain, rig.forced(Action.RECOMPUTE))),
        ("fast: recompute_selective", lambda: (plain, rig.forced(Action.RECOMPUTE_SELECTIVE))),
        ("fast: recompute_selective_offload w1 p1", lambda: (plain, rig.forced(Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1, 1))),
        ("fast: offload w1 p1", lambda: (plain, rig.forced(Action.OFFLOAD, 1, 1))),
    ]
    print(f"{'method':42s} {'release':>7s} {'ms':>8s} {'alloc':>7s} {'reserved':>8s} {'idle at release':>15s}")
    for name, make in methods:
        for on in (False, True):
            call, handle = make()
            release.on, release.idle = on, []
            ms, alloc, reserved = block(rig, call, args.steps)
            idle = f"{max(release.idle) / GiB:.2f}" if release.idle else "-"
            print(f"{name:42s} {str(on):>7s} {ms:8.1f} {alloc:7.2f} {reserved:8.2f} {idle:>15s}", flush=True)
            release.on = False
            if handle is not None:
                handle.remove()


if __name__ == "__main__":
    main()
