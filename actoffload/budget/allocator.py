"""The caching allocator under a budget: a cap on what it may reserve, and the reserve that
plans leave for it.

A budget bounds the device memory PyTorch's caching allocator reserves during a step, which is
what runs out (docs/budgets.md, "What the budget counts"). The allocator is told so itself: once
a step has run, its reservations are capped at the budget (its per-process memory fraction).
Where a request would take it over, it gives its cached blocks back to the device and tries
again, rather than growing: what it caches can then never take a step over the budget, however
the step's sizes vary (sequence lengths, an evaluation forward between steps). The first step of
all runs uncapped: it runs the plan that needs the least memory, and if even that does not fit,
:class:`~.search.BudgetTooSmall` says so at the next step, where a cap would have said it as an
out-of-memory error from inside the forward. A budget no plan reaches runs uncapped too (its
steps go over it, as ``BudgetTooSmall`` said). The cap is lifted when this object goes.

Plans are modelled in allocated bytes, which the engine follows group by group. What a capped
allocator cannot give back is its **fragments**: the free parts of segments that hold live
blocks (``inactive_split_bytes``). A plan fits where its allocated peak and the fragments fit;
the most fragments seen in any step is the **reserve**, added to every plan's peak before it is
judged against the budget. Each workload's controller shares one: they share one allocator.

Example::

    share = AllocatorShare()
    share.step_begins(probe, budget, reachable=True)                    # caps from the 2nd step
    ...                                                                  # the step
    share.step_ended(probe)                                              # measure its fragments
    plan_peak + share.bytes <= budget                                   # what fits
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

# device -> the share whose cap the allocator has now (a token: ids are reused): of two shares
# on one device, each caps the allocator at its own steps, and only the latest lifts it
_CAPPED_BY: dict[str, int] = {}
_TOKENS = itertools.count()


class AllocatorShare:
    """The cap and the reserve for one device's caching allocator (see the module)."""

    def __init__(self) -> None:
        self.bytes = 0  # the reserve: the most fragments a step left the allocator unable to give back
        self.trims = 0  # times the cache was given back (before the first step)
        self.cap: int | None = None  # what the allocator may reserve now (None: not capped by us)
        self.flushes = 0  # times a capped allocator gave its cache back to serve a request
        self._steps = 0
        self._flushes_at_start: int | None = None
        self._token = next(_TOKENS)
        self._lift: Any = None  # gives the allocator its own limit back (weakref.finalize)

    def step_begins(self, probe: Any, budget: int, reachable: bool) -> None:
        """A step begins: cap the allocator at ``budget`` where a plan reaches it (``reachable``)
        and a step ran before; before the first step, give back a cache that is not the loop's
        (a loader's blocks)."""
        if not probe.cuda:
            return
        if self._steps == 0:
            probe.trim()
            self.trims += 1
        elif reachable:
            self._set_cap(probe, budget)
        else:
            self.lift()
        self._steps += 1
        self._flushes_at_start = probe.flushes()

    def step_ended(self, probe: Any) -> bool:
        """A step's backward pass ended (a step of several backward passes calls this at
        each): whether the reserve grew."""
        if not probe.cuda or self._flushes_at_start is None:
            return False
        now = probe.flushes()
        self.flushes += now - self._flushes_at_start
        self._flushes_at_start = now
        fragments = probe.fragments_peak()
        if fragments <= self.bytes:
            return False
        self.bytes = fragments
        return True

    def _set_cap(self, probe: Any, budget: int) -> None:
        key = str(probe.device)
        if self.cap == budget and _CAPPED_BY.get(key) == self._token:
            return
        probe.limit(budget)
        _CAPPED_BY[key] = self._token
        self.cap = budget
        if self._lift is None:
            self._lift = weakref.finalize(self, _lift, probe, key, self._token)

    def lift(self) -> None:
        """Give the allocator its own limit back (where the cap it has is this share's)."""
        if self._lift is not None:
            self._lift()
        self._lift, self.cap = None, None


def capped() -> bool:
    """Whether a budget caps some device's allocator now."""
    return bool(_CAPPED_BY)


def _lift(probe: Any, key: str, token: int) -> None:
    if _CAPPED_BY.get(key) == token:
        del _CAPPED_BY[key]
        probe.limit(None)
