"""The allocator's reserve: what PyTorch's caching allocator holds from the device beyond what
it has handed out, during a step.

A budget bounds the device memory the allocator reserves during a step, which is what runs out
(docs/budgets.md, "What the budget counts"). Plans are modelled in allocated bytes, which the
engine can follow group by group; the allocator adds its rounding and the cached blocks a
step's requests could not reuse (freed blocks of other sizes, split blocks too small to serve,
blocks of another stream). That difference is measured, not modelled: after each step whose
reserved peak grew beyond what was reserved when it began (its cache did not serve it), its
reserved peak less its allocated peak. The most seen is the **reserve**, added to every plan's
peak before it is judged against the budget. A step whose cache served it says nothing new:
its reserved peak is the cache an earlier step left.

What was cached before a step is the step's to reuse. It is given back to the device first
(``torch.cuda.empty_cache``) only where that can help: a step begins with more reserved than the
budget and more than the last step's peak (something outside the steps grew the cache: an
evaluation forward), or the last step went over the budget and a new plan follows (the reserve
grew, or its allocated peak was over), so that the new plan's blocks are made for it. A step
over the budget that taught nothing new (the budget is too small even for the plan needing the
least memory) does not empty the cache again: that would cost every step its allocations and
change nothing. Each workload's controller shares one reserve: they share one allocator.
"""

from __future__ import annotations

from typing import Any


class AllocatorReserve:
    """The reserve for one device's caching allocator (see the module).

    Example::

        reserve = AllocatorReserve()
        reserve.step_begins(probe, budget)                           # may empty the cache
        ...                                                           # the step
        reserve.step_ended(budget, allocated_peak, reserved_peak)    # measure
        plan_peak + reserve.bytes <= budget                          # what fits
    """

    def __init__(self) -> None:
        self.bytes = 0  # the most a step that grew the cache reserved beyond its allocated peak
        self.trims = 0  # times the cache was given back before a step
        self._start: int | None = None  # reserved when the latest step began
        self._last_peak = 0  # the latest step's reserved peak
        self._trim = False  # the latest step went over the budget, and a new plan follows

    def step_begins(self, probe: Any, budget: int) -> None:
        """A step begins: give the cache back where that can help (see the module), and note
        what is reserved now."""
        if not probe.cuda:
            return
        now = probe.reserved()
        if self._trim or (now > budget and now > self._last_peak):
            probe.trim()
            self.trims += 1
        self._trim = False
        self._start = probe.reserved()

    def step_ended(self, budget: int, allocated_peak: int, reserved_peak: int) -> bool:
        """A step ended with these peaks (bytes): whether the reserve grew."""
        if self._start is None:
            return False
        start, self._start = self._start, None
        self._last_peak = reserved_peak
        grew = reserved_peak > start and reserved_peak - allocated_peak > self.bytes
        if grew:
            self.bytes = reserved_peak - allocated_peak
        self._trim = reserved_peak > budget and (grew or allocated_peak > budget)
        return grew
