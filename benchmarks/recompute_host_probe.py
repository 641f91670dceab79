"""Where a plan that recomputes every layer loses to torch's checkpoint on transformers' SDPA
Llama (a diagnostic, not a test): steps of no offloading, of ``torch.utils.checkpoint`` around
each layer (as ``budget_sweep`` runs it), and of ``fast`` under a memory budget made to run a
plan (``BudgetController.force``: by default recomputing every layer, and keeping every layer;
``--plan NAME=CODES/W/PF`` for others), and with ``--budget`` one left to choose at
checkpointing's reserved peak, in alternating rounds; for each, the median step time and the
host's time to issue it (until ``backward()`` returns). Then ``--cprofile NAME``: a plan's steps
under cProfile; and one step each of checkpointing and of fast recomputing, under
``torch.profiler``.

    PYTHONPATH=. python benchmarks/recompute_host_probe.py [--device cpu] > OUT-log.txt
    PYTHONPATH=. python benchmarks/recompute_host_probe.py --plan R=R/0/0 --plan Q=Q/1/1 --budget --cprofile R

On an H200 at e746ed5 (``benchmarks/results/*-e746ed5-recompute-host-probe-log.txt``): no
offloading 61.8 ms (host 39.5), checkpointing 80.5 (host 72.4), fast recomputing 90.3 (host
82.2), fast keeping 63.2 (host 45.6). The device's time is the same for checkpointing and fast
recomputing (71.8 and 71.6 ms of kernels); the step waits on the host, about 1.2 ms more a
layer. At d73a67d, after the work on the recomputed group's host costs: checkpointing 78.2
(host 61.6), fast recomputing 79.8 (host 67.3): 1.02x. At a16c714, b84b9de, 27aec91 and
6a9b00c, 1.08-1.11x (the host 6-12 ms a step behind checkpointing's; see benchmarks/README.md).
On the CPU machine (``--device cpu``, the tiny model, one thread) the same comparison shows
0.3-0.7 ms a layer (it varies with the machine's load).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
from typing import Any

import torch
from forced_llama import ForcedLlama
from torch.profiler import ProfilerActivity, profile

import actoffload as ao
from actoffload.budget.actions import Action
from actoffload.tools.sweep_models import plain


CODES = {"K": Action.KEEP, "R": Action.RECOMPUTE, "Q": Action.RECOMPUTE_OFFLOAD, "O": Action.OFFLOAD}
DEFAULT_PLANS = ("fast_recompute=R/0/0", "fast_keep=K/0/0")


def plan_of(spec: str, layers: int | None) -> tuple[str, list[Action], int, int]:
    """``NAME=CODES/MAX_INFLIGHT/PREFETCH``: one code a layer (``K`` keep, ``R`` recompute,
    ``Q`` recompute with the inputs moved out, ``O`` offload), or one for every layer
    (``layers=None``: its form only, before the model is built)."""
    name, _, rest = spec.partition("=")
    parts = rest.split("/")
    if not name or len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise SystemExit(f"recompute_host_probe: plan {spec!r} is not NAME=CODES/MAX_INFLIGHT/PREFETCH (R00=R/0/0, say)")
    codes = parts[0] * (layers or 1) if len(parts[0]) == 1 else parts[0]
    if (layers is not None and len(codes) != layers) or not codes or set(codes) - set(CODES):
        each = f"each of {layers} layers" if layers is not None else "each layer (or one for all)"
        raise SystemExit(f"recompute_host_probe: plan {spec!r} needs one of {''.join(CODES)} for {each}")
    return name, [CODES[c] for c in codes], int(parts[1]), int(parts[2])


def _reserved_peak(rig: ForcedLlama, call: Any) -> int:
    """The reserved peak of a few steps of ``call`` on a cache given back first (CUDA)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for i in range(3):
        rig.step(call, i)
    return torch.cuda.max_memory_reserved()


def _host_profile(rig: ForcedLlama, name: str, plans: list[tuple[str, list[Action], int, int]], steps: int) -> None:
    """``steps`` steps of plan ``name`` (or of checkpointing) under cProfile: the functions by own
    time, then by cumulative time."""
    forced = {n: (a, w, pf) for n, a, w, pf in plans}
    h = rig.forced(*forced[name]) if name != "checkpoint" else None
    call = rig.checkpointed if h is None else plain
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        rig.step(call, i)
    prof.disable()
    if h is not None:
        h.remove()
    print(f"== cProfile {name}, {steps} steps")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(32)
        print(text.getvalue())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps of each method per round")
    p.add_argument("--plan", action="append", default=None, metavar="NAME=CODES/W/PF",
                   help="a forced plan to time (repeatable): one code a layer, K keep, R recompute, Q recompute "
                        "with its inputs moved out, O offload (or one code for all), then max_inflight and "
                        f"prefetch; default: {' '.join(DEFAULT_PLANS)}")
    p.add_argument("--budget", action="store_true",
                   help="also time a fast offloader left to choose, its memory_budget checkpointing's reserved peak (CUDA)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    p.add_argument("--cprofile", action="append", default=[], metavar="NAME",
                   help="also run --steps steps of this plan (or 'checkpoint') under cProfile: where its host time goes")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("recompute_host_probe: no CUDA here; pass --device cpu", file=sys.stderr)
        return 2
    specs = args.plan or DEFAULT_PLANS
    names = {plan_of(spec, None)[0] for spec in specs}  # bad input said before the model is built
    unknown = [n for n in args.cprofile if n != "checkpoint" and n not in names]
    if unknown:
        raise SystemExit(f"recompute_host_probe: --cprofile {unknown[0]!r} names no --plan (nor 'checkpoint')")
    device = torch.device(args.device)
    rig = ForcedLlama(device)
    step, forced, checkpointed = rig.step, rig.forced, rig.checkpointed
    plans = [plan_of(spec, len(rig.workload.blocks)) for spec in specs]

    budget = None
    if args.budget and device.type == "cuda":
        limit = _reserved_peak(rig, checkpointed)
        budget = ao.Offloader(memory_budget=limit, device=device)
        handle = ao.wrap(rig.workload.blocks, budget)
        for i in range(30):  # profiling, exploring, settled
            step(plain, i)
        handle.remove()
        print(f"budget at checkpointing's reserved peak: {limit / 2**30:.3f} GiB")

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ["none", "checkpoint"] + [n for n, *_ in plans]}
    if budget is not None:
        times["budget"] = []
    for _ in range(args.rounds):
        times["none"] += [step(plain, i) for i in range(args.steps)]
        times["checkpoint"] += [step(checkpointed, i) for i in range(args.steps)]
        for name, actions, w, pf in plans:
            h = forced(actions, w, pf)
            times[name] += [step(plain, i) for i in range(args.steps)]
            h.remove()
        if budget is not None:
            h = ao.wrap(rig.workload.blocks, budget)
            times["budget"] += [step(plain, i) for i in range(args.steps)]
            h.remove()
    for name, v in times.items():
        print(f"{name:15s} step ms {statistics.median(s for _, s in v):7.2f}  host ms {statistics.median(h for h, _ in v):7.2f}")
    if budget is not None:
        plan = budget.stats()["plan"]
        print("budget's plan:", [g["action"] for g in plan.get("groups", [])], "max_inflight", plan.get("max_inflight"), "prefetch",
              plan.get("prefetch"), "reserve GiB", round(plan.get("allocator_reserve_bytes", 0) / 2**30, 3),
              "trims", plan.get("cache_trims"), "tried", [(t.get("actions"), t.get("max_inflight"), t.get("prefetch"),
                                                             t.get("measured_step_s")) for t in plan.get("tried", [])])
    for name in args.cprofile:
        _host_profile(rig, name, plans, args.steps)
    if args.no_profile:
        return 0
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
