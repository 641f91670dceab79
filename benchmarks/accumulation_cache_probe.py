"""Where the accumulation loop's cache goes: the loop sweep's decoder (``loop_sweep``'s
accumulation without its evaluations), 4 micro-batches per AdamW step at full length, each
micro-batch's reserved and allocated peak, and the segments the cache holds at the end (each
segment's size, what is allocated in it, its largest free block).

Checkpointing every block runs first, with the caching allocator's cache given back
(``torch.cuda.empty_cache``) before no micro-batch, then before one chosen micro-batch: is a
cache given back while gradients are held rebuilt larger than one given back as an optimizer
step's first micro-batch begins? Then a budget at checkpointing's peak (``--halfway``: halfway from it to no offloading's), several times over,
with the controllers' choices that changed a plan (``--explain``: which workload, which plan,
the reserve, what fits); ``--unbound`` runs them as before workloads were bound to the cache
(docs/budgets.md, "What the budget counts"): no workload keeps its plan for another's sake.

Example (a GPU)::

    PYTHONPATH=.:benchmarks python benchmarks/accumulation_cache_probe.py --out probe.json --explain
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch

from actoffload.tools import loop_sweep as ls
from actoffload.tools.provenance import git_commit, write_results

GiB = 1 << 30


def segments() -> dict[str, Any]:
    """The cache's segments: size, allocated bytes in it, its largest free block (bytes)."""
    out = []
    for s in torch.cuda.memory_snapshot():
        free = [b["size"] for b in s["blocks"] if b["state"] != "active_allocated"]
        out.append({"size": s["total_size"], "allocated": s["allocated_size"], "largest_free": max(free, default=0),
                    "pool": s.get("segment_type")})
    out.sort(key=lambda s: -s["size"])
    return {"segments": out, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}


EVENTS: list[dict[str, Any]] = []


def explain() -> None:
    """Record every choice that changes a controller's plan (diagnostics: private fields)."""
    from actoffload.budget import controller as c

    names: dict[Any, int] = {}

    def short(plan: Any) -> Any:
        if plan is None:
            return None
        return names.setdefault(plan.key, len(names))

    original = c.BudgetController._choose

    def choose(self: Any) -> None:
        before = self._plan
        original(self)
        after = self._plan
        if after is None or (before is not None and before.key == after.key):
            return
        fitting = self._fitting()
        served = self._served_now()
        least = self._least_memory()
        EVENTS.append({"ctl": id(self) % 100000, "base": self._profile.base if self._profile else None,
                       "step": self._step_number, "state": str(self._state), "before": short(before),
                       "after": short(after), "after_peak": after.peak, "after_s": after.step_s,
                       "after_actions": sorted(set(str(g.action) for g in after.groups))[:6],
                       "reserve": self._reserve.bytes, "fitting": len(fitting),
                       "only_on_cache": sum(self._fits_only_on_its_cache(p.key, served) for p in fitting),
                       "least": short(least), "least_peak": least.peak, "least_pace": self._pace(least),
                       "after_pace": self._pace(after), "went_over": [short_key for short_key in
                                                                      (names.get(k) for k in self._went_over)],
                       "predicted": self.predicted, "too_small": self.too_small is not None})

    c.BudgetController._choose = choose  # type: ignore[method-assign]


def run(loop: ls._Loop, m: ls.Method, opt_steps: int, trim_at: tuple[int, int] | None,
        log: Callable[[str], None]) -> dict[str, Any]:
    w = loop.w
    rec: dict[str, Any] = {"method": m.name, "budget": m.budget, "trim_at": trim_at, "steps": []}
    with loop.method(m) as off:
        opt = torch.optim.AdamW(loop.params, lr=ls.ADAMW_LR)
        for k in range(opt_steps):
            for j in range(ls.MICRO_BATCHES):
                if trim_at == (k, j):
                    rec["before_trim"] = segments()
                    torch.cuda.empty_cache()
                    rec["after_trim"] = segments()
                tokens = w.tokens(100_000 + ls.MICRO_BATCHES * k + j, w.seq_len)

                def micro() -> None:
                    (loop.forward(m, tokens, []) / ls.MICRO_BATCHES).backward()

                _, s, reserved, allocated = loop.timed(micro)
                step: dict[str, Any] = {"k": k, "j": j, "s": s, "reserved": reserved, "allocated": allocated}
                if off is not None:
                    p = off.stats().get("plan") or {}
                    step.update(state=p.get("state"), trims=p.get("cache_trims_by"),
                                actions=sorted(set(p.get("actions") or [])))
                step["choices"] = EVENTS[:]
                EVENTS.clear()
                rec["steps"].append(step)

            def optimizer() -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)

            loop.timed(optimizer)
        rec["end"] = segments()
    over = [st for st in rec["steps"] if m.budget is not None and st["reserved"] > m.budget]
    rec["over"] = len(over)
    rec["max_reserved"] = max(st["reserved"] for st in rec["steps"])
    log(f"{m.name} budget={m.budget} trim_at={trim_at}: max reserved {rec['max_reserved'] / GiB:.2f} GiB, "
        f"over {len(over)}; reserved by step " + " ".join(f"{st['reserved'] / GiB:.2f}" for st in rec["steps"]))
    return rec


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--opt-steps", type=int, default=8)
    p.add_argument("--budget-runs", type=int, default=2)
    p.add_argument("--explain", action="store_true", help="record the controllers' choices")
    p.add_argument("--only-budget", action="store_true", help="checkpointing once, then the budget runs")
    p.add_argument("--unbound", action="store_true", help="the budget runs with no workload bound to the cache")
    p.add_argument("--halfway", action="store_true",
                   help="no offloading runs too, and the budget is halfway from checkpointing's peak to its")
    a = p.parse_args()
    if a.explain:
        explain()
    if a.unbound:
        from actoffload.budget.reserve import AllocatorReserve

        AllocatorReserve.bound_besides = lambda self, workload: False  # type: ignore[method-assign]
    device = torch.device("cuda")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    w = ls.llama(device, small=False)
    loop = ls._Loop(w, log)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
                               "unbound": a.unbound, "runs": []}

    def save() -> None:
        write_results(a.out, results)

    with loop.peaks:
        ls._warm_up(loop, [w.seq_len])
        ck = ls.Method("checkpoint_all", checkpoint=True)
        base = run(loop, ck, a.opt_steps, None, log)
        results["runs"].append(base)
        save()
        for at in (() if a.only_budget else ((3, 0), (3, 1), (3, 3))):
            results["runs"].append(run(loop, ck, a.opt_steps, at, log))
            save()
        budget, level = base["max_reserved"], "checkpoint_all_peak"
        if a.halfway:
            none = run(loop, ls.Method("none"), a.opt_steps, None, log)
            results["runs"].append(none)
            budget, level = (budget + none["max_reserved"]) // 2, "halfway"
        for _ in range(a.budget_runs):
            m = ls.Method("fast_budget", budget=budget, level=level)
            results["runs"].append(run(loop, m, 20, None, log))
            save()
        for at in (() if a.only_budget else ((6, 0), (6, 1))):
            m = ls.Method("fast_budget", budget=budget, level=level)
            results["runs"].append(run(loop, m, 12, at, log))
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
