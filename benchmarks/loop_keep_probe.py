"""Where a budget's settled steps lose to no offloading in the loop sweep's variable-length loop
(a diagnostic, not a test): the decoder's loop (``loop_sweep.run_variable``) over its 48 drawn
lengths three times, with no offloader and under a budget (``--budget`` bytes): the first 48
steps settle, the second are timed (per length the median step ms), the third run under
cProfile (per function the difference in host ms a step, budget less none, with the calls a
step).

    PYTHONPATH=.:benchmarks python benchmarks/loop_keep_probe.py --budget 10646192128 [--device cpu]

On an H200 at e1de9ac (``benchmarks/results/*-e1de9ac-loop-keep-probe-*``), at the loop sweep's
halfway budget: the plans keeping everything ran 27.8 and 36.8 ms a step at 512 and 1024 tokens
against no offloading's 25.3 and 36.3; the budget's extra host time spread over many functions.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import statistics
from typing import Any

from actoffload.tools import loop_sweep
from forced_llama import loop_decoder, per_step


def run(loop: loop_sweep._Loop, m: loop_sweep.Method, lengths: list[int]) -> tuple[dict[int, float], dict[tuple[str, int, str], tuple[float, float, float]]]:
    """``m`` over ``lengths`` three times: the second pass's median ms by length, the third's
    profile by function."""
    timed, prof, count = loop.timed, cProfile.Profile(), 0

    def profiled(fn: Any) -> Any:
        nonlocal count
        count += 1
        if count <= 2 * len(lengths):
            return timed(fn)
        prof.enable()
        try:
            return timed(fn)
        finally:
            prof.disable()

    loop.timed = profiled  # type: ignore[method-assign]
    try:
        rec = loop_sweep.run_variable(loop, m, lengths * 3)
    finally:
        loop.timed = timed  # type: ignore[method-assign]
    by: dict[int, list[float]] = collections.defaultdict(list)
    for n, s in list(zip(rec["lengths"], rec["steps_s"]))[len(lengths):2 * len(lengths)]:
        by[n].append(s * 1e3)
    return {n: statistics.median(v) for n, v in sorted(by.items())}, per_step(prof, len(lengths))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=int, required=True, help="bytes (the loop sweep's halfway: see its JSON)")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    w = loop_decoder(a.device, "loop_keep_probe")
    lengths = loop_sweep.draw_lengths(w.seq_len, 48, 0)
    loop = loop_sweep._Loop(w, print)
    loop_sweep._warm_up(loop, lengths)
    none, none_funcs = run(loop, loop_sweep.Method("none"), lengths)
    budget, budget_funcs = run(loop, loop_sweep.Method("budget", budget=a.budget, level="given"), lengths)
    for name, ms in (("none", none), ("budget", budget)):
        print(f"{name:7s}", " ".join(f"{n}: {v:6.1f} ms" for n, v in ms.items()))
    print(f"calls a step: none {sum(v[0] for v in none_funcs.values()):.0f}, "
          f"budget {sum(v[0] for v in budget_funcs.values()):.0f}")
    zero = (0.0, 0.0, 0.0)
    rows = sorted(((budget_funcs.get(k, zero)[1] - none_funcs.get(k, zero)[1],
                    budget_funcs.get(k, zero)[0] - none_funcs.get(k, zero)[0], k)
                   for k in set(none_funcs) | set(budget_funcs)), reverse=True)
    print("host ms a step under cProfile, budget less none (calls a step):")
    for dt, calls, (where, line, name) in rows[:a.top]:
        print(f"  {dt:7.3f} ms {calls:8.1f}  {where}:{line}({name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
