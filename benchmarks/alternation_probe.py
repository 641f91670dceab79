"""What a memory budget's steps cost when another method's steps run between them (a
diagnostic, not a test; CUDA): the sweep's decoder, a budget settled at no offloading's
reserved peak and at checkpointing 4 of 8 blocks' plus 0.4 GiB, then its steps alone, then
alternating with the rival's (no offloading; checkpointing 4), as the sweep's paired rounds
run them. Each budget step prints its time, what was reserved as it began, its reserved peak,
the times the cache was given back and the allocator's reserve so far. Then the same rounds
with the cache never given back as a step begins (the allocator's reserve module patched), to
tell what the giving back costs.

    PYTHONPATH=. python benchmarks/alternation_probe.py > OUT-log.txt
"""

from __future__ import annotations

import sys
import time

import torch

import actoffload as ao
from actoffload.budget import reserve as reserve_module
from actoffload.tools import budget_sweep as bs
from actoffload.tools.sweep_models import workloads

GiB = 1 << 30


def _line(run: bs._Runner, step: int) -> str:
    begin = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    seconds, _ = run.step(step)
    wall = time.perf_counter() - t0
    note = run.note or {}
    plan = run.off.stats()["plan"]
    return (f"{seconds * 1e3:7.1f} ms (wall {wall * 1e3:6.1f})  reserved at begin {begin / GiB:6.2f}  peak {run.reserved / GiB:6.2f}"
            f"  trims {note.get('cache_trims')}  reserve {(note.get('allocator_reserve_bytes') or 0) / GiB:.2f}"
            f"  state {plan.get('state')}  planning_s {plan.get('planning_s', 0):.3f}")


def main() -> int:
    if not torch.cuda.is_available():
        print("alternation_probe: needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    w = dict(workloads(device, small=False))["llama"]()
    methods = bs._methods(w, device)
    none, _ = bs.measure(w, methods["none"], device, 3, 2)
    ckpt4, _ = bs.measure(w, methods["checkpoint_4"], device, 3, 2)
    cases = [("none", none["reserved_peak_bytes"]), ("checkpoint_4", ckpt4["reserved_peak_bytes"] + int(0.4 * GiB))]
    give_back = reserve_module.AllocatorReserve.step_begins
    for rival_name, budget in cases:
        print(f"== budget {budget / GiB:.2f} GiB, rival {rival_name}")
        method = bs.Method("fast_budget", parts=True,
                           offloader=lambda: ao.Offloader(impl="fast", device=device, memory_budget=budget))
        _, run = bs.measure(w, method, device, 3, 2 + 2, settle=True)
        rival = bs._Runner(w, methods[rival_name], device)
        step = 1000
        for label, patched in (("alone", False), ("alternating", False), ("alternating, cache kept", True)):
            if patched:
                def kept(self, probe, budget, reachable=lambda: True, _orig=give_back):
                    if self.trims == 0:
                        return _orig(self, probe, budget, reachable)
                    self._over = False
                    self._start = probe.reserved()
                reserve_module.AllocatorReserve.step_begins = kept
            print(f"-- {label}")
            try:
                for _ in range(8):
                    if label != "alone":
                        rival.step(step)
                        step += 1
                    print("  " + _line(run, step))
                    step += 1
            finally:
                reserve_module.AllocatorReserve.step_begins = give_back
        run = rival = None
        bs._empty_caches(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
