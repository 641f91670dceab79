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

What was cached before a step is the step's to reuse, unless it is already over the budget:
then (a step begins with more reserved than the budget, or the last step's reserved peak went
over it) the cache is given back to the device first (``torch.cuda.empty_cache``), so that the
next plan's blocks are made for it. Each workload's controller shares one reserve: they share
one allocator.
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
        self._trim = False  # the latest step's reserved peak went over the budget

    def step_begins(self, probe: Any, budget: int) -> None:
        """A step begins: give the cache back where it is over ``budget`` (or the last step went
        over), and note what is reserved now."""
        if not probe.cuda:
            return
        if self._trim or probe.reserved() > budget:
            probe.trim()
            self.trims += 1
        self._trim = False
        self._start = probe.reserved()

    def step_ended(self, budget: int, allocated_peak: int, reserved_peak: int) -> bool:
        """A step ended with these peaks (bytes): whether the reserve grew."""
        if self._start is None:
            return False
        start, self._start = self._start, None
        if reserved_peak > budget:
            self._trim = True
        if reserved_peak <= start or reserved_peak - allocated_peak <= self.bytes:
            return False
        self.bytes = reserved_peak - allocated_peak
        return True
