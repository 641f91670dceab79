"""The caching allocator under a budget: it gives its cache back rather than grow past the
budget, and plans leave it a reserve.

A budget bounds the device memory PyTorch's caching allocator reserves during a step, which is
what runs out (docs/budgets.md, "What the budget counts"). The allocator keeps freed blocks
cached for later requests, and a loop's cache may come to hold blocks of every size it saw
(sequence lengths, an evaluation forward between steps). So the allocator is told the budget:
where a request it cannot serve from its cache would take it over the budget, it first gives
back cached blocks, oldest first (PyTorch's ``garbage_collection_threshold``), and only then
grows. This is no cap: what it cannot give back (the free parts of segments that hold live
blocks) may still take it over, and then the step goes over rather than fail.

Plans are modelled in allocated bytes, which the engine follows group by group. The allocator's
share on top is the **reserve**, added to every plan's peak before it is judged against the
budget: first, what the first step (on a cache emptied before it) reserved beyond its allocated
peak; then, after any step whose reserved peak went over the budget in spite of the giving
back, its reserved peak less its allocated peak, if more. Only those steps measure it: in a
step within the budget, what is reserved beyond the allocated peak may be cache the allocator
would have given back, had the step needed it. Each workload's controller shares one: they share
one allocator.

Example::

    share = AllocatorShare()
    share.step_begins(probe, budget)                                # gives back above the budget
    ...                                                              # the step
    share.step_ended(probe, budget, allocated_peak, reserved_peak)  # measure
    plan_peak + share.bytes <= budget                               # what fits
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

# device -> the share the allocator gives back for now (a token: ids are reused): of two shares
# on one device, each sets its budget at its own steps, and only the latest sets it back
_SET_BY: dict[str, int] = {}
_TOKENS = itertools.count()


class AllocatorShare:
    """The allocator's budget and the reserve for one device (see the module)."""

    def __init__(self) -> None:
        self.bytes = 0  # the reserve
        self.trims = 0  # times the whole cache was given back (before the first step)
        self.frees = 0  # blocks the allocator gave back to the device during steps
        self.collects_above: int | None = None  # the budget the allocator gives back above
        self._steps = 0
        self._frees_at_start: int | None = None
        self._token = next(_TOKENS)
        self._unset: Any = None  # sets the allocator back (weakref.finalize)

    def step_begins(self, probe: Any, budget: int) -> None:
        """A step begins: before the first, give back a cache that is not the loop's (a
        loader's blocks); have the allocator give back above ``budget``."""
        if not probe.cuda:
            return
        if self._steps == 0:
            probe.trim()
            self.trims += 1
        self._steps += 1
        key = str(probe.device)
        if self.collects_above != budget or _SET_BY.get(key) != self._token:
            probe.collect_above(budget)
            _SET_BY[key], self.collects_above = self._token, budget
            if self._unset is None:
                self._unset = weakref.finalize(self, _unset, probe, key, self._token)
        self._frees_at_start = probe.device_frees()

    def step_ended(self, probe: Any, budget: int, allocated_peak: int, reserved_peak: int) -> bool:
        """A step's backward pass ended with these peaks so far (bytes; a step of several
        backward passes calls this at each): whether the reserve grew."""
        if not probe.cuda or self._frees_at_start is None:
            return False
        now = probe.device_frees()
        self.frees += now - self._frees_at_start
        self._frees_at_start = now
        if self._steps > 1 and reserved_peak <= budget:
            return False  # within the budget: what it reserved beyond may be cache it would give back
        if reserved_peak - allocated_peak <= self.bytes:
            return False
        self.bytes = reserved_peak - allocated_peak
        return True

    def close(self) -> None:
        """Set the allocator back (where the budget it has is this share's)."""
        if self._unset is not None:
            self._unset()
        self._unset, self.collects_above = None, None


def set_by_a_budget() -> bool:
    """Whether a budget sets some device's allocator now."""
    return bool(_SET_BY)


def _unset(probe: Any, key: str, token: int) -> None:
    if _SET_BY.get(key) == token:
        del _SET_BY[key]
        probe.collect_above(None)
