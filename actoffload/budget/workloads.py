"""A plan per workload: each step runs the plan made for its own signature, chosen when its
first group opens, before it saves anything (docs/budgets.md, "A plan per workload").

A step's **signature** is the shapes, dtypes and devices of the tensors the first wrapped
module is called with (``ao.wrap`` hands them to the plan: :meth:`~actoffload.plans.Plan.step_inputs`),
the number of places its groups take in the plan (``k`` micro-batches' forwards before one
backward open ``k`` times one forward's groups; the count a signature's recent steps opened
most is expected) and what is allocated when it begins (within the base tolerance,
:func:`~.tolerances.base_tolerance`). Each workload has its own controller
(:class:`~.controller.BudgetController`: its profile, plans, measurements and state), kept
for the :data:`CAPACITY` workloads used last; those dropped are **parked** (the :data:`PARKED`
dropped last), neither searched nor predicted from, and taken back when a step of their signature
comes again, their profile (or first profiling step) and plan as they left them: more
signatures than :data:`CAPACITY` taking turns would otherwise each begin again at every turn,
and one whose prediction fits no plan would profile at every turn and never finish.

A signature seen before runs its controller's plan from its first group. One never seen gets a
new controller: its plan is predicted from a profiled workload of the same model
(:mod:`~.predict`), at its length bucket's tokens (:mod:`~.buckets`: the lengths of a bucket share
one prediction and its search), where a predicted plan fits the budget, else it profiles at once,
running the plan that needs the least memory. With no profile of the model measured yet, or
where it has more tokens than every one measured, a workload's first profiling step alone
becomes its profile as another signature's step begins.
A predicted workload is not profiled: the plan it runs is measured like any other (its peak
checked, its time taken), which is what profiling it would have bought, without the profiling
plan's slow steps.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from . import predict
from .buckets import SharedPredictions, bucket
from .controller import BudgetController, State
from .probe import Probe
from .reserve import AllocatorReserve
from .tolerances import MiB, base_tolerance

CAPACITY = 8  # workloads kept (least recently used dropped): a few sequence-length buckets, train and eval
PARKED = 4 * CAPACITY  # workloads dropped from those kept, found again when their signature recurs
RECENT = 8  # steps of a signature whose group counts say how many groups its next step opens
CONTEXT = 3  # the most of their latest counts whose continuation is looked for (Workloads._expected)


class Signature(NamedTuple):
    """What a step's first wrapped module is called with: ``inputs``, per tensor argument (in
    order, then keyword arguments by name) its ``(name, shape, dtype, device)``, ``None`` where
    no wrapped module began the step (groups opened by hand); ``tokens``: the product of the
    first tensor's dimensions but the last (:func:`~.predict.tokens`); ``mode``: what else
    shapes its saves (:func:`mode_of`)."""

    inputs: tuple[tuple[str, tuple[int, ...], str, str], ...] | None
    tokens: int | None
    mode: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.inputs is None:
            return "unknown"
        called = ", ".join(f"{name + '=' if name else ''}{list(shape)} {dtype} {device}"
                           for name, shape, dtype, device in self.inputs)
        return f"{called} ({', '.join(self.mode)})" if self.mode else called


UNKNOWN = Signature(None, None)


def mode_of(module: torch.nn.Module | None, device_type: str) -> tuple[str, ...]:
    """What shapes a step's saves besides the shapes of its inputs: ``"eval"`` where the module
    it begins with runs in evaluation mode (dropout saves no mask), and autocast's dtype where
    autocast is on (its casts save copies). Steps of one shape in two modes (an adversarial
    perturbation's forward in evaluation mode before each training step) are two workloads,
    each with its own plan, not one whose saves keep changing.

    >>> mode_of(torch.nn.Linear(2, 2).eval(), "cpu")
    ('eval',)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     mode_of(torch.nn.Linear(2, 2), "cpu")
    ('autocast torch.bfloat16',)
    """
    mode = []
    if module is not None and not module.training:
        mode.append("eval")
    if torch.is_autocast_enabled(device_type):
        mode.append(f"autocast {torch.get_autocast_dtype(device_type)}")
    return tuple(mode)


def signature_of(args: tuple[Any, ...], kwargs: dict[str, Any], mode: tuple[str, ...] = ()) -> Signature:
    """The :class:`Signature` of a call with ``args`` and ``kwargs``.

    Tensors inside tuples, lists and dicts count too, named by where they are (a layer called
    with ``(hidden, mask)``, or a dict of states, has its lengths in them).

    >>> s = signature_of((torch.zeros(2, 8, 4),), {"mask": torch.ones(8, 8, dtype=torch.bool)})
    >>> s.tokens, str(s)
    (16, '[2, 8, 4] torch.float32 cpu, mask=[8, 8] torch.bool cpu')
    >>> str(signature_of(((torch.zeros(2, 8, 4), None),), {"state": {"h": torch.zeros(3)}}))
    "[0]=[2, 8, 4] torch.float32 cpu, state['h']=[3] torch.float32 cpu"
    """
    named = [("", a) for a in args] + sorted(kwargs.items())
    tensors = [(where, t) for name, value in named for where, t in _tensors_in(name, value)]
    inputs = tuple((where, tuple(t.shape), str(t.dtype), str(t.device)) for where, t in tensors)
    # a leaf that requires grad stays where it is (docs/semantics.md, "parameter"): called with
    # one (a gradient penalty's inputs), a step saves less than with the same shapes otherwise
    held = [f"{where or f'[{i}]'} a leaf requiring grad" for i, (where, t) in enumerate(tensors)
            if t.is_leaf and t.requires_grad]
    return Signature(inputs, predict.tokens([shape for _, shape, _, _ in inputs]), mode + tuple(held))


def _tensors_in(name: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in ``value``, each named by where it is: inside tuples and lists by index,
    dicts by key, and any other type registered with pytree by its place among its leaves
    (pytree may not know its keys)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(f"{name}[{key!r}]", item)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors_in(f"{name}[{i}]", item)
    else:
        leaves = tree_flatten(value)[0]
        if len(leaves) != 1 or leaves[0] is not value:  # (not a leaf itself)
            for i, item in enumerate(leaves):
                yield from _tensors_in(f"{name}.{i}", item)


def _same_model(a: Signature, b: Signature) -> bool:
    """Two signatures one could be predicted from the other: the same tensors (names, dtypes,
    devices and dimensions) in the same mode, other tokens; the first of the same features (its
    last dimension: the model's width), and each other one too, or ending with the length (the
    first's last dimension but one) in both: a transformers layer's ``position_ids``
    (``[1, L]``) and eager mask (``[B, 1, L, L]``) do. (A last dimension that varies apart
    from the length, a cross-attention mask's, is not scaled by the tokens.)

    >>> def sig(length, width=64, memory=None):
    ...     return signature_of((torch.zeros(2, length, width),),
    ...                         {"position_ids": torch.zeros(1, length if memory is None else memory)})
    >>> _same_model(sig(128), sig(96)), _same_model(sig(128), sig(96, width=32)), _same_model(sig(128), sig(96, memory=9))
    (True, False, False)
    """
    if (a.inputs is None or b.inputs is None or len(a.inputs) != len(b.inputs) or not a.tokens or not b.tokens
            or a.mode != b.mode or a.inputs[0][1][-1:] != b.inputs[0][1][-1:]):
        return False
    length_a, length_b = a.inputs[0][1][-2:-1], b.inputs[0][1][-2:-1]
    return all(x[0] == y[0] and x[2:] == y[2:] and len(x[1]) == len(y[1])
               and (x[1][-1:] == y[1][-1:] or (x[1][-1:] == length_a and y[1][-1:] == length_b))
               for x, y in zip(a.inputs, b.inputs))


def _measured(e: "Workload") -> bool:
    """Whether ``e``'s controller plans from a profile its own steps measured (not predicted)."""
    return e.controller.profile is not None and not e.controller.predicted


def _least_worth(workloads: list["Workload"]) -> "Workload":
    """The workload to let go first: the least recently used (``workloads`` are in that order)
    of the predicted ones, else of those profiling, else of those measured."""
    return min(workloads, key=lambda e: (_measured(e), e.controller.profile is None))


@dataclass
class Workload:
    """One workload: its signature, its controller, the groups its steps open (``None`` before
    its first), the base it was made on, and the workload its plan was predicted from."""

    signature: Signature
    controller: BudgetController
    groups: int | None
    base: int
    predicted_from: Signature | None = None
    steps: int = 0

    def base_matches(self, base: int, tolerance: int) -> bool:
        """Whether a step beginning on ``base`` bytes is this workload's: its profile's base (its
        latest step's while it profiles, or where its profile was predicted) within ``tolerance``."""
        c = self.controller
        return abs(base - (self.base if c.profile is None or c.predicted else c.profile.base)) <= tolerance


class Workloads:
    """The controllers of the workloads seen, one a step: :meth:`begin` picks (or makes) the
    step's, by its signature; :attr:`controller` is the one the latest step ran."""

    def __init__(self, budget: int, device: torch.device, probe: Probe | None = None, capacity: int = CAPACITY):
        self.budget, self.device = budget, device
        self.probe = Probe(device) if probe is None else probe
        self.reserve = AllocatorReserve()  # one allocator: one reserve for every workload
        self.capacity = capacity
        self._host_cap: int | None = None  # the most host memory a plan may hold (host_cap), for every workload
        self._first: BudgetController | None = BudgetController(budget, device, self.probe, self.reserve)
        self._entries: list[Workload] = []  # least recently used first
        self._parked: list[Workload] = []  # dropped from _entries, the least recently dropped first
        self.current: Workload | None = None
        self._recent: dict[Signature, collections.deque[int]] = {}  # groups its latest steps opened
        self._open = False  # the current workload's step began and was not closed
        self._state_before = State.PROFILING
        self._planning_dropped = 0.0  # planning seconds of workloads no longer kept
        self._planning_by_dropped: collections.defaultdict[str, float] = collections.defaultdict(float)  # ... by what
        self._background_dropped = 0.0  # and their planning process's seconds
        self.shared = SharedPredictions()  # predictions by length bucket, and their searches

    @property
    def controller(self) -> BudgetController:
        """The controller of the latest step (before the first: the one it will get)."""
        if self.current is not None:
            return self.current.controller
        assert self._first is not None
        return self._first

    @property
    def workloads(self) -> tuple[Workload, ...]:
        """The workloads kept, least recently used first."""
        return tuple(self._entries)

    @property
    def parked(self) -> tuple[Workload, ...]:
        """The workloads parked, the least recently parked first."""
        return tuple(self._parked)

    def _every(self) -> list[Workload]:
        """The workloads parked, then those kept (each in its order)."""
        return self._parked + self._entries

    def begin(self, signature: Signature, may_raise: bool = True) -> BudgetController:
        """A step of ``signature`` begins: its workload's controller, whose step has begun (may
        raise :class:`~.search.BudgetTooSmall`, once per workload, where ``may_raise``)."""
        self._close()
        base = self.probe.allocated()
        entry = self._find(signature, base)
        if entry is None:
            entry = self._new(signature, base)
        (self._parked if entry in self._parked else self._entries).remove(entry)
        self._entries.append(entry)
        self._evict(entry)
        self._forget()
        self.current = entry
        entry.base = base
        self._state_before = entry.controller.state
        self.reserve.step_of(signature.tokens)
        entry.controller.step_begins(may_raise)  # may raise: the step is begun again at its next group
        entry.steps += 1
        self._open = True
        return entry.controller

    def _close(self) -> None:
        """The latest step is over (a new one begins): the groups it opened."""
        e = self.current
        if e is None or not self._open:
            return
        self._open = False
        e.controller.finish_step()  # a profile finished now lets the next workload be predicted
        displaced = e.controller.take_displaced()
        if displaced is not None:
            self._seed(e.signature, *displaced)
        if e.predicted_from is not None and not e.controller.predicted:  # its bytes were off: profiled
            e.predicted_from = None
        n, c = e.controller.step_groups, e.controller
        if c.unfinished_step:
            # a forward cut short (a batch that raised and was skipped) opened fewer groups than
            # its workload's steps do: counted, such batches every other step would make the
            # workload expect that many and begin a new one at each (profiling for good)
            return
        recent = self._recent.setdefault(e.signature, collections.deque(maxlen=RECENT))
        recent.append(n)
        if c.profile is None:  # profiling: the latest step's groups are the profile's
            e.groups = n
            return
        e.groups = len(c.profile.groups)
        if n != e.groups:
            # more (or fewer) groups than its plan: another workload (an evaluation forward with
            # gradients before the backward, a micro-batch more), planned apart by its signature
            c.undo_replan(self._state_before)

    def _seed(self, signature: Signature, profile: Any, peak: int | None, steps: tuple[Any, ...]) -> None:
        """A workload of ``signature`` on the base of a step another one took while profiling and
        then let go (the first micro-batch of an optimizer step, which begins with no gradients,
        taken by the next micro-batches' workload): planned from that step, so that its next step
        runs a plan rather than profiling again from the start. Not where one on that base is kept."""
        tolerance = base_tolerance(self.budget)
        if any(e.signature == signature and e.base_matches(profile.base, tolerance)
               for e in self._every()):
            return
        entry = Workload(signature, self._controller(), len(profile.groups), profile.base)
        self._entries.insert(0, entry)  # the least recently used: its step came before the current one's
        entry.controller.adopt_displaced(profile, peak, steps)

    def _forget(self) -> None:
        while len(self._recent) > 4 * self.capacity:
            del self._recent[next(iter(self._recent))]

    def _expected(self, signature: Signature) -> int | None:
        """The groups the next step of ``signature`` will open; ``None`` for a signature not seen.

        Its recent steps' counts continued: what most often followed their latest ``k`` counts
        (``k`` from ``CONTEXT`` down to 1, the longest that came before with one answer), so that
        steps taking turns (one forward, then two before a backward) each find their own
        workload; else the count they opened most (the latest among equals). Predicting the
        latest count in turns would give each step the other's plan, the heavier one's running
        its groups past the plan.

        >>> w = Workloads(1 << 30, torch.device("cpu"))
        >>> w._recent[UNKNOWN] = collections.deque([4, 8, 4, 8, 4], maxlen=RECENT)
        >>> w._expected(UNKNOWN)
        8
        """
        recent = self._recent.get(signature)
        if not recent:
            return None
        seen = list(recent)
        for k in range(min(CONTEXT, len(seen) - 1), 0, -1):
            context = seen[-k:]
            followers = collections.Counter(seen[i + k] for i in range(len(seen) - k) if seen[i:i + k] == context)
            ranked = followers.most_common(2)
            if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):
                return ranked[0][0]
        counts = collections.Counter(seen)
        return max(reversed(seen), key=lambda n: counts[n])

    def _find(self, signature: Signature, base: int) -> Workload | None:
        """The workload, kept or parked, a step of ``signature`` beginning on ``base`` bytes is:
        one of its base, else one still profiling (a kept one first)."""
        groups = self._expected(signature)
        tolerance = base_tolerance(self.budget)
        alike = [e for e in reversed(self._every())
                 if e.signature == signature and (groups is None or e.groups is None or e.groups == groups)]
        for e in alike:
            if e.base_matches(base, tolerance):
                return e
        # none on this base: one still profiling takes it (its profile is then the latest
        # step's, as when a first step has no optimizer state yet)
        return next((e for e in alike if e.controller.profile is None), None)

    @property
    def host_cap(self) -> int | None:
        """The most bytes a plan may hold in host memory (each controller's ``host_cap``)."""
        return self._host_cap

    @host_cap.setter
    def host_cap(self, cap: int | None) -> None:
        self._host_cap = cap
        for e in self._every():
            e.controller.host_cap = cap
        if self._first is not None:
            self._first.host_cap = cap

    def _controller(self) -> BudgetController:
        first, self._first = self._first, None
        c = first if first is not None else BudgetController(self.budget, self.device, self.probe, self.reserve)
        c.host_cap = self._host_cap
        return c

    def _new(self, signature: Signature, base: int) -> Workload:
        entry = Workload(signature, self._controller(), None, base)
        self._entries.append(entry)
        self._profile_partial(signature)  # (its search counted as the promoted workload's)
        with entry.controller.planning_time("predicting"):
            guess = self._prediction(signature, base)
        if guess is not None:
            profile, source, window, shares, bucket_share = guess
            if entry.controller.adopt_prediction(profile, window, shares, self.shared, bucket_share):
                entry.predicted_from, entry.groups = source, len(profile.groups)
        return entry

    def _profile_partial(self, signature: Signature) -> None:
        """Where no workload of ``signature``'s model has a measured profile to predict it from,
        or the latest that ran its first profiling step (and not yet its second) has more tokens
        than every one measured of as many groups, that one plans from that step alone
        (:meth:`~.controller.BudgetController.profile_from_first_step`): with lengths drawn from a
        continuous range, few recur, and each new one would otherwise profile in turn, running the
        least memory step after step; and a length longer than every one measured, predicted by
        scaling up (the bound's square: far more than the step saves), may fit no budget near
        checkpointing's where the same length scaled down from a longer one does (on an H200 the
        GPT-MoE at lengths of any multiple of 8, measured at 648 tokens, ran 16 of its 48 steps at
        checkpointing's peak on the profiling plan, the longer lengths in turn, once a 1024-token
        step had profiled: docs/budgets.md). With nothing measured, each new signature promotes
        the one before it: there is at most one such workload to promote."""
        model = self._same_model(signature)
        pick = next((e for e in reversed(model) if e.controller.has_first_step), None)
        if pick is None:
            return
        measured = [e for e in model if _measured(e)]
        # longer than those measured of its own groups, if any is measured: a step of other groups
        # (an evaluation forward with gradients before a training step's, or a forward that raised
        # and ran on into the next step's groups) is another workload, not a longer length
        alike = [e.signature.tokens or 0 for e in measured if e.groups == pick.groups]
        if measured and (not alike or (pick.signature.tokens or 0) <= max(alike)):
            return
        if pick.controller.profile_from_first_step():
            pick.groups = len(pick.controller.profile.groups)  # type: ignore[union-attr]

    def _same_model(self, signature: Signature) -> list[Workload]:
        """The workloads kept that ``signature`` could be predicted from but for a profile: the
        same model at other tokens, expected to open as many groups."""
        groups = self._expected(signature)
        return [e for e in self._entries if _same_model(e.signature, signature) and e.signature.tokens != signature.tokens
                and (groups is None or e.groups is None or e.groups == groups)]

    def _prediction(self, signature: Signature,
                    base: int) -> tuple[Any, Signature, tuple[int, int] | None, tuple[float, ...], float] | None:
        """A profile predicted for ``signature`` from the profiled workloads of the same model
        (the nearest with more tokens, else the nearest with fewer; a second one to fit each
        group's bytes), the signature it came from, the copy window that workload's plan
        settled on (``None`` while it has not: every window is searched), and per group the least
        share of its predicted bytes that is still the workload (:func:`~.predict.least_shares`),
        and that share for every group from the bucket alone. The profile is predicted at the
        tokens of the signature's bucket (:mod:`~.buckets`), or of the nearest profiled workload
        with more tokens where those are fewer: the same object for every signature of the
        bucket on the same base, so that they share its search."""
        t = signature.tokens
        refs = [e for e in self._same_model(signature) if _measured(e)]
        if not refs or t is None:
            return None
        larger = [e for e in refs if (e.signature.tokens or 0) > t]
        ref = (min(larger, key=lambda e: e.signature.tokens or 0) if larger
               else max(refs, key=lambda e: e.signature.tokens or 0))
        assert ref.controller.profile is not None and ref.signature.tokens is not None
        others = [e for e in refs if e is not ref and e.signature.tokens != ref.signature.tokens
                  and predict.same_groups(ref.controller.profile, e.controller.profile)]  # type: ignore[arg-type]
        other = None
        if others:
            o = min(others, key=lambda e: abs((e.signature.tokens or 0) - t))
            assert o.controller.profile is not None and o.signature.tokens is not None
            other = (o.controller.profile, o.signature.tokens)
        plan = ref.controller.plan
        window = (plan.max_inflight, plan.prefetch) if plan is not None and ref.controller.settled else None
        profile, t_ref = ref.controller.profile, ref.signature.tokens
        top = min(bucket(t), t_ref) if t_ref >= t else bucket(t)
        # what the step allocates as it begins, to the MiB above (the bucket's lengths differ in
        # their inputs, a few KiB): one profile for them all
        base = -(-max(base, profile.base) // MiB) * MiB
        key = (ref.signature, None if other is None else other[1], top, base)
        sources = (profile,) if other is None else (profile, other[0])
        shared, top_shares = self.shared.prediction(key, sources, lambda: (
            predict.predicted(profile, t_ref, top, base, other), predict.least_shares(profile, t_ref, top, other)))
        # (the bucket's share: its bytes at fewer tokens than the bucket's, down to the square of the ratio)
        bucket_share = (t / top) ** 2
        return shared, ref.signature, window, tuple(s * bucket_share for s in top_shares), bucket_share

    def _evict(self, keep: Workload) -> None:
        """Park the least recently used workloads beyond the capacity: predicted ones first (a
        prediction is made again cheaply), then those profiling, those with a measured profile
        last: they are what new signatures are predicted from (lengths drawn from a continuous
        range make a new workload nearly every step, which would otherwise push out the one
        profile within a few steps, and the next length would profile again). Beyond
        :data:`PARKED` parked, one is dropped in the same order."""
        while len(self._entries) > self.capacity:
            old = _least_worth([e for e in self._entries if e is not keep])
            self._entries.remove(old)
            self.reserve.bind(old.controller, False)  # (a parked workload runs no step)
            self._parked.append(old)
        while len(self._parked) > PARKED:
            old = _least_worth(self._parked)
            self._parked.remove(old)
            self._planning_dropped += old.controller.planning_s
            for what, seconds in old.controller.planning_by.items():
                self._planning_by_dropped[what] += seconds
            self._background_dropped += old.controller.background_planning_s

    @property
    def planning_s(self) -> float:
        """Host seconds spent making and choosing plans, every workload's, all told."""
        return self._planning_dropped + sum(e.controller.planning_s for e in self._every())

    @property
    def planning_by(self) -> dict[str, float]:
        """:attr:`planning_s` by what it was spent on (the controllers' ``planning_by``)."""
        total = collections.defaultdict(float, self._planning_by_dropped)
        for e in self._every():
            for what, seconds in e.controller.planning_by.items():
                total[what] += seconds
        return dict(total)

    @property
    def background_planning_s(self) -> float:
        """Seconds the planning process searched for every workload, all told (:mod:`~.worker`)."""
        return self._background_dropped + sum(e.controller.background_planning_s for e in self._every())

    def describe(self) -> dict[str, Any]:
        """The latest step's workload, for ``stats()["plan"]["workload"]``."""
        e = self.current
        if e is None:
            return {"signature": None, "groups": None, "predicted_from": None, "kept": len(self._entries),
                    "parked": len(self._parked), "planning_s_all": self.planning_s, "planning_by_all": self.planning_by,
                    "background_planning_s_all": self.background_planning_s}
        return {"signature": str(e.signature), "tokens": e.signature.tokens, "groups": e.groups,
                "predicted_from": None if e.predicted_from is None else str(e.predicted_from),
                "kept": len(self._entries), "parked": len(self._parked), "planning_s_all": self.planning_s,
                "planning_by_all": self.planning_by, "background_planning_s_all": self.background_planning_s}
