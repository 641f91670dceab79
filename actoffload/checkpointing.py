"""Groups run under activation checkpointing (a plan recomputes them): the contexts handed
to ``torch.utils.checkpoint``, the version check before each recomputation (R6), and what
the checkpointed forward would have saved, for plans that size what a group moves."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, ContextManager, Iterator

import torch

from . import compat, marks, multibuffer, policy, selective
from .records import Group
from .selective import OpMeter


def modified_error(group: Group, shape: Any, saved: int, now: int) -> RuntimeError:
    if group.wrote_inputs:
        return RuntimeError(
            f"the module of offload group {group.name!r} wrote a tensor it was called with (shape {list(shape)}) "
            "in place in its forward, after the library saved it to recompute the module in backward (fast's "
            "warm-up, or a memory_budget's plan): the recomputation would not read what the forward read (R6). "
            "This module is not recomputed again from the next step on; for this step, write out of place "
            "(x = x * 2, not x.mul_(2)), or pass warmup='offload' and no memory_budget."
        )
    return RuntimeError(
        f"one of the tensors saved for backward in offload group {group.name!r} (shape {list(shape)}) "
        f"was modified by an in-place operation after it was saved: version {saved} at save, {now} now "
        "(R6). Use an out-of-place operation, or clone the tensor before modifying it."
    )


def contexts(group: Group, see: Callable[[torch.Tensor], None] | None,
             recomputation: Callable[[], ContextManager[None]], meter: OpMeter | None = None,
             store: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None) -> tuple[Any, Any]:
    """``context_fn`` for the checkpoint a plan runs ``group`` under: the forward's saves go
    on to checkpoint's hooks, shown to ``see`` on the way (``None``: nothing watches); each
    recomputation in backward runs inside ``recomputation()``, after the version check. A
    ``group.selective`` keeps its costly ops' outputs (its attention's only, where
    ``group.selective_attention``) and recomputes the rest
    (:func:`actoffload.selective.contexts`), each one stored by ``store``'s pack and unpack (the
    group's own: it moves them as it moves its saves); a ``meter`` measures those ops (profiling).

    Checkpoint drops what the forward saved and recomputes it, so an in-place write to a
    saved tensor after its save would go unnoticed where autograd raises (R6): each save's
    version is checked before each recomputation (not after: the recomputation may itself
    write what it saves again).
    """
    seen: list[tuple[torch.Tensor, int, torch.Size]] = []
    modes = []
    if group.selective:
        keep, take = store if store is not None else (selective.same, selective.same)
        modes.append(selective.contexts(keep, take, group.selective_calls, group.selective_attention))
    if meter is not None:
        modes.append((meter.forward(), meter.recomputation()))
    # the guard's own ops (a detach, a storage swap) are none of the forward's: not shown to its modes
    guarded = _outside_modes(_guarded) if modes else _guarded

    # (not traced: a compiled submodule's saves reach these hooks with Dynamo's callback set, and
    # it compiled them, guarding on storage keys, until it gave up recompiling)
    if see is None:
        @compat.not_traced
        def saw(t: torch.Tensor) -> None:
            seen.append(guarded(group, t))
    else:
        @compat.not_traced
        def saw(t: torch.Tensor) -> None:
            see(t)
            seen.append(guarded(group, t))

    recomputing = [r for _, r in modes]

    @contextlib.contextmanager
    def checked() -> Iterator[None]:
        for guard, version, shape in seen:
            if guard._version != version:
                raise modified_error(group, shape, version, guard._version)
        with recomputation(), _together(*recomputing):
            yield

    return _together(_SeeingSaves(saw), *(f for f, _ in modes)), _EachTime(checked)


def _outside_modes(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` run with the Python dispatch modes that are active left out: a saved-tensor hook
    runs inside the forward's modes (a selective group's), and each op of its own went through
    them, costing about ten microseconds of Python each, and showing them ops the forward never made."""
    def outside(*args: Any) -> Any:
        with compat.without_dispatch_modes():
            return f(*args)
    return outside


def _guarded(group: Group, t: torch.Tensor) -> tuple[torch.Tensor, int, torch.Size]:
    if t.is_nested:
        raise RuntimeError(
            f"group {group.name!r} is being recomputed (fast's warm-up, or a memory_budget's plan), but "
            "its forward saves a nested tensor, which activation checkpointing cannot save. Use "
            "warmup='offload', or open this group with `with off.group(...)` so that no plan recomputes it."
        )
    try:
        guard = compat.version_guard(t)
    except RuntimeError:  # a kind whose data cannot be swapped out (sparse): hold it whole
        guard = t.detach()
    return guard, t._version, t.shape


class WouldSave:
    """What a recomputed group's forward would have saved, as the policy's facts: a plan
    that sizes what the group will move once it stops recomputing collects them.

    Checkpoint frees what the forward saves as it goes, so a storage key can come back as a
    different storage within one forward: such a key gets a fresh one no real storage has;
    and the marks on a storage are read while it lives (:meth:`flags_of`).
    """

    _fresh = itertools.count(-1, -1)

    def __init__(self, device: torch.device):
        self.device = device
        self.facts: list[policy.SavedFact] = []
        self._storages: dict[int, tuple[Any, int]] = {}  # storage key -> (weak reference, key its facts get)
        self._flags: dict[int, int] = {}  # key its facts get -> the marks on it when seen

    def see(self, t: torch.Tensor) -> None:
        if multibuffer.is_multibuffer(t):  # its buffers, as the pack hook would see them
            for b in multibuffer.split(t).buffers:
                if b is not None:
                    self.see(b)
            return
        fact = policy.fact_of(t, self.device)
        if fact.key is not None:
            live = fact.key
            ref, key = self._storages.get(live, (None, live))
            if ref is None or ref.expired():
                if ref is not None:  # the key was freed and reused: not an alias
                    key = next(self._fresh)
                self._storages[live] = (compat.storage_weakref(t), key)
            fact = dataclasses.replace(fact, key=key)
            self._flags[key] = self._flags.get(key, 0) | marks.flags_of(live)
        self.facts.append(fact)

    def plan(self, min_offload_bytes: int, policy_name: str,
             moved_earlier: Callable[[int, list[policy.SavedFact]], bool] | None = None) -> policy.SavePlan:
        """What the group would move and keep, were it not recomputed, as its commit would
        decide: judged by the marks its storages had when saved (checkpoint has freed them)."""
        return policy.plan_facts(self.facts, min_offload_bytes=min_offload_bytes, policy=policy_name,
                                 committed=True, moved_earlier=moved_earlier,
                                 flags_of=lambda key: self._flags.get(key, 0))

    def storage_refs(self) -> dict[int, Any]:
        """The key each fact got -> a weak reference to that storage."""
        return {key: ref for ref, key in self._storages.values()}


class _SeeingSaves:
    """Saved-tensor hooks that show each save to ``see`` and hand it on to the hooks that were
    innermost when entered (checkpoint enters its own, then this one)."""

    def __init__(self, see: Callable[[torch.Tensor], None]):
        self._see = see
        self._hooks: Any = None

    def __enter__(self) -> None:
        outer = compat.current_saved_tensors_hooks()
        assert outer is not None, "checkpoint installs its hooks before entering its context"
        outer_pack, outer_unpack = outer
        see = self._see  # not self: the hooks would hold themselves (below)

        @compat.not_traced  # (as saw above)
        def pack(t: torch.Tensor) -> Any:
            see(t)
            return outer_pack(t)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        # Let go of the hooks: checkpoint's pack hook holds its frame, and the frame the inputs
        # it saved. Held by a cycle, they lived until the garbage collector ran (after the
        # whole backward pass) instead of until the group's backward was done.
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)


class _EachTime:
    """A context made anew at every entry: checkpoint enters its recomputation context once
    per recomputation, and a graph kept for a second backward recomputes again."""

    def __init__(self, make: Callable[[], ContextManager[Any]]):
        self._make = make
        self._entered: list[ContextManager[Any]] = []

    def __enter__(self) -> Any:
        context = self._make()
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._entered.pop().__exit__(*exc)



_NOTHING = contextlib.nullcontext()


def _together(*contexts: ContextManager[Any]) -> ContextManager[Any]:
    """``contexts`` entered as one, in order; the one itself where there is one (most groups'
    checkpoints: no stack to build at each save-heavy forward and each recomputation)."""
    if len(contexts) == 1:
        return contexts[0]
    return _Entered(*contexts) if contexts else _NOTHING


class _Entered:
    """Several contexts entered as one, in order (left in reverse)."""

    def __init__(self, *contexts: ContextManager[Any]):
        self._contexts = contexts
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for c in self._contexts:
                stack.enter_context(c)
            self._stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> Any:
        stack, self._stack = self._stack, None
        assert stack is not None
        return stack.__exit__(*exc)
