"""How long planning takes: the search's candidates and the choice among them, for a step of
24 to 384 synthetic groups (a transformer's blocks, each group the size of a block's
activations; with ``--parts``, every three groups the parts of a block that may be recomputed
whole; with ``--selective``, each group's costly ops measured, so that the search also tries
recomputing it selectively); and the quick search a CUDA step makes while the whole one runs
in the planning process (docs/budgets.md, "What planning costs"). Prints seconds per size;
asserts nothing.

    .venv/bin/python benchmarks/bench_planning.py [--parts] [--selective] [--sizes 24,96,128,192,384] [--repeat 3] [--processes 2]
"""

from __future__ import annotations

import argparse
import random
import time

from actoffload.budget import search
from actoffload.budget.costmodel import GroupProfile, Profile, Whole


def synthetic(n: int, parts: bool = False, seed: int = 0, selective: bool = False) -> Profile:
    """``n`` groups with a block's spans (a few large, some small), inputs, times and extras
    (``selective``: and three costly ops holding seven eighths of the large span's bytes, half of
    the recomputation's time, the smallest of them an attention taking a quarter)."""
    rng = random.Random(seed)
    groups = []
    for i in range(n):
        big = rng.choice([32, 48, 64]) << 20
        spans = tuple(sorted([big, big // 2, big // 4] + [rng.randint(1, 8) << 16 for _ in range(4)], reverse=True))
        fwd = rng.uniform(2e-3, 4e-3)
        groups.append(GroupProfile(str(i), spans=spans, kept=1 << 16, inputs=16 << 20, forward_s=fwd,
                                   backward_s=2 * fwd, forward_extra=big, backward_extra=big // 2,
                                   grads=8 << 20, recompute_extra=big // 4, recompute_s=0.8 * fwd,
                                   costly=(big // 2, big // 4, big // 8) if selective else None,
                                   costly_share=1 / 2 if selective else None,
                                   attention=(big // 8,) if selective else None,
                                   attention_share=1 / 4 if selective else None))
    wholes = tuple(Whole(i, 3, 16 << 20) for i in range(0, n - 2, 3)) if parts else ()
    return Profile(tuple(groups), base=8 << 30, outside_s=5e-3, d2h_bps=25e9, h2d_bps=25e9,
                   outside_extra=256 << 20, wholes=wholes)


def planning_seconds(profile: Profile, budget: int, quick: bool = False, processes: int = 1) -> float:
    """One pass: the whole search, with the fastest plan within the budget improved group by
    group as a controller asks it, in ``processes`` processes (``quick``: the quick search a CUDA
    step makes while the whole one runs in the planning process), and the choice."""
    start = time.perf_counter()
    plans = (search.quick_candidates(profile) if quick
             else search.candidates(profile, limits=[budget], processes=processes))
    search.choose(profile, budget, plans)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="24,96,128,192,384")
    ap.add_argument("--parts", action="store_true", help="every three groups the parts of a block")
    ap.add_argument("--selective", action="store_true", help="costly ops measured: selective recomputation tried")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--processes", type=int, default=1,
                    help="search in up to this many processes side by side, as the planning process does")
    args = ap.parse_args()
    if args.processes < 1 or args.repeat < 1:
        ap.error("--processes and --repeat take a count of at least 1")
    for n in (int(s) for s in args.sizes.split(",")):
        profile = synthetic(n, args.parts, selective=args.selective)
        keep_all = sum(g.offloadable + g.kept for g in profile.groups) + profile.base
        budget = profile.base + (keep_all - profile.base) // 3  # a third of the activations fit
        best = min(planning_seconds(profile, budget, processes=args.processes) for _ in range(args.repeat))
        quick = min(planning_seconds(profile, budget, quick=True) for _ in range(args.repeat))
        print(f"{n:4d} groups{' (parts)' if args.parts else ''}{' (selective)' if args.selective else ''}"
              f"{f' ({args.processes} processes)' if args.processes > 1 else ''}: {best:.3f} s"
              f" (the quick search a CUDA step makes: {quick:.3f} s)", flush=True)


if __name__ == "__main__":
    main()
