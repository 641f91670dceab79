"""Where a plan that recomputes every layer loses to torch's checkpoint on transformers' SDPA
Llama (a diagnostic, not a test): steps of no offloading, of ``torch.utils.checkpoint`` around
each layer (as ``budget_sweep`` runs it), and of ``fast`` under a memory budget made to recompute
every layer and to keep every layer (``BudgetController.force``), in three alternating rounds;
for each, the median step time and the host's time to issue it (until ``backward()`` returns).
Then one step each of checkpointing and of fast recomputing, under ``torch.profiler``.

    PYTHONPATH=. python benchmarks/recompute_host_probe.py [--device cpu] > OUT-log.txt

On an H200 at e746ed5 (``benchmarks/results/*-e746ed5-recompute-host-probe-log.txt``): no
offloading 61.8 ms (host 39.5), checkpointing 80.5 (host 72.4), fast recomputing 90.3 (host
82.2), fast keeping 63.2 (host 45.6). The device's time is the same for checkpointing and fast
recomputing (71.8 and 71.6 ms of kernels); the step waits on the host, about 1.2 ms more a
layer. At d73a67d (``*-d73a67d-recompute-host-probe-log.txt``), after the work on the
recomputed group's host costs: no offloading 62.6 ms (host 32.7), checkpointing 78.2 (host
61.6), fast recomputing 79.8 (host 67.3), fast keeping 62.5 (host 33.3): 1.02x checkpointing. On the CPU machine (``--device cpu``, the tiny model, one thread) the same comparison
shows 0.3-0.7 ms a layer (it varies with the machine's load).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from forced_llama import ForcedLlama
from torch.profiler import ProfilerActivity, profile

from actoffload.budget.actions import Action
from actoffload.tools.sweep_models import plain


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps of each method per round")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("recompute_host_probe: no CUDA here; pass --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    rig = ForcedLlama(device)
    step, forced, checkpointed = rig.step, rig.forced, rig.checkpointed

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ("none", "checkpoint", "fast_recompute", "fast_keep")}
    for _ in range(args.rounds):
        times["none"] += [step(plain, i) for i in range(args.steps)]
        times["checkpoint"] += [step(checkpointed, i) for i in range(args.steps)]
        for name, action in (("fast_recompute", Action.RECOMPUTE), ("fast_keep", Action.KEEP)):
            h = forced(action)
            times[name] += [step(plain, i) for i in range(args.steps)]
            h.remove()
    for name, v in times.items():
        print(f"{name:15s} step ms {statistics.median(s for _, s in v):7.2f}  host ms {statistics.median(h for h, _ in v):7.2f}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, call, action in (("checkpoint", checkpointed, None), ("fast_recompute", plain, Action.RECOMPUTE)):
        h = forced(action) if action is not None else None
        with profile(activities=activities) as prof:
            step(call, 5)
        print(f"== {name}")
        print(prof.key_averages().table(
            sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=18))
        if h is not None:
            h.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
