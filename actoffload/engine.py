"""Group lifecycle shared by every implementation: hooks, commit schedule, checks, stats.

An implementation (``ref``, ``fast``) subclasses :class:`actoffload.Offloader` and supplies
only *how bytes move*: :meth:`Engine._move_out` at commit, :meth:`Engine._device_bytes` at
unpack, and optionally :meth:`Engine._on_backward`. *What* moves is decided by
:func:`actoffload.policy.plan_group`; *when* a group commits (R4's keep_last rule), the
version check (R6), the multi-buffer protocol (R7), storages shared between groups (R5)
and lifetimes (R8) live here, once.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from functools import partial
from typing import Any, ClassVar, Generic, Iterator, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import compat, marks, multibuffer, policy
from .hostmem import HostMemory, HostMemoryError
from .observe import Observer
from .records import DelegatedHandle, Group, GroupState, Handle, Moved, MovedView, MultiHandle, SavedBuffer

GroupT = TypeVar("GroupT", bound=Group)
MovedT = TypeVar("MovedT", bound=Moved)

# .open: name of the group open on this thread (groups do not nest); .whole: it is a module
# run whole in place of its parts, which open no groups of their own
_local = threading.local()


def group_open() -> bool:
    """Whether an offload group is open on this thread (ops skip offload work otherwise)."""
    return getattr(_local, "open", None) is not None


def _modified_error(group: Group, shape: Any, saved: int, now: int) -> RuntimeError:
    return RuntimeError(
        f"one of the tensors saved for backward in offload group {group.name!r} (shape {list(shape)}) "
        f"was modified by an in-place operation after it was saved: version {saved} at save, {now} now "
        "(R6). Use an out-of-place operation, or clone the tensor before modifying it."
    )


class Engine(Generic[GroupT, MovedT]):
    """The lifecycle of groups; see :class:`actoffload.Offloader` for the public API."""

    impl: ClassVar[str] = "base"

    def __init__(self, device: torch.device, min_offload_bytes: int, policy_name: str, keep_last: int,
                 host: HostMemory):
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.policy = policy_name
        self.keep_last = keep_last
        self._host = host
        self._lock = threading.RLock()
        self._pending: list[weakref.ref[GroupT]] = []  # exited, not yet committed, in open order
        # stats() window: the groups opened since a backward pass last began
        self._window: dict[str, dict[str, Any]] = {}
        self._backward_began = False
        self._step_begun = False  # a step began and no group opened yet (a module's parts will)
        self._last_group: weakref.ref[GroupT] | None = None
        self._owner: int | None = None  # the thread whose forwards open groups
        self._observers: list[Observer] = []
        # spans moved out and still alive, by storage: a later group saving the same storage
        # reuses the copy (R5) instead of moving the bytes again
        self._moved_by_storage: dict[int, list[tuple[weakref.ref[Moved], StorageWeakRef]]] = {}

    # ------------------------------------------------------------------ implementation
    def _new_group(self, name: str, prev: GroupT | None, first_seq: int) -> GroupT:
        raise NotImplementedError

    def _new_moved(self, span: policy.Span, storage: torch.UntypedStorage) -> MovedT:
        raise NotImplementedError

    def _move_out(self, group: GroupT, moved: list[MovedT]) -> None:
        """Copy each span's ``source`` to host memory (setting ``host``); may finish later.
        Raises :class:`HostMemoryError`, having moved nothing, if host memory is short."""
        raise NotImplementedError

    def _device_bytes(self, group: GroupT, moved: MovedT) -> torch.Tensor:
        """The span's bytes back on the device, ready on the current stream.

        A flat uint8 tensor of at least ``moved.nbytes`` bytes starting at the span's
        first byte (a fresh buffer, or the original storage while it still lives).
        """
        raise NotImplementedError

    def _on_backward(self, group: GroupT) -> None:
        """Called at every unpack; implementations may start reloads here."""

    # Where a memory plan (fast's memory_budget) takes part; without one they do nothing.
    def _step_begins(self) -> None:
        """The first group of a step (the first after a backward pass began) is opening."""

    def _group_opens(self, group: GroupT) -> None:
        """``group`` is opening; a plan may set ``group.recompute``."""

    def _unhooked_next(self) -> bool:
        """Whether the group opening now keeps everything it saves and needs no tracking: it
        then opens no group at all (only a memory plan says so)."""
        return False

    def _whole_next(self, parts: int, inputs: int) -> bool:
        """Whether a plan runs the module opening now, whose ``parts`` are groups, as one
        recomputed group saving its ``inputs`` (bytes) instead (only a memory plan does)."""
        return False

    def _whole_closed(self, parts: int) -> None:
        """A module whose ``parts`` were the groups (not run whole) is done."""

    def _group_closing(self, group: GroupT) -> None:
        """``group``'s forward is over (before its commit)."""

    def _move_at_most(self, group: GroupT) -> int | None:
        """Bytes a memory plan lets this group move (``None``: no plan, no limit)."""
        return None

    def _committed(self, group: GroupT, plan: policy.SavePlan) -> None:
        """``group`` was committed with ``plan``."""

    def _host_bytes(self) -> tuple[int, int]:
        """``(in_use, pooled)`` host bytes."""
        raise NotImplementedError

    # ------------------------------------------------------------------ opening and closing
    def _enter(self, name: str, recomputable: bool = False, parts: int = 0,
               inputs: int = 0) -> tuple[GroupT, Any] | None:
        """Open group ``name``; ``parts``: it is a module whose parts are groups of their own,
        opened as one group only where a plan recomputes it whole (else ``None``: nothing)."""
        if compat.in_backward():
            # Activation checkpointing re-runs a forward inside backward, under hooks of its
            # own that must see what it saves: a group opened there does nothing.
            return None
        open_name = getattr(_local, "open", None)
        if open_name is not None:
            if getattr(_local, "whole", False):
                return None  # a part of a module run whole: that module's group holds its saves
            raise RuntimeError(
                f"cannot open group {name!r} inside group {open_name!r}: groups do not nest (R2); "
                "close the outer group first, or wrap the inner modules instead of the outer one"
            )
        me = threading.get_ident()
        with self._lock:
            if self._owner is None:
                self._owner = me
        if self._owner != me:
            raise RuntimeError(
                f"group {name!r} opened on thread {me}, but this offloader serves the forwards of thread "
                f"{self._owner}: an Offloader is used from one thread. Create one ao.Offloader per thread."
            )
        if parts:
            self._begin_step_if_new()  # the plan to ask is this step's
            if not (recomputable and self._whole_next(parts, inputs)):
                return None
        self._advance_schedule(opening=True)
        self._begin_step_if_new()
        if self._unhooked_next():
            return None  # autograd holds what it saves, as without an offloader
        with self._lock:
            self._step_begun = False
            unique, k = name, 1
            while unique in self._window:
                k += 1
                unique = f"{name}#{k}"
            position = len(self._window)
            self._window[unique] = {}
            prev = self._last_group() if self._last_group is not None else None
            group = self._new_group(unique, prev, compat.sequence_nr())
            group.position, group.recomputable, group.parts = position, recomputable, parts
            self._last_group = weakref.ref(group)
        self._group_opens(group)
        if compat.mutation_on_saved_allowed():
            hooks = self._delegating_hooks(group)
        elif group.kept_whole:
            hooks = torch.autograd.graph.saved_tensors_hooks(partial(self._pack_kept, group),
                                                             partial(self._unpack_kept, group))
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(partial(self._pack, group), self._unpack)
        hooks.__enter__()
        _local.open, _local.whole = name, bool(parts)
        return group, hooks

    def _begin_step_if_new(self) -> None:
        """A group opening after a backward pass began (or the first ever) begins a step."""
        with self._lock:
            new_step = self._backward_began or (not self._window and not self._step_begun)
            if self._backward_began:
                self._window.clear()
                self._backward_began = False
        if new_step:
            marks.new_step()
            self._step_begins()  # may raise (no plan fits): the next group begins it again
            with self._lock:
                self._step_begun = True

    def _delegating_hooks(self, group: GroupT) -> torch.autograd.graph.saved_tensors_hooks:
        """Under ``allow_mutation_on_saved_tensors()`` PyTorch's own hooks must see every save
        (it clones a saved tensor before an in-place write), and it holds each one itself, so
        nothing could be freed anyway: the group hands its saves on and stays resident."""
        group.state = GroupState.INERT
        outer = compat.current_saved_tensors_hooks()
        assert outer is not None, "allow_mutation_on_saved_tensors installs saved-tensor hooks"
        outer_pack, outer_unpack = outer

        def pack(t: torch.Tensor) -> DelegatedHandle:
            group.summary["saved"] += 1
            group.summary["kept"]["inert"] = group.summary["saved"]
            return DelegatedHandle(group, outer_pack(t), outer_unpack)

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _checkpoint_contexts(self, group: GroupT) -> tuple[Any, Any]:
        """``context_fn`` for the activation checkpointing a plan runs ``group`` under: the
        forward's saves go on to checkpoint's hooks, seen by :meth:`_seen_under_checkpoint`
        on the way (what the group would have saved, for a memory plan's profile)."""
        # Checkpoint drops what the forward saved and recomputes it, so an in-place write to a
        # saved tensor after its save would go unnoticed where autograd raises (R6): each save's
        # version is checked before each recomputation (not after: the recomputation may itself
        # write what it saves again).
        seen: list[tuple[torch.Tensor, int, tuple[int, ...]]] = []
        return (_SeeingSaves(lambda t: seen.append(self._saw_under_checkpoint(group, t))),
                _EachTime(lambda: self._recomputation(group, seen)))

    def _saw_under_checkpoint(self, group: GroupT, t: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, ...]]:
        self._seen_under_checkpoint(group, t)
        if t.is_nested:
            raise RuntimeError(
                f"group {group.name!r} is being recomputed (fast's warm-up on CUDA, or a memory_budget's plan), but "
                "its forward saves a nested tensor, which activation checkpointing cannot save. Use "
                "warmup='offload', or open this group with `with off.group(...)` so that no plan recomputes it."
            )
        try:
            guard = compat.version_guard(t)
        except RuntimeError:  # a kind whose data cannot be swapped out (sparse): hold it whole
            guard = t.detach()
        return guard, t._version, tuple(t.shape)

    @contextlib.contextmanager
    def _recomputation(self, group: GroupT, seen: list[tuple[torch.Tensor, int, tuple[int, ...]]]) -> Iterator[None]:
        for guard, version, shape in seen:
            if guard._version != version:
                raise _modified_error(group, shape, version, guard._version)
        with self._recomputing(group):
            yield

    @contextlib.contextmanager
    def _recomputing(self, group: GroupT) -> Iterator[None]:
        """Around the recomputation of ``group``'s forward in backward (a memory plan measures
        what it allocates)."""
        yield

    def _seen_under_checkpoint(self, group: GroupT, t: torch.Tensor) -> None:
        """A tensor the checkpointed forward of ``group`` saved (and checkpoint discarded)."""

    def _exit(self, entry: tuple[GroupT, Any] | None, failed: bool) -> None:
        if entry is None:
            return
        group, hooks = entry
        _local.open, _local.whole = None, False
        hooks.__exit__(None, None, None)
        group.end_seq = compat.sequence_nr()
        self._group_closing(group)
        with self._lock:
            if failed:
                # Never committed; it stays with its graph and is freed with it (R8).
                group.state = GroupState.ABORTED
                self._window.pop(group.name, None)
                return
            self._window[group.name] = group.summary
            if group.state is GroupState.INERT:
                return
            group.state = GroupState.PENDING
            self._pending.append(weakref.ref(group))
        if self.keep_last == 0:
            self._advance_schedule(opening=False)

    def _advance_schedule(self, opening: bool) -> None:
        """Commit every pending group after which ``keep_last`` groups have opened (R4).

        Called when a group opens (``opening``) and, for ``keep_last=0``, when one exits.
        """
        if not self._pending:  # read without the lock: a group is only added by this thread
            return
        due: list[GroupT] = []
        with self._lock:
            waiting = []
            for ref in self._pending:
                g = ref()
                if g is None or g.state is not GroupState.PENDING:
                    continue  # freed with its graph, or its backward already began
                g.opened_after += opening
                if g.opened_after >= self.keep_last:
                    due.append(g)
                else:
                    waiting.append(ref)
            self._pending = waiting
        for g in due:
            self._commit(g)

    # ------------------------------------------------------------------ deciding
    def _plan(self, group: GroupT, committed: bool) -> policy.SavePlan:
        plan = policy.plan_group(
            [s.tensor for s in group.saved],
            parameters=[s.is_parameter for s in group.saved],
            device=self.device,
            min_offload_bytes=self.min_offload_bytes,
            policy=self.policy,
            committed=committed,
            moved_earlier=(lambda key, aliases: self._moved_earlier(key, aliases) is not None) if committed else None,
            move_at_most=self._move_at_most(group),
        )
        group.summary.clear()
        group.summary.update(plan.summary())
        if group.recompute:  # what it saved are its inputs; the rest comes back by recomputing
            group.summary["recomputed"] = True
        return plan

    def _commit(self, group: GroupT) -> None:
        """Decide (policy) and start moving what the plan says (implementation)."""
        if group.kept_whole:
            group.state = GroupState.COMMITTED
            self._committed(group, policy.SavePlan([], [], stayed=[("budget", sum(group.kept_storages.values()))]))
            self._report_commit(group)
            return
        plan = self._plan(group, committed=True)
        self._committed(group, plan)
        tensors = [s.tensor for s in group.saved]
        moved = [self._new_moved(span, tensors[span.members[0]].untyped_storage()) for span in plan.spans]  # type: ignore[union-attr]
        try:
            if moved:  # nothing to move (a plan keeps its inputs): no copy to order or await
                self._move_out(group, moved)
        except HostMemoryError:
            group.state = GroupState.RESIDENT
            self._plan(group, committed=False)
            group.saved = []
            raise
        needed: list[Moved] = list(moved)
        uses = [len(span.members) for span in plan.spans]
        saved_at = [min(span.members) for span in plan.spans]
        for span, m in zip(plan.spans, moved):
            self._let_go(group, span, m)
            m.guard = group.saved[span.members[0]].guard
            m.version_at_copy = m.guard._version  # type: ignore[union-attr]  # the copy sees this version
            self._remember(span.storage_key, m, tensors[span.members[0]])  # type: ignore[arg-type]
        for span in plan.shared:
            earlier = self._moved_earlier(span.storage_key,
                                          [policy.fact_of(tensors[i], self.device) for i in span.members])
            assert earlier is not None, "the plan saw this copy a moment ago"
            self._let_go(group, span, earlier)
            needed.append(earlier)
            uses.append(len(span.members))
            saved_at.append(min(span.members))
        group.moved, group.uses, group.saved_at = needed, uses, saved_at
        group.state = GroupState.COMMITTED
        group.saved = []  # decided: each buffer now lives exactly as long as its handle
        self._report_commit(group)

    def _report_commit(self, group: GroupT) -> None:
        for obs in self._observers:
            obs.on_commit(group.name, dict(group.summary))

    def _let_go(self, group: GroupT, span: policy.Span, m: Moved) -> None:
        """Each member of ``span`` is from now on rebuilt from ``m`` (R5); the device tensor
        is no longer held, only a guard of its version counter (R6)."""
        for i in span.members:
            s = group.saved[i]
            t = s.tensor
            assert t is not None
            es = t.element_size()
            s.view = MovedView(m, t.dtype, tuple(t.shape), tuple(t.stride()),
                               (t.storage_offset() * es - m.span.start) // es, t.is_conj(), t.is_neg())
            s.guard = compat.version_guard(t)
            s.tensor = None

    def _remember(self, key: int, m: Moved, t: torch.Tensor) -> None:
        entry = (weakref.ref(m), compat.storage_weakref(t))
        with self._lock:
            self._moved_by_storage[key] = self._live_moved(key) + [entry]
        weakref.finalize(m, self._forget, key)

    def _forget(self, key: int) -> None:
        with self._lock:
            live = self._live_moved(key)
            if live:
                self._moved_by_storage[key] = live
            else:
                self._moved_by_storage.pop(key, None)

    def _live_moved(self, key: int) -> list[tuple[weakref.ref[Moved], StorageWeakRef]]:
        """The entries of ``key`` whose span and storage both still live (caller holds the lock)."""
        return [e for e in self._moved_by_storage.get(key, ()) if e[0]() is not None and not e[1].expired()]

    def _moved_earlier(self, key: int, aliases: list[policy.SavedFact]) -> Moved | None:
        """A live copy of this very storage, made by an earlier group, that holds every byte of
        ``aliases`` at a whole-element offset, with no in-place write since it was made."""
        with self._lock:
            entries = list(self._moved_by_storage.get(key, ()))
        for ref, storage in entries:
            m = ref()
            if m is None or storage.expired() or not m.unchanged_since_copy():
                continue  # a dead storage's address may now belong to another one
            lo, hi = m.span.start, m.span.start + m.nbytes
            if all(lo <= f.start and f.end <= hi and (f.start - lo) % f.element_size == 0 for f in aliases):
                return m
        return None

    def _freeze(self, group: GroupT) -> None:
        """Backward began before the commit: the group stays resident (keep_last)."""
        with self._lock:
            if group.state is not GroupState.PENDING:
                return
            group.state = GroupState.RESIDENT
        if group.kept_whole:
            return
        self._plan(group, committed=False)
        # Decided: each kept buffer is freed as soon as autograd releases its handle, node
        # by node, as without an offloader (not when the whole group's backward is over).
        group.saved = []

    # ------------------------------------------------------------------ hooks
    @compat.not_traced
    def _pack(self, group: GroupT, t: torch.Tensor) -> Handle | MultiHandle:
        if compat.stream_is_capturing(self.device):
            raise RuntimeError(
                "actoffload cannot offload inside a CUDA graph capture (R10): copies to host memory "
                "cannot be captured. Capture outside any offload group (or capture only blocks that "
                "run outside groups), or train this part without an offloader."
            )
        if multibuffer.is_multibuffer(t):
            return self._pack_multi(group, t)
        return Handle(group, self._add(group, t))

    def _pack_multi(self, group: GroupT, t: torch.Tensor, derived: bool = False) -> MultiHandle:
        # its buffers have no autograd history of their own: the tensor's says whether autograd made them
        derived = derived or t.grad_fn is not None
        parts = multibuffer.split(t)
        saved: list[SavedBuffer | MultiHandle | None] = []
        for b in parts.buffers:
            if b is None:
                saved.append(None)
            elif multibuffer.is_multibuffer(b):
                saved.append(self._pack_multi(group, b, derived))
            else:
                buffer = self._add(group, b)
                buffer.derived |= derived
                saved.append(buffer)
        try:
            guard: torch.Tensor | None = compat.version_guard(t)
        except (NotImplementedError, RuntimeError, TypeError):
            guard = None
        return MultiHandle(group, parts.rebuild, saved, tuple(t.shape), t._version, guard)

    def _add(self, group: GroupT, t: torch.Tensor) -> SavedBuffer:
        # no autograd history: maybe a detached view of a weight, known only by its storage
        constant = t.grad_fn is None and not t.requires_grad
        s = SavedBuffer(t, policy.is_parameter(t) or (constant and marks.is_parameter_storage(t)))
        group.saved.append(s)
        for obs in self._observers:
            obs.on_save(group.name, t)
        return s

    def _pack_kept(self, group: GroupT, t: torch.Tensor) -> torch.Tensor:
        """A save of a group that keeps everything: autograd holds it; only its bytes are counted
        (each storage once), so that a memory plan notices when the workload changes."""
        try:
            group.kept_storages[compat.storage_key(t)] = t.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError):  # no storage of its own (a wrapper subclass)
            group.kept_storages[id(t)] = t.nbytes
        group.summary["saved"] += 1
        group.summary["kept"]["budget"] = group.summary["saved"]
        return t

    def _unpack_kept(self, group: GroupT, t: torch.Tensor) -> torch.Tensor:
        if compat.in_backward():
            self._backward_began = True
        if not group.unpacked:  # its first unpack (each later one costs nothing)
            group.unpacked = True
            self._reached(group)
        return t

    @compat.not_traced
    def _unpack(self, handle: Handle | MultiHandle | DelegatedHandle) -> torch.Tensor:
        if compat.in_backward():
            self._backward_began = True
        if isinstance(handle, DelegatedHandle):
            return handle.unpack(handle.packed)
        group: GroupT = handle.group  # type: ignore[assignment]
        self._reached(group)
        return self._restore_handle(handle)

    def _reached(self, group: GroupT) -> None:
        """An unpack of ``group``: a group not committed yet stays resident; reloads may start."""
        if group.state is GroupState.PENDING:
            self._freeze(group)
        self._on_backward(group)

    def _restore_handle(self, handle: Handle | MultiHandle) -> torch.Tensor:
        group: GroupT = handle.group  # type: ignore[assignment]
        if isinstance(handle, Handle):
            return self._restore(group, handle.saved)
        if handle.guard is not None and handle.guard._version != handle.version:
            raise _modified_error(group, handle.shape, handle.version, handle.guard._version)
        parts: list[torch.Tensor | None] = []
        for p in handle.parts:
            if p is None:
                parts.append(None)
            elif isinstance(p, MultiHandle):
                parts.append(self._restore_handle(p))
            else:
                parts.append(self._restore(group, p))
        return handle.rebuild(parts)

    def _restore(self, group: GroupT, s: SavedBuffer) -> torch.Tensor:
        held = s.tensor if s.tensor is not None else s.guard
        if held is None:  # let go below
            raise RuntimeError(
                f"group {group.name!r} was recomputed under a memory_budget's plan in a backward pass that did not "
                "keep the graph, which let go of the inputs it recomputes from; to run another backward pass "
                "through its module (from another of its outputs, or autograd.grad for other parameters), pass "
                "retain_graph=True to the first"
            )
        if held._version != s.version:
            raise _modified_error(group, s.view.size if s.view is not None else held.shape, s.version, held._version)
        if s.tensor is not None:
            t = s.tensor
            if group.release_inputs and s.derived and compat.in_backward() and not compat.backward_keeps_graph():
                # A memory plan's recomputed group saves only its inputs, and its recomputation is
                # their one use in this pass: let go of them, so that they are freed with what the
                # recomputation saved (as reloaded inputs are, which is what the plan's model
                # measured), not only when the group's whole backward is over. Leaves and
                # constants stay: something else holds them anyway.
                s.tensor = None
            return t
        v = s.view
        assert v is not None
        dev = self._device_bytes(group, v.moved)  # type: ignore[arg-type]
        # dev starts at the span's first byte, which policy.Span aligns for every alias
        out = torch.empty(0, dtype=v.dtype, device=dev.device)
        out = out.set_(dev.untyped_storage(), dev.storage_offset() // out.element_size() + v.offset, v.size, v.stride)
        if v.conj:
            out = out.conj()
        if v.neg:
            out = compat.neg_view(out)
        return out

    # ------------------------------------------------------------------ backward order
    def _upcoming(self, group: GroupT, depth: int) -> list[GroupT]:
        """Up to ``depth`` groups opened before ``group`` that the running backward pass will
        reach next, in that order; never a group of another graph (another micro-batch).

        From the node now unpacking ``group``, a search back through the graph (towards the
        forward's earlier nodes) finds a node the previous group's forward created, by its
        autograd sequence number; the engine then says whether this pass executes it.
        """
        out: list[GroupT] = []
        frontier = [compat.current_node()]
        if depth == 0 or frontier[0] is None:
            return out
        prev = group.previous()
        while prev is not None and len(out) < depth:
            found = _nodes_created_in(frontier, prev.first_seq, prev.end_seq)
            if not found or not compat.will_execute(found[0]):
                break
            out.append(prev)  # type: ignore[arg-type]
            frontier = found
            prev = prev.previous()
        return out

    # ------------------------------------------------------------------ stats
    def _stats(self) -> dict[str, Any]:
        with self._lock:
            for ref in self._pending:  # not committed yet: report as keep_last would leave them
                g = ref()
                if g is not None and g.state is GroupState.PENDING and not g.kept_whole:
                    self._plan(g, committed=False)
            groups = {name: {k: dict(v) if isinstance(v, dict) else v for k, v in s.items()}
                      for name, s in self._window.items() if s}
        in_use, pooled = self._host_bytes()
        return {
            "impl": self.impl,
            "groups": groups,
            "offloaded_bytes": sum(g["offloaded_bytes"] for g in groups.values()),
            "host_bytes_in_use": in_use,
            "host_bytes_pooled": pooled,
        }


class _SeeingSaves:
    """Saved-tensor hooks that show each save to ``see`` and hand it on to the hooks that were
    innermost when entered (checkpoint enters its own, then this one)."""

    def __init__(self, see: Any):
        self._see = see
        self._hooks: Any = None

    def __enter__(self) -> None:
        outer = compat.current_saved_tensors_hooks()
        assert outer is not None, "checkpoint installs its hooks before entering its context"
        outer_pack, outer_unpack = outer
        see = self._see  # not self: the hooks would hold themselves (below)

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

    def __init__(self, make: Any):
        self._make = make
        self._entered: list[Any] = []

    def __enter__(self) -> Any:
        context = self._make()
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._entered.pop().__exit__(*exc)


def _nodes_created_in(frontier: list[Any], first_seq: int, end_seq: int) -> list[Any]:
    """Nodes reachable from ``frontier`` (towards inputs) whose sequence number lies in
    ``[first_seq, end_seq)``, nearest first. Nodes older than ``first_seq`` cannot lead
    into that range (a node's inputs are older than it), so the search stops there."""
    seen: dict[int, Any] = {}  # id -> node: holding the node keeps its id from being reused
    queue = list(frontier)
    found = []
    while queue:
        node = queue.pop(0)
        for nxt, _ in node.next_functions:
            if nxt is None or id(nxt) in seen:
                continue
            seen[id(nxt)] = nxt
            seq = compat.node_sequence_nr(nxt)
            if first_seq <= seq < end_seq:
                found.append(nxt)
            elif seq >= first_seq and seq < 1 << 62:  # AccumulateGrad nodes have the largest number
                queue.append(nxt)
    return found
