"""The allocator's reserve: what PyTorch's caching allocator holds from the device beyond what
it has handed out, during a step.

A budget bounds the device memory the allocator reserves during a step, which is what runs out
(docs/budgets.md, "What the budget counts"). Plans are modelled in allocated bytes, which the
engine can follow group by group; the allocator adds its rounding and the cached blocks a
step's requests could not reuse (freed blocks of other sizes, split blocks too small to serve,
blocks of another stream). That difference is measured, not modelled, and only where it says
something of the step itself: in a step that began on a **clean** cache (right after the cache
was given back) and grew what is reserved, its reserved peak less its allocated peak. The most
seen is the **reserve**, added to every plan's peak before it is judged against the budget. A
step whose cache served it says nothing new; one that grew a cache other work had left (an
evaluation forward's blocks, another length's) would count those idle blocks too, so the cache
is given back after it and the next step measures cleanly.

The cache is given back to the device (``torch.cuda.empty_cache``) at a step's end, where it
helps: after a step that grew a cache it did not begin clean (to measure cleanly next), and
after a step over the budget when the plan changes (so that the new plan's blocks are made for
it). A step over the budget that changes no plan (no plan reaches the budget) leaves the cache
alone: emptying it would cost every step its allocations and change nothing. It is also given
back before the first step, and before a step that begins with more reserved than the budget
and than the last step's peak (something between the steps grew it). Each workload's controller
shares one reserve: they share one allocator.
"""

from __future__ import annotations

from typing import Any


class AllocatorReserve:
    """The reserve for one device's caching allocator (see the module).

    Example::

        reserve = AllocatorReserve()
        reserve.step_begins(probe, budget)                                  # may empty the cache
        ...                                                                  # the step
        reserve.step_ended(probe, budget, allocated_peak, reserved_peak)    # measure (may empty it)
        plan_peak + reserve.bytes <= budget                                 # what fits
    """

    def __init__(self) -> None:
        self.bytes = 0  # the most a step begun on a clean cache reserved beyond its allocated peak
        self.trims = 0  # times the cache was given back
        self._start: int | None = None  # reserved when the latest step began
        self._last_peak = 0  # the latest step's reserved peak
        self._clean = False  # the latest step began on a clean cache
        self._trimmed = False  # the cache was given back since the latest step began
        self._over = False  # the latest step's reserved peak is over the budget

    def step_begins(self, probe: Any, budget: int) -> None:
        """A step begins: give the cache back before the first step, or where something between
        the steps grew it over the budget; note what is reserved now."""
        if not probe.cuda:
            return
        now = probe.reserved()
        if self.trims == 0 or (now > budget and now > self._last_peak):
            self._give_back(probe)
        self._clean, self._trimmed, self._over = self._trimmed, False, False
        self._start = probe.reserved()

    def step_ended(self, probe: Any, budget: int, allocated_peak: int, reserved_peak: int) -> bool:
        """A step's backward pass ended with these peaks so far (bytes; a step of several
        backward passes calls this at each): whether the reserve grew."""
        if self._start is None:
            return False
        self._last_peak, self._over = reserved_peak, reserved_peak > budget
        if reserved_peak <= self._start:  # its cache served it
            return False
        if not self._clean:  # it grew a cache other work left: measure from a clean one
            if not self._trimmed:
                self._give_back(probe)
            return False
        if reserved_peak - allocated_peak <= self.bytes:
            return False
        self.bytes = reserved_peak - allocated_peak
        return True

    def plan_changed(self, probe: Any) -> None:
        """The controller chose another plan: after a step over the budget, give the cache back,
        so that the new plan's blocks are made for it."""
        if self._over and not self._trimmed:
            self._give_back(probe)

    def _give_back(self, probe: Any) -> None:
        probe.trim()
        self.trims += 1
        self._trimmed = True
