"""Which plan a memory budget ran in each step, read from ``stats()["plan"]`` after it: the
sweeps record it beside each step's peaks, so a step over the budget can be traced to the plan
that ran (the plan shown after a step may already be the next one, chosen at its end)."""

from __future__ import annotations

from typing import Any


class PlanTrace:
    """Follows the plans a budget tried, per workload (its signature), step by step.

    Example::

        trace = PlanTrace()
        for step in steps:
            train(step)
            ran = trace.ran(off.stats()["plan"])   # ['keep', 'recompute', ..., max_inflight, prefetch]
    """

    def __init__(self) -> None:
        self._tried: dict[Any, dict[tuple[Any, ...], int]] = {}  # signature -> plan -> steps

    def ran(self, plan: dict[str, Any]) -> list[Any] | None:
        """The plan that ran in the step just over: the tried plan whose steps grew, as its
        actions followed by its copy window (``max_inflight``, ``prefetch``); ``None`` where
        none grew (a profiling step, which runs no plan of the search's); a list of them where
        several did (a step of several backward passes)."""
        signature = (plan.get("workload") or {}).get("signature")
        tried = {(*t["actions"], t["max_inflight"], t["prefetch"]): t["steps"] for t in plan.get("tried", [])}
        before = self._tried.get(signature, {})
        grew = [list(k) for k, n in tried.items() if n > before.get(k, 0)]
        self._tried[signature] = tried
        return grew[0] if len(grew) == 1 else (grew or None)
