"""How many steps a fixed-shape budget takes to settle, replayed on the CPU from a GPU sweep's
results (a diagnostic, not a test): for each budget cell of ``budget_sweep`` JSON files, a
controller adopts the profile the cell ended with, under the cell's budget, with the allocator's
share its profiling steps showed as its reserve, and runs steps that take each plan's modelled
time (times ``--factor``) and allocate its modelled peak. Each step lasts that long on the host's
clock too, and the planning process answers as it would beside a GPU's steps (with
``--no-sleep`` the steps take no host time, and the planning runs in this process). A plan's
first step pins no host memory, or with ``--pin`` every plan's first step does (the sweep
records no count: on a GPU a plan moving spans of sizes its pool has not held pins).
It prints the steps until the plan settled (profiling's two counted, as the sweep counts them)
beside what the GPU run took.

    PYTHONPATH=. python benchmarks/settle_replay.py benchmarks/results/*-9aa3e0b-budget-sweep-d4096.json

A replay knows only the model: its steps run as modelled (times a constant), so a plan tried
never turns out faster than the model said. It counts the steps the rules for trying plans
spend; whether trying fewer loses speed, only a GPU run says. The profile a cell ended with was
calibrated by its own steps, so the first plans a replay chooses may differ from the GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from actoffload.budget.controller import PROFILE_STEPS, BudgetController
from actoffload.budget.costmodel import GroupProfile, Profile, Whole
from actoffload.budget.search import BudgetTooSmall


class _Mark:
    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return True


class ReplayProbe:
    """A device whose steps take what the replay says, with a cache that holds ``share`` bytes
    beyond every step's allocated peak and keeps what it grew to."""

    cuda = True
    asynchronous = True  # the planning process answers beside the steps, as on a GPU

    def __init__(self, base: int, share: int, bandwidth: float) -> None:
        self.now = 0.0
        self.base, self.share, self._bandwidth = base, share, bandwidth
        self.peak_bytes = base
        self.cache = base + share
        self.pinned = 0  # host allocations so far

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def mark(self) -> _Mark:
        return _Mark(self.now)

    def seconds(self, start: _Mark, end: _Mark) -> float:
        return end.t - start.t

    def allocated(self) -> int:
        return self.base

    def peak(self) -> int:
        return self.peak_bytes

    def peak_reserved(self) -> int:
        return max(self.cache, self.peak_bytes + self.share)

    def reserved(self) -> int:
        return self.cache

    def trim(self) -> None:
        self.cache = self.base

    def reclaim_above(self, budget: int, owner: object) -> str:
        return "a replayed device"

    def reset_peak(self) -> None:
        pass

    def host_clock(self) -> None:
        return None

    def bandwidth(self) -> tuple[float, float]:
        return self._bandwidth, self._bandwidth

    def host_allocations(self) -> int:
        return self.pinned


_GROUP_FIELDS = {f.name for f in dataclasses.fields(GroupProfile)}
_TUPLE_FIELDS = {f.name for f in dataclasses.fields(GroupProfile) if str(f.type).startswith("tuple")}


def profile_of(stats: dict[str, Any]) -> Profile:
    """The :class:`Profile` a cell's ``stats()["plan"]["profile"]`` describes, as any committed
    result recorded one: its lists as tuples, its modules of parts as mappings or as lists, a field
    the profile no longer has left out (one it has since gained and the record lacks, or one
    recorded in an earlier form, a number where the profile takes a tuple, raises ``TypeError``:
    the planner would fail on it later)."""
    groups = []
    for g in stats["groups"]:
        g = {k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k in _GROUP_FIELDS}
        old = sorted(k for k in _TUPLE_FIELDS & g.keys() if g[k] is not None and not isinstance(g[k], tuple))
        if old:
            raise TypeError(f"group {g.get('name')!r} records {', '.join(old)} in an earlier form (not a list)")
        groups.append(GroupProfile(**g))
    wholes = tuple(Whole(*w) if isinstance(w, list) else Whole(**w) for w in stats.get("wholes", ()))
    return Profile(tuple(groups), stats["base"], stats["outside_s"], stats["d2h_bps"], stats["h2d_bps"],
                   stats.get("outside_extra", 0), wholes)


def replaying(cell: dict[str, Any], asynchronous: bool = True) -> tuple[BudgetController, ReplayProbe]:
    """A controller under one budget cell's budget that adopted the profile the cell ended with,
    its reserve the allocator's share the cell's first step showed, and the probe its steps
    run on (``asynchronous``: planning in a helper process, as beside a GPU; else in this
    one). Raises KeyError or TypeError where the cell has no profile (an older sweep's), and
    BudgetTooSmall where no plan fits.

    Example::

        controller, probe = replaying(cell)
        step(controller, probe)   # one step of the plan it chose, as modelled
    """
    profile = profile_of(cell["plan"]["profile"])
    first = cell["early_steps"][0]
    share = first["reserved_peak_bytes"] - first["peak_bytes"]
    probe = ReplayProbe(profile.base, share, profile.d2h_bps)
    probe.asynchronous = asynchronous
    controller = BudgetController(cell["budget_bytes"], torch.device("cpu"), probe=probe)
    controller.reserve.bytes = share  # as the profiling steps measured it, before the plan is chosen
    controller.adopt_profile(profile, cell["plan"]["profiled_peak_bytes"])
    return controller, probe


def step(controller: BudgetController, probe: ReplayProbe, factor: float = 1.0, sleep: bool = False,
         pinning: set[Any] | None = None) -> None:
    """One step of the plan ``controller`` runs: its modelled time times ``factor`` (also on the
    host's clock with ``sleep``), its modelled peak, the cache kept as grown. ``pinning``: the
    plans whose first step pinned host memory so far (a plan not among them pins, and joins)."""
    controller.step_begins()
    if pinning is not None and controller.plan.key not in pinning:
        pinning.add(controller.plan.key)
        probe.pinned += 1
    seconds = controller.plan.step_s * factor
    probe.peak_bytes = controller.plan.peak
    if sleep:
        time.sleep(seconds)
    probe.advance(seconds)
    controller.backward_ends()
    probe.cache = probe.peak_reserved()


def replay(cell: dict[str, Any], factor: float = 1.02, sleep: bool = True, pin: bool = False,
           most: int = 30) -> int | str:
    """Steps until the plan of one budget cell (a ``fast_budget`` entry of a sweep) settled,
    profiling's counted; or why it did not. ``pin``: every plan's first step pins host memory.
    Without ``sleep`` the steps take no host time, so a planning process would not answer
    within them: the planning runs in this process instead.

    Example::

        cell = next(b for b in sweep["workloads"][0]["budgets"] if b["method"] == "fast_budget")
        replay(cell, sleep=False)   # 8, say
    """
    try:
        controller, probe = replaying(cell, asynchronous=sleep)
        pinning: set[Any] | None = set() if pin else None
        for n in range(most):
            step(controller, probe, factor, sleep, pinning)
            if controller.settled:
                return PROFILE_STEPS + n + 1
    except (KeyError, TypeError) as e:
        return f"not replayable: no {e} in this sweep's cell"
    except BudgetTooSmall:
        return "BudgetTooSmall"
    return f"not settled in {most}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="budget_sweep JSON files")
    parser.add_argument("--factor", type=float, default=1.02, help="steps take their modelled time times this")
    parser.add_argument("--no-sleep", dest="sleep", action="store_false",
                        help="steps take no host time (and the planning runs in this process: a helper "
                             "process would not answer within steps that take none)")
    parser.add_argument("--pin", action="store_true", help="every plan's first step pins host memory")
    args = parser.parse_args()
    for path in args.sweeps:
        sweep = json.loads(path.read_text())
        for workload in sweep["workloads"]:
            cells = [b for b in workload["budgets"] if b.get("method") == "fast_budget"]
            replayed = [replay(c, args.factor, args.sleep, args.pin) for c in cells]
            gpu = sweep["verdicts"][workload["workload"]].get("budget_steps_to_settle")
            print(f"{workload['workload']:10s} replayed {replayed}  on the GPU {gpu}", flush=True)


if __name__ == "__main__":
    main()
