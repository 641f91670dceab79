"""The allocator's reserve: what PyTorch's caching allocator holds from the device beyond what
it has handed out, during a step.

A budget bounds the device memory the allocator reserves during a step, which is what runs out
(docs/budgets.md, "What the budget counts"). Plans are modelled in allocated bytes, which the
engine can follow group by group; the allocator adds its rounding and the cached blocks a
step's requests could not reuse (freed blocks of other sizes, split blocks too small to serve).
That difference is measured, not modelled: after a step whose reserved peak grew beyond what
was reserved when it began (its cache did not serve it), its reserved peak less its allocated
peak. The most seen is the **reserve**, added to every plan's peak before it is judged against
the budget. A step its cache served says nothing new. A step on a cache that steps of more
tokens grew shows their idle blocks beyond its own small allocation (on the loop sweep's
decoder a 512-token step that added 8 MiB to the 2048-token steps' cache showed 2.47 GiB, and
at that reserve the 2048-token steps ran the least memory): it counts what it grew the cache
by, and that on top of the most the other steps showed, since the longer steps' plans fill the
cache up to what they are judged by and the shorter steps' growth must still fit beside them.
The cache a training loop builds over its first steps serves the steps after (a cache warmed by
every length serves them all), so it is kept: emptying it would make the next steps build it
again, each growing it its own way.

It is given back to the device (``torch.cuda.empty_cache``) only where what it holds is not the
loop's: before the first step (a loader's blocks), and before a step that begins with more
reserved than the last step's peak (beyond the base tolerance: something between the steps grew
it, an evaluation forward say), so that no such idle blocks are counted into the reserve; and at
the end of a step over the budget when the plan changes, so that the new plan's blocks are made
for it; and before a step that outgrows a cache shorter steps built
(:meth:`AllocatorReserve.step_begins`'s ``needs``: its plan has not run on the cache, and were
the blocks that steps of fewer tokens added to it since it was given back of no use to it, the
plan, judged within the budget, would go over, or, over it by the model, could not stay within it
as on a cache of its own: on the GPT-MoE the first full-length step after a 768-token one had
grown the cache by 5.2 GiB reserved 12.40 GiB for 10.78 allocated, over 11.80, in every run;
blocks only steps as long or longer added serve the step, and a few MiB a short step added take
none over); before a workload's first profiling step, where steps of other lengths grew the
cache since it was given back, shorter or longer (it measures the reserve, which their idle
blocks would inflate for every plan after; its second step runs on the cache as it stands, since
its times are the profile's, and where other lengths grew that cache what it reserves beyond its
allocation is not counted); and
before a step whose plan is judged within the budget (or is being profiled), where
the cache is over it: another workload's step that cannot reach the budget left it so (else
every later step, however small, would reserve what that one did), or a cache that served the
plan's steps over the budget, which say nothing of its share (else it would go on fitting as
judged and running over). Where the plan runs over the budget by the model (no plan reaches
it; the margins rule out every plan; a forced plan), a cache over the budget is given back
too until the plan has gone over on a cache given back just before it (:attr:`fresh`): the
cache other workloads' steps built may be what takes it over (on the GPT-MoE the least-memory
plan reserved 6.40 GiB on its own cache and 8.93 on one that steps of other lengths had
grown), and once its own cache is over as well, emptying it at every step would cost each
its allocations and change nothing. Each workload's controller shares one reserve: they
share one allocator.

From the first step on, the allocator also gives idle blocks back itself before it grows past
the budget (:mod:`~.reclaim`): a soft bound under the reserve's choices, for the steps whose
cache it misjudges.

The reserve judges plans not yet run on the cache as it stands. A plan that ran on it (no trim
since: :attr:`trims` unchanged) is judged by what it reserved there, or what the cache holds now
if more, where that is less (the controller's ``_served_now``): a cache only grows until it is
given back, so one that served a plan serves it again.

A workload whose plan stays within the budget only on the cache as it stands (the least memory
where no plan fits, or a plan judged within it only by what it reserved there) is **bound** to
that cache (:meth:`AllocatorReserve.bind`). What a step allocates and leaves allocated, and
where, shapes the blocks the next steps find: in gradient accumulation the first micro-batch's
backward lays out the gradients the others run beside. While a workload is bound, the others
keep the plan they ran last (the controller's ``_fastest``). On an H200 the loop sweep's decoder
at checkpointing's peak, its later micro-batches bound on a 7.90 GiB cache under 8.37, went over
in 59 of 80 micro-batches in two of three runs, from the micro-batch right after the first
micro-batch ran a plan keeping more than its profiled one (8.87 GiB reserved for the same 6.75
allocated; given back, the cache was rebuilt at 8.39-8.89); with the others keeping their plans,
in none (but a first step, before any workload was bound, in one run of three).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable

from .tolerances import base_tolerance


class AllocatorReserve:
    """The reserve for one device's caching allocator (see the module).

    Example::

        reserve = AllocatorReserve()
        reserve.step_begins(probe, budget)                                  # may empty the cache
        ...                                                                  # the step
        reserve.step_ended(probe, budget, allocated_peak, reserved_peak)    # measure
        plan_peak + reserve.bytes <= budget                                 # what fits
    """

    def __init__(self) -> None:
        self.bytes = 0  # the reserve: the own share and the growth on shared caches, summed
        self._own = 0  # the most a step that grew a cache of its own length reserved beyond its allocated peak
        self._growth_on_shared = 0  # the most a step grew a cache longer steps had grown
        self.trims = 0  # times the cache was given back
        # ... by why: "first" (before the first step), "grown between steps", "over the budget",
        # "outgrown" (as a step began: see step_begins), "plan changed" (after a step over the budget)
        self.trims_by: collections.Counter[str] = collections.Counter()
        self.cache_grew = False  # the latest step's reserved peak passed what was reserved as it began
        self._start: int | None = None  # reserved when the latest step began
        self._last_peak = 0  # the latest step's reserved peak
        self._over = False  # the latest step's reserved peak is over the budget
        self._trimmed = False  # the cache was given back since the latest step's peak was read
        self.fresh = False  # the latest step began on a cache given back just before it
        self._tokens: int | None = None  # the tokens of the step beginning or running (None: not known)
        # bytes the cache grew by since it was given back, by the tokens of the steps that grew it
        self._growth: collections.Counter[int] = collections.Counter()
        self._grown_this_step = 0  # bytes the latest step grew the cache by, so far
        self._uncounted = False  # the latest step's share is not counted (step_begins)
        self._shared = False  # the latest step began on a cache steps of more tokens grew
        self._bound: weakref.WeakSet[Any] = weakref.WeakSet()  # workloads bound to the cache (bind)
        self.reclaim: str | None = None  # how the allocator was told the budget (:mod:`~.reclaim`), at the first step

    def bind(self, workload: Any, bound: bool) -> None:
        """Whether ``workload`` (its controller) is bound to the cache: its plan stays within the
        budget only on the cache as it stands (see the module). Dropped with the workload."""
        if bound:
            self._bound.add(workload)
        else:
            self._bound.discard(workload)

    def is_bound(self, workload: Any) -> bool:
        """Whether ``workload`` is bound to the cache."""
        return workload in self._bound

    def bound_besides(self, workload: Any) -> bool:
        """Whether a workload other than ``workload`` is bound to the cache: ``workload`` then
        keeps the plan it ran (a plan new to the cache may take the bound one over the budget)."""
        return any(w is not workload for w in self._bound)

    def step_of(self, tokens: int | None) -> None:
        """The step about to begin has this many tokens (its signature's; None: not known)."""
        self._tokens = tokens

    def step_begins(self, probe: Any, budget: int, reachable: Callable[[], bool] = lambda: True,
                    needs: Callable[[], int | None] = lambda: None, profiling: int = 0) -> None:
        """A step begins: give back a cache that is not the loop's, or over the budget where the
        step's plan may be within it on a cache of its own (``reachable()``, asked only then: see
        the module), or one shorter steps built that the step outgrows (``needs()``: the reserved
        peak the plan is judged by, bytes, where it has not run on the cache and may stay within
        the budget on a cache of its own; else ``None``), or, for a workload's first profiling
        step (``profiling``: which of its profiling steps this is, 1 for the first; 0 for a step
        that does not profile), one that steps of other lengths grew; and note what is reserved now."""
        if not probe.cuda:
            return
        if self.reclaim is None:
            self.reclaim = probe.reclaim_above(budget, self)
        now = probe.reserved()
        if self.trims == 0:
            why: str | None = "first"
        elif now > self._last_peak + base_tolerance(budget):
            why = "grown between steps"
        elif now > budget and reachable():
            why = "over the budget"
        elif self._outgrown(budget, needs, profiling == 1):
            why = "outgrown"
        else:
            why = None
        self.fresh = why is not None
        if why is not None:
            self._give_back(probe, why)
        self._over = False
        self._start, self._grown_this_step = probe.reserved(), 0
        # a cache longer steps grew: its idle blocks are theirs (see step_ended)
        self._shared = self._others_grew(longer=True)
        # a later profiling step on a cache other lengths grew: its share is theirs as much as its own
        self._uncounted = profiling > 1 and self._others_grew()

    def step_ended(self, probe: Any, budget: int, allocated_peak: int, reserved_peak: int) -> bool:
        """A step's backward pass ended with these peaks so far (bytes; a step of several
        backward passes calls this at each): whether the reserve grew."""
        if self._start is None:
            return False
        self._last_peak, self._over, self._trimmed = reserved_peak, reserved_peak > budget, False
        self.cache_grew = reserved_peak > self._start
        # (where the cache was given back between its backward passes, what the later ones built
        # is not counted: the peak read is the whole step's, from before the give-back)
        grown = max(reserved_peak - self._start, 0)
        if self._tokens is not None and grown > self._grown_this_step:
            self._growth[self._tokens] += grown - self._grown_this_step
        self._grown_this_step = grown
        if reserved_peak <= self._start or self._uncounted:
            return False  # its cache served it, or its cache is not its own
        share = reserved_peak - allocated_peak
        if self._shared:
            # on blocks longer steps left, a step shows their idle blocks beyond its own small
            # allocation (a 512-token step adding 8 MiB to the 2048-token steps' cache, 2.47 GiB):
            # what it grew the cache by is what counts, and on top of the own share, since the
            # longer steps fill the cache to their plan's judged peak
            self._growth_on_shared = max(self._growth_on_shared, min(grown, max(share - self._own, 0)))
        else:
            self._own = max(self._own, share)
        if self._own + self._growth_on_shared <= self.bytes:
            return False  # it adds nothing
        self.bytes = self._own + self._growth_on_shared
        return True

    def plan_changed(self, probe: Any) -> None:
        """The controller chose another plan: after a step over the budget, give the cache back,
        so that the new plan's blocks are made for it."""
        if self._over and not self._trimmed:
            self._give_back(probe, "plan changed")

    def _outgrown(self, budget: int, needs: Callable[[], int | None], first_profiling: bool = False) -> bool:
        """Whether this step outgrows a cache shorter steps grew: were the blocks that steps of
        fewer tokens added since it was given back of no use to it (cut to their sizes, too small
        for this step's tensors, whatever this step allocates in all), the step would go over the
        budget: it needs what its plan is judged to reserve besides them. The GPT-MoE's first
        full-length step after a 768-token step had grown the profiling steps' cache by 5.2 GiB
        reserved 12.40 GiB for 10.78 allocated; a few MiB a short step added (the decoder's 512
        tokens, 8 MiB) take no step over and leave a longer step's cache as it is. A workload's
        first profiling step's need is not known, and what it reserves beyond its allocation is
        the reserve every plan after is judged with: any bytes steps of other lengths added are
        not its own."""
        if self._tokens is None:
            return False
        if first_profiling:
            return self._others_grew()
        shorter = sum(grown for tokens, grown in self._growth.items() if tokens < self._tokens)
        if not shorter:
            return False
        need = needs()
        return need is not None and need + shorter > budget

    def _others_grew(self, longer: bool = False) -> bool:
        """Whether steps of other tokens than this one's (``longer``: of more) grew the cache since
        it was given back."""
        return self._tokens is not None and any(grown for tokens, grown in self._growth.items()
                                                if (tokens > self._tokens if longer else tokens != self._tokens))

    def _give_back(self, probe: Any, why: str) -> None:
        probe.trim()
        self._growth.clear()
        self.trims += 1
        self.trims_by[why] += 1
        self._trimmed = True
