"""What a plan's first step shows the allocator holding beyond its allocated peak, against the
reserve measured before it, over loop sweeps' results (``actoffload.tools.loop_sweep``): the
evidence behind judging a plan not yet run with more than the reserve (docs/budgets.md,
"Choosing"). Reads the sweeps' recorded steps; runs nothing. Prints, over every plan's first
step after profiling (a plan: the actions a signature's step ran), the share over the reserve
(reserved less allocated peak, over the reserve as the step began) in quartiles; and of the
first steps over the budget, how many had less than 1.1x, 1.2x, ... the reserve for room beside
their allocated peak, against how many of those within the budget had as little; and how often
a first step went over on a cache given back just before it, against one other steps built:
whether giving the cache back before a plan's first step would keep it within the budget.

    .venv/bin/python benchmarks/first_step_shares.py [FILE.json.gz ...]

Without files: every committed loop sweep of 2026-11-30 and 2026-12-01 under benchmarks/results.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys
from typing import Any, Iterator

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT = ("*2026-11-30-*loop-sweep*.json.gz", "*2026-12-01-*loop-sweep*.json.gz")
ROOMS = (1.1, 1.2, 1.3, 1.5)
# why a cache was given back as a step began (AllocatorReserve.trims_by); "plan changed" gives it
# back as a step over the budget ends, so the step after begins on a cache given back
TRIMS_AS_BEGINS = frozenset({"first", "grown between steps", "over the budget", "outgrown"})


def steps(cell: dict[str, Any], loop: str) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """A budget cell's steps the offloader ran: reserved and allocated peak (bytes) and its plan's
    record (none from a sweep older than these records)."""
    plans = cell.get("plan_steps") or []
    if loop == "variable_length":
        yield from zip(cell.get("reserved_bytes") or (), cell.get("allocated_bytes") or (), plans)
    else:  # accumulation: its micro-batches (optimizer steps and evaluation forwards run no plan)
        micro = (r for r in cell.get("records") or () if r["kind"] == "micro")
        yield from ((r["reserved_bytes"], r["allocated_bytes"], p) for r, p in zip(micro, plans))


def first_steps(doc: dict[str, Any]) -> Iterator[tuple[float, float, bool, bool | None]]:
    """Each plan's first step after profiling: its share over the reserve before it, its room
    (the budget less its allocated peak) over that reserve, whether it went over, and whether it
    began on a cache given back just before it (None where the sweep recorded no reasons)."""
    for workload in doc.get("workloads", []):
        for loop in ("variable_length", "accumulation"):
            for cell in (workload.get(loop) or {}).get("budgets", []):
                if "budget_bytes" not in cell:
                    continue
                budget, seen, before, trims, changed = cell["budget_bytes"], set(), None, None, False
                for reserved, allocated, plan in steps(cell, loop):
                    ran = tuple(a for a in plan.get("ran") or () if isinstance(a, str))
                    key = (plan.get("tokens"), ran)
                    now = plan.get("cache_trims_by")
                    new = None if now is None else {why for why, n in now.items() if n > (trims or {}).get(why, 0)}
                    fresh = None if new is None else bool(new & TRIMS_AS_BEGINS) or changed
                    if ran and key not in seen and before and plan.get("state") != "profiling":
                        yield ((reserved - allocated) / before, (budget - allocated) / before, reserved > budget,
                               fresh)
                    seen.add(key)
                    before, trims, changed = plan.get("allocator_reserve_bytes"), now, "plan changed" in (new or ())


def main(argv: list[str]) -> int:
    files = argv or sorted(f for pattern in DEFAULT for f in glob.glob(os.path.join(RESULTS, pattern)))
    if not files:
        print("no loop sweep results found: give their files", file=sys.stderr)
        return 2
    rows = []
    for name in files:
        with gzip.open(name, "rt") if name.endswith(".gz") else open(name) as f:
            rows += list(first_steps(json.load(f)))
    if not rows:
        print(f"no plan's first step recorded in {len(files)} files", file=sys.stderr)
        return 2
    shares = sorted(share for share, _, _, _ in rows)
    over = [room for _, room, went_over, _ in rows if went_over]
    within = [room for _, room, went_over, _ in rows if not went_over]
    quartiles = ", ".join(f"{shares[min(len(shares) - 1, int(q * len(shares)))]:.2f}" for q in (0.25, 0.5, 0.75))
    print(f"{len(files)} files: {len(rows)} first steps of a plan after profiling, {len(over)} over the budget")
    print(f"share over the reserve before it: quartiles {quartiles}; the most {shares[-1]:.2f}")
    for room in ROOMS:
        print(f"room under {room:.1f}x the reserve: {sum(r < room for r in over)} of the {len(over)} over, "
              f"{sum(r < room for r in within)} of the {len(within)} within")
    for fresh, where in ((True, "a cache given back just before it"), (False, "a cache other steps built")):
        began = [went_over for _, _, went_over, f in rows if f is fresh]
        print(f"on {where}: {sum(began)} of {len(began)} over"
              + (f" ({100 * sum(began) / len(began):.1f}%)" if began else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
