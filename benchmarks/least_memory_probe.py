"""What the least-memory plan costs against plans that need barely more (a diagnostic, not a
test), on the loop sweep's decoder at its full length (its blocks cut into parts, as the sweep
wraps them). Where no plan fits a budget (or the margins rule every one out), the controller
runs the plan of the least modelled peak, however slow: on an H200 at 6a9b00c that plan
(every part recomputed with its inputs moved out, the copies in step with compute) ran its
2048-token steps 1.3x checkpointing's time, while what it reserved (5.67 GiB) was 0.49 GiB
under the budget it was judged not to reach.

On an H200 at 2b25b25 (``benchmarks/results/*-2b25b25-least-memory-probe-log.txt``): checkpointing
117 ms; the least-memory plan 155 ms (1.32x), 3.98 GiB allocated, 5.62 reserved; every block
recomputed whole with its inputs moved out, in step with compute, 128 ms at the same 3.97 and
5.62 (not among the candidates then); with a copy in flight 119 ms, 4.00 and 6.12.

This profiles the decoder under a budget, then lists the candidates near the least peak: for
each tolerance, the fastest plan (as modelled) whose peak is within it of the least, with its
actions; then times, each on a cache given back first, checkpointing every block, the
least-memory plan, and the fastest plan within each tolerance (``BudgetController.force``),
printing the median step, the allocated and the reserved peak; then the same recomputation
forced by part and by whole block, its inputs kept or moved, with and without a copy in flight.

    PYTHONPATH=. python benchmarks/least_memory_probe.py [--device cpu] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from typing import Any

import torch

import actoffload as ao
from actoffload.budget import BudgetTooSmall
from actoffload.budget.actions import Action
from actoffload.budget.controller import PROFILE_STEPS
from actoffload.tools import loop_sweep
from actoffload.tools.models import block_parts
from forced_llama import every_group, loop_decoder

MiB = 1 << 20
TOLERANCES_MIB = (0, 8, 32, 64, 128, 256, 512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _steps(w: loop_sweep.LoopWorkload, call: Any, steps: int) -> tuple[float, int | None, int | None]:
    """Median ms of ``steps`` full-length steps of ``call`` (after one untimed), and the
    allocated and reserved peaks over them, on a cache given back first (CUDA)."""
    device = w.device
    for p in w.model.parameters():
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):
        tokens = w.tokens(i, w.seq_len)
        _sync(device)
        t0 = time.perf_counter()
        w.loss(call, tokens).backward()
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        for p in w.model.parameters():
            p.grad = None
    if device.type != "cuda":
        return statistics.median(times), None, None
    return statistics.median(times), torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _summary(plan: Any) -> str:
    counts = collections.Counter(g.action.value for g in plan.groups)
    return f"window {plan.max_inflight}/{plan.prefetch}: " + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny decoder)")
    p.add_argument("--budget-gib", type=float, default=6.16, help="the budget the decoder is profiled under")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each method")
    a = p.parse_args(argv)
    w = loop_decoder(a.device, "least_memory_probe")
    device = w.device
    ckpt = _steps(w, loop_sweep._checkpointed, a.steps)
    print(f"checkpoint every block: {ckpt[0]:.1f} ms, allocated {_gib(ckpt[1])}, reserved {_gib(ckpt[2])}")
    off = ao.Offloader(impl="fast", device=device, memory_budget=int(a.budget_gib * (1 << 30)))
    handle = ao.wrap(w.blocks, off, parts=block_parts)
    for i in range(PROFILE_STEPS + 12):  # profiled, then until the planning process's search answered
        try:
            w.loss(loop_sweep.plain, w.tokens(i, w.seq_len)).backward()
        except BudgetTooSmall as e:
            print(f"step {i}: {e}")
            w.loss(loop_sweep.plain, w.tokens(i, w.seq_len)).backward()
        for q in w.model.parameters():
            q.grad = None
        c = off.plan.controller
        if i >= PROFILE_STEPS and c.background_planning_s > 0:
            break
    plans = list(c.plans)
    least = min(plans, key=lambda q: (q.peak, q.step_s))
    print(f"{len(plans)} candidates (the whole search's: {c.background_planning_s > 0}); reserve "
          f"{c.reserve.bytes / MiB:.0f} MiB, margin {c.margin / MiB:.0f} MiB; least modelled peak "
          f"{least.peak / MiB:.0f} MiB at {least.step_s * 1e3:.1f} ms ({_summary(least)})")
    # the least memory as the controller judges it where no plan fits: measured peaks for plans
    # that ran, modelled ones with the margins for the others
    print(f"  running: {_summary(c.plan) if c.plan is not None else None}; no plan reaches the budget: "
          f"{c.too_small is not None}")
    print("  least judged (bytes above the reserve, with the margins; m: measured):")
    ran = {k for k in c._peaks}
    for q in sorted(c._judged(True), key=lambda q: (q.peak, q.step_s))[:4]:
        print(f"    {(q.peak - c.reserve.bytes) / MiB:.0f} MiB{' m' if q.key in ran else ''}, "
              f"{q.step_s * 1e3:.1f} ms ({_summary(q)})")
    chosen: dict[str, Any] = {"least": least}
    for tol in TOLERANCES_MIB:
        near = [q for q in plans if q.peak <= least.peak + tol * MiB]
        best = min(near, key=lambda q: q.step_s)
        print(f"  within {tol:>3} MiB: {len(near):>4} plans, fastest {best.step_s * 1e3:.1f} ms at "
              f"+{(best.peak - least.peak) / MiB:.0f} MiB ({_summary(best)})")
        if best.key not in {q.key for q in chosen.values()}:
            chosen[f"within {tol} MiB"] = best
    for name, plan in chosen.items():
        c.force(list(plan.groups), plan.max_inflight, plan.prefetch)
        _report(name, w, a.steps, ckpt[0], plan)
    # the same recomputation by part and by whole block, inputs kept or moved, in step with
    # compute (0/0) or one group's copy in flight (1/1): what makes the least memory slow
    for name, action, window in (
            ("parts R 0/0", Action.RECOMPUTE, (0, 0)), ("parts Q 1/1", Action.RECOMPUTE_OFFLOAD, (1, 1)),
            ("whole R 0/0", Action.RECOMPUTE_WHOLE, (0, 0)), ("whole Q 0/0", Action.RECOMPUTE_WHOLE_OFFLOAD, (0, 0))):
        groups = every_group(c.profile, action)
        c.force(groups, *window)
        assert c.plan is not None and c.plan.key == (tuple(groups), *window), "the forced plan does not run"
        _report(name, w, a.steps, ckpt[0], c.plan)
    handle.remove()
    return 0


def _report(name: str, w: loop_sweep.LoopWorkload, steps: int, ckpt_ms: float, plan: Any) -> None:
    ms, alloc, res = _steps(w, loop_sweep.plain, steps)
    print(f"{name:>16}: {ms:.1f} ms ({ms / ckpt_ms:.2f}x checkpointing), allocated {_gib(alloc)}, "
          f"reserved {_gib(res)}; modelled {plan.step_s * 1e3:.1f} ms, peak {plan.peak / MiB:.0f} MiB")


def _gib(v: int | None) -> str:
    return "-" if v is None else f"{v / (1 << 30):.2f} GiB"


if __name__ == "__main__":
    sys.exit(main())
