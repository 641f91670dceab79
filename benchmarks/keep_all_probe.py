"""Where a settled keep-everything plan's time goes against no offloading (a diagnostic, not a
test; CUDA): ``actoffload.tools.auto_check``'s fitting model trained with no offloader, with
``memory_budget="auto"`` (which settles on keeping everything there), and with none again. For
each, 20 steps' times and, per step, the caching allocator's device allocations and frees
(each ``cudaMalloc``/``cudaFree`` can stall the device), alloc retries and stream syncs; then
three steps under ``torch.profiler``: the CUDA API calls counted and the kernels' table.

    PYTHONPATH=. python benchmarks/keep_all_probe.py OUT.json > OUT-log.txt

On an H200 at e746ed5 (``benchmarks/results/*-e746ed5-keep-all-probe*``): none 86.10 and
86.75 ms a step, "auto" 87.25 (1.006-1.013x); no device allocation or free in the last four
steps of any of the three; the same kernels, for the same CUDA time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import actoffload as ao
from actoffload.tools.auto_check import FITTING_BATCH, _batch, _config, _model
from actoffload.tools.models import next_token_loss

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _counters(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in COUNTERS}


def run(name: str, off: ao.Offloader | None, model: torch.nn.Module, cfg: Any, device: torch.device,
        steps: int = 20, profiled: int = 3) -> dict[str, Any]:
    """``steps`` timed steps of ``model`` (its blocks wrapped by ``off`` where given), then
    ``profiled`` steps under the profiler; prints a summary, returns the figures."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    handle = ao.wrap(model.blocks, off) if off is not None else None
    rows = []
    for i in range(steps):
        x, y = _batch(cfg, FITTING_BATCH, i, device)
        torch.cuda.synchronize()
        before = _counters(device)
        t0 = time.perf_counter()
        next_token_loss(model(x).float(), y).backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        after = _counters(device)
        rows.append({"ms": ms, **{k: after[k] - before[k] for k in COUNTERS}})
        opt.step()
        opt.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(profiled):
            x, y = _batch(cfg, FITTING_BATCH, 100 + i, device)
            next_token_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    plan = off.stats()["plan"] if off is not None else None
    if handle is not None:
        handle.remove()
    api = {e.key: e.count for e in prof.key_averages() if e.key.startswith("cuda")}
    last = rows[-8:]
    print(f"== {name}: last 8 step ms {[round(r['ms'], 1) for r in last]}, "
          f"median {statistics.median(r['ms'] for r in last):.2f}")
    print("   per step", [{k: r[k] for k in COUNTERS} for r in rows[-4:]])
    print(f"   CUDA API calls in {profiled} profiled steps:", api)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    if plan is not None:
        print("   plan", plan.get("state"), [g["action"] for g in plan.get("groups", [])])
    return {"steps": rows, "cuda_api_calls": api,
            "plan": None if plan is None else [g["action"] for g in plan.get("groups", [])]}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/keep_all_probe.py OUT.json", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("keep_all_probe: needs CUDA (it reads the caching allocator's counters)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg = _config(False)
    model = _model(cfg, device)
    out = {"none": run("none", None, model, cfg, device),
           "auto": run("auto", ao.Offloader(memory_budget="auto"), model, cfg, device),
           "none_again": run("none again", None, model, cfg, device)}
    with open(argv[0], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
