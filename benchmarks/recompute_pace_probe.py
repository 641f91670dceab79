"""Whether the model's charge for a recomputation at the host's pace holds (a diagnostic, not a
test), on the loop sweep's decoder at its full length under a budget: its profiling steps'
times per group (the forward's device and host time, the recomputation's device and host time,
each profiling step: the first meters the costly ops, the second does not), then every plan
that ran until the budget settled, measured against three models of it: the profile as the
controller holds it (calibrated), the profiling steps merged as profiling merges them, and the
same with a host-paced group's recomputation charged its forward's host time instead of its
own, as the model did up to dde5856. In the loop sweep at 3f67cd2 (H200) the plan moving
nothing at checkpointing's peak ran 123.0 ms where that model said 156.6: the profiling steps'
forwards ran at the host's pace (1.2-1.5 ms on the attention parts, against 0.7 recomputed),
which :func:`~actoffload.budget.costmodel.recompute_time` charged every recomputation.

    PYTHONPATH=. python benchmarks/recompute_pace_probe.py [--device cpu] [--budget-gib 6.16] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import actoffload as ao
from actoffload.budget import costmodel
from actoffload.budget.controller import BudgetController
from actoffload.budget.costmodel import Profile
from actoffload.tools import loop_sweep
from actoffload.tools.models import block_parts
from forced_llama import loop_decoder

MS = 1e3


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * MS:.2f}"


def paced_by_forward(profile: Profile) -> Profile:
    """``profile`` with each host-paced group's recomputation charged its forward's host time
    (the model up to dde5856) instead of its own."""
    return dataclasses.replace(profile, groups=tuple(
        dataclasses.replace(g, recompute_host_s=None) for g in profile.groups))


def report(c: BudgetController) -> None:
    """The profiling steps' group times, and each measured plan against the three models."""
    steps = c.profiling_steps
    for n, step in enumerate(steps):
        print(f"profiling step {n + 1}: ms per group (forward device/host, recomputation device/host)")
        for i, m in enumerate(step.groups):
            print(f"  {i:3d}  {_ms(m.forward_s)} / {_ms(m.host_s)}   {_ms(m.recompute_s)} / {_ms(m.recompute_host_s)}")
    if len(steps) < 2:
        print(f"{len(steps)} profiling step(s) behind the profile: no unmetered step to compare with")
        return
    merged = costmodel.merged(costmodel.profile_of(steps[0]), costmodel.profile_of(steps[1]))
    variant = paced_by_forward(merged)
    assert c.profile is not None
    print("plan (actions), measured ms | modelled: as held, as profiled, recomputation at its forward's host pace")
    for m in c.measured_plans():  # (on the CPU nothing is timed: the models alone)
        p = m.plan
        models = [costmodel.simulate(prof, p.groups, p.max_inflight, p.prefetch)[1]
                  for prof in (c.profile, merged, variant)]
        moves = "moves" if costmodel.moves_bytes(c.profile, p.groups) else "still"
        actions = "".join(d.action.value[0] for d in p.groups)
        seconds = m.step_s if m.step_s is not None else statistics.median(m.times) if m.times else None
        measured = "-" if seconds is None else f"{seconds * MS:.1f}"  # (as stats() reports it)
        print(f"  {moves} {actions} {p.max_inflight}/{p.prefetch}: {measured} | "
              + ", ".join(f"{t * MS:.1f}" for t in models))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny decoder)")
    p.add_argument("--budget-gib", type=float, default=6.16,
                   help="the budget (default: checkpointing's reserved peak in the loop sweep)")
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args(argv)
    w = loop_decoder(a.device, "recompute_pace_probe")
    loop = loop_sweep._Loop(w, print)
    loop_sweep._warm_up(loop, [w.seq_len])
    off = ao.Offloader(impl="fast", device=w.device, memory_budget=int(a.budget_gib * (1 << 30)))
    handle = ao.wrap(w.blocks, off, parts=block_parts)
    for i in range(a.steps):
        w.loss(loop_sweep.plain, w.tokens(i, w.seq_len)).backward()
        for q in w.model.parameters():
            q.grad = None
    if w.device.type == "cuda":
        torch.cuda.synchronize()
    c = off.plan.controller
    print(f"after {a.steps} steps: {c.state.value}")
    report(c)
    handle.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
