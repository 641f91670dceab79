"""Where fast's host time per group goes (a diagnostic, not a test): transformers' SDPA Llama of
the sweep (``hf_llama_sdpa``), steps of no offloading, of ``torch.utils.checkpoint`` around each
layer, and of ``fast`` made to keep every layer and to recompute every layer
(``BudgetController.force``); the median host time to issue a step (until ``backward()``
returns) and its full time, with Python's garbage collector on and then off; then five steps of
each under ``cProfile`` and, per function, the difference in time spent in it (recomputing less
checkpointing, keeping less no offloading), in ms a step, with the calls a step.

    PYTHONPATH=. python benchmarks/host_diff_probe.py [--device cpu] > OUT-log.txt

On an H200 at 860fdef (``benchmarks/results/*-860fdef-host-diff-probe-log.txt``): keeping every
layer issued its step in about the host time of no offloading (46.6 and 45.0 ms against 42.2 and
45.9); recomputing every layer took 72.2 and 76.4 ms against checkpointing's 67.9 and 70.0. On
the CPU machine (``--device cpu``, the tiny model) the same comparison runs in seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import statistics
import sys
from typing import Any

import torch
from forced_llama import ForcedLlama, per_step

from actoffload.budget.actions import Action
from actoffload.tools.sweep_models import plain


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny model)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_diff_probe: no CUDA here; pass --device cpu", file=sys.stderr)
        return 2
    rig = ForcedLlama(torch.device(args.device))
    step, forced, ck = rig.step, rig.forced, rig.checkpointed

    def timed(call: Any, n: int = 8) -> tuple[float, float]:
        v = [step(call, i) for i in range(n)]
        return statistics.median(x for x, _ in v), statistics.median(y for _, y in v)

    for gc_mode in ("on", "off"):
        if gc_mode == "off":
            gc.collect()
            gc.disable()
        res = {"none": timed(plain), "ckpt": timed(ck)}
        for name, action in (("keep", Action.KEEP), ("recompute", Action.RECOMPUTE)):
            hh = forced(action)
            res[name] = timed(plain)
            hh.remove()
        print("gc", gc_mode, {k: f"host {x:.1f} step {y:.1f}" for k, (x, y) in res.items()}, flush=True)
        gc.enable()

    def profiled(call: Any, n: int = 5) -> dict[tuple[str, int, str], tuple[float, float, float]]:
        pr = cProfile.Profile()
        pr.enable()
        for i in range(n):
            step(call, i)
        pr.disable()
        return per_step(pr, n)

    profiles = {"none": profiled(plain), "ckpt": profiled(ck)}
    for name, action in (("keep", Action.KEEP), ("recompute", Action.RECOMPUTE)):
        hh = forced(action)
        profiles[name] = profiled(plain)
        hh.remove()
    for a, b in (("recompute", "ckpt"), ("keep", "none")):
        pa, pb = profiles[a], profiles[b]
        rows = sorted(((pa.get(k, (0, 0, 0))[1] - pb.get(k, (0, 0, 0))[1], k) for k in set(pa) | set(pb)), reverse=True)
        print(f"== {a} - {b}: tottime per step, ms; total {sum(r[0] for r in rows):.2f}")
        for dt, k in rows[:40]:
            print(f"{dt:8.3f}  calls {pa.get(k, (0,))[0]:6.0f} vs {pb.get(k, (0,))[0]:6.0f}  "
                  f"cum {pa.get(k, (0, 0, 0))[2]:8.2f}  {k[0]}:{k[1]}({k[2]})")
        # (a checkout's path before the package's: "/work/main/actoffload/...")
        ours = sorted(((v[2], k) for k, v in pa.items() if "actoffload/" in k[0]), reverse=True)[:25]
        print(f"-- {a}: actoffload functions by cumulative time per step, ms")
        for ct, k in ours:
            print(f"{ct:8.3f}  calls {pa[k][0]:6.0f}  {k[0]}:{k[1]}({k[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
