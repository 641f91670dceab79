"""Where a budget's first steps spend their time (a diagnostic, not a test), on the loop sweep's
decoder at its full length, its blocks cut into parts as the sweep wraps them. In the loop sweep
at be473a6 (H200) every budget's first step took 270-400 ms and its second 170-210, where
checkpointing took 125: those two profiling steps alone cost 5-10% of a 48-step loop.

After the loop sweep's warm-up, a fresh offloader under ``--budget-gib`` runs ``--steps`` steps;
for each it prints the wall time, the controller's state, the host allocations made and the
seconds spent in them, and (``--cprofile N``) the N functions of the most own time in the
first two steps. Checkpointing's steps, on the same warmed process, are timed first.

    PYTHONPATH=. python benchmarks/first_steps_probe.py [--device cpu] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import threading
import time

import torch

import actoffload as ao
from actoffload.budget import controller as controller_module
from actoffload.budget import costmodel, search
from actoffload.tools import loop_sweep
from actoffload.tools.models import block_parts
from forced_llama import loop_decoder


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _TimedAllocations:
    """Counts the host allocations of one offloader's pool, and the seconds they take, those
    the step's own thread waited for apart from those pinned ahead on the pool's worker."""

    def __init__(self, off: ao.Offloader) -> None:
        pool = off._pool  # type: ignore[attr-defined]
        self.count, self.seconds, self._allocate = 0, 0.0, pool._allocate
        self.ahead, self.ahead_seconds = 0, 0.0
        self._lock = threading.Lock()

        def timed(nbytes: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return self._allocate(nbytes)
            finally:
                with self._lock:
                    if threading.current_thread() is threading.main_thread():
                        self.count += 1
                        self.seconds += time.perf_counter() - t0
                    else:
                        self.ahead += 1
                        self.ahead_seconds += time.perf_counter() - t0

        pool._allocate = timed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny decoder)")
    p.add_argument("--budget-gib", type=float, default=9.92, help="the budget (default: the loop sweep's halfway)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cprofile", type=int, default=25, help="functions listed per profiled step (0: none)")
    p.add_argument("--no-meter", action="store_true", help="profiling meters no costly op (what metering costs)")
    p.add_argument("--compare", action="store_true",
                   help="after the steps: each profiling step's times, and the plan each alone would choose")
    a = p.parse_args(argv)
    if a.no_meter:
        controller_module.OpMeter = lambda *args: None  # type: ignore[assignment,misc]
    w = loop_decoder(a.device, "first_steps_probe")
    device = w.device
    loop = loop_sweep._Loop(w, print)
    loop_sweep._warm_up(loop, [w.seq_len])
    times = []
    for i in range(4):
        _sync(device)
        t0 = time.perf_counter()
        w.loss(loop_sweep._checkpointed, w.tokens(i, w.seq_len)).backward()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        for q in w.model.parameters():
            q.grad = None
    print("checkpointing, ms per step:", " ".join(f"{t:.0f}" for t in times))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    off = ao.Offloader(impl="fast", device=device, memory_budget=int(a.budget_gib * (1 << 30)))
    allocations = _TimedAllocations(off)
    handle = ao.wrap(w.blocks, off, parts=block_parts)
    for i in range(a.steps):
        profiler = cProfile.Profile() if a.cprofile and i < 2 else None
        n0, s0, a0, b0 = allocations.count, allocations.seconds, allocations.ahead, allocations.ahead_seconds
        _sync(device)
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        w.loss(loop_sweep.plain, w.tokens(i, w.seq_len)).backward()
        _sync(device)
        if profiler is not None:
            profiler.disable()
        ms = (time.perf_counter() - t0) * 1e3
        for q in w.model.parameters():
            q.grad = None
        c = off.plan.controller
        print(f"step {i}: {ms:.0f} ms, state after it {c.state.value}, host allocations "
              f"{allocations.count - n0} in {(allocations.seconds - s0) * 1e3:.0f} ms, pinned ahead "
              f"{allocations.ahead - a0} in {(allocations.ahead_seconds - b0) * 1e3:.0f} ms")
        if profiler is not None:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(a.cprofile)
            print(out.getvalue())
    if a.compare:
        _compare(off.plan.controller, int(a.budget_gib * (1 << 30)))
    handle.remove()
    return 0


def _compare(c: controller_module.BudgetController, budget: int) -> None:
    """Each profiling step's summed group times, and the plan chosen from the first alone, from
    the second alone and from both (as profiling merges them), each timed by the merged model."""
    steps = c.profiling_steps
    if len(steps) < 2:
        print(f"compare: {len(steps)} profiling step(s) behind the profile; nothing to compare")
        return
    for name in ("forward_s", "backward_s", "recompute_s", "host_s"):
        sums = [sum(getattr(g, name) or 0.0 for g in s.groups) * 1e3 for s in steps]
        print(f"profiling steps, {name} summed over groups, ms: " + " / ".join(f"{x:.1f}" for x in sums))
    first, second = (costmodel.profile_of(s) for s in steps[:2])
    both = costmodel.merged(first, second)
    limit = budget - c.reserve.bytes - controller_module.least_margin(budget)
    for label, profile in (("first alone", first), ("second alone", second), ("both", both)):
        try:
            plan = search.choose(profile, limit)
        except search.BudgetTooSmall as e:
            print(f"{label}: {e}")
            continue
        peak, seconds = costmodel.simulate(both, plan.groups, plan.max_inflight, plan.prefetch)
        counts: dict[str, int] = {}
        for d in plan.groups:
            counts[d.action.value] = counts.get(d.action.value, 0) + 1
        print(f"{label}: modelled by it {plan.step_s * 1e3:.1f} ms, by both {seconds * 1e3:.1f} ms, peak "
              f"{peak / 2**30:.2f} GiB, window {plan.max_inflight}/{plan.prefetch}, {counts}")


if __name__ == "__main__":
    raise SystemExit(main())
