"""Group lifecycle shared by every implementation: hooks, commit schedule, checks, stats.

An implementation (``ref``, ``fast``) subclasses :class:`actoffload.Offloader` and supplies
only *how bytes move*: :meth:`Engine._move_out` at commit, :meth:`Engine._device_bytes` at
unpack, and optionally the points where it does work of its own (a group opens, backward
reaches a group). *What* moves is decided by :func:`actoffload.policy.plan_group`; *what
each group does* (open at all, recompute, how much it may move) by the one plan object
the engine asks (:mod:`actoffload.plans`); *when* a group commits (R4's keep_last rule),
the version check (R6), the multi-buffer protocol (R7) and lifetimes (R8) live here, once.
Storages shared between groups (R5) are :mod:`actoffload.sharing`'s, groups run under
activation checkpointing :mod:`actoffload.checkpointing`'s, and the search for the groups
backward reaches next :mod:`actoffload.graph`'s.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from functools import partial
from typing import Any, Callable, ClassVar, Generic, TypeVar

import torch

from . import checkpointing, compat, graph, marks, multibuffer, policy
from .checkpointing import modified_error
from .hostmem import HostMemory, HostMemoryError
from .observe import Observer, listening
from .plans import OFFLOAD, Plan
from .records import DelegatedHandle, Group, GroupState, Handle, Moved, MovedView, MultiHandle, SavedBuffer
from .sharing import SharedStorages

GroupT = TypeVar("GroupT", bound=Group)
MovedT = TypeVar("MovedT", bound=Moved)

_OPEN: dict[str, Any] = {}  # the stats() entry of a group still open: none (never written to)

_deaths = itertools.count(1)  # (next() on it is atomic: a group may be let go on any thread)


class _Holder(weakref.ref):
    """A listed group, held weakly: how many exceptions had closed groups as it exited, and
    when (in the order groups are let go) it was let go, if it was."""

    __slots__ = ("failures", "died")

    def __new__(cls, group: Group, failures: int) -> "_Holder":
        return super().__new__(cls, group, _Holder._let_go)

    def __init__(self, group: Group, failures: int) -> None:  # (ref's own takes the callback)
        self.failures = failures
        self.died: int | None = None

    @staticmethod
    def _let_go(holder: "_Holder") -> None:
        holder.died = next(_deaths)


# The group open on each thread (groups do not nest), by thread id: its name, whether it is a
# module run whole in place of its parts, which open no groups of their own, and its saves so far
# where it may move them (a module's selection narrows what it saved among them: roles.selects).
# (A dict, not a threading.local: reading a thread-local's attribute cost as much as the rest of
# the check.)
_open_on: dict[int, tuple[str, bool, list[SavedBuffer] | None]] = {}


def group_open() -> bool:
    """Whether an offload group is open on this thread (ops skip offload work otherwise)."""
    return threading.get_ident() in _open_on


def open_group_saves() -> list[SavedBuffer] | None:
    """The saves so far of the group open on this thread (the group's own list, which grows as
    it saves), or ``None`` where none is open or it keeps everything it saves."""
    opened = _open_on.get(threading.get_ident())
    return opened[2] if opened is not None else None


class Engine(Generic[GroupT, MovedT]):
    """The lifecycle of groups; see :class:`actoffload.Offloader` for the public API."""

    impl: ClassVar[str] = "base"

    def __init__(self, device: torch.device, min_offload_bytes: int, policy_name: str, keep_last: int,
                 host: HostMemory, plan: Plan):
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.policy = policy_name
        self.keep_last = keep_last if plan.keep_last is None else plan.keep_last
        self.plan = plan  # what each group does (the plan decides; the engine asks it)
        self._host = host
        # Backward may run on other threads than the forward, and stats() be read from any: this
        # lock orders what they change (a group reached, or kept for backward; a step begun).
        # What the forward's thread alone changes (the stats window, the pending groups) goes
        # without it, and stats() reads copies of those, each taken at once.
        self._lock = threading.RLock()
        # exited, not yet committed, in exit order (which is open order: groups do not nest)
        self._pending: collections.deque[weakref.ref[GroupT]] = collections.deque()
        self._openings = 0  # groups opened while some group was pending (R4's clock)
        # stats() window: the groups opened since a backward pass last began
        self._window: dict[str, dict[str, Any]] = {}
        self._repeats: dict[str, int] = {}  # name -> the last "#k" given to it in the window
        self._backward_began = False
        # the listed group of each name in the window, and the groups an exception had closed as
        # it exited: a name whose group was let go (its forward cut short by an exception, or
        # discarded) is given again, not "name#2"; one cut short is not reported
        self._holders: dict[str, _Holder] = {}
        self._failures = 0  # groups an exception closed
        self._step_failures = 0  # ... when the step began (or was last found to go on: _decide_cut_short)
        self._step_first: str | None = None  # the name the step's first group with gradients on was opened with
        self._gone: set[str] = set()  # groups let go before this window's backward began, run again since
        self._opened: dict[str, tuple[str, int]] = {}  # window name -> (the name given, its opening's number)
        self._namesakes: dict[str, dict[str, None]] = {}  # a name given again -> its window names ("name#k")
        self._opening_number = 0
        self._in_step = False  # a step began (the first one ever, or after a backward pass began)
        self._last_group: weakref.ref[GroupT] | None = None
        self._owner: int | None = None  # the thread whose forwards open groups
        # whether a forward that saves chose that thread: one that saves nothing (an evaluation on
        # a thread of its own, run first) chooses it only until a forward with gradients on comes
        self._owner_saves = False
        self._observers: list[Observer] = []
        self._shared = SharedStorages()  # spans moved out, by storage: a later group reuses them (R5)
        self._cuda = device.type == "cuda"  # (CUDA graph captures: checked at each save only there)
        # the group whose hooks are open (on the owner thread; groups do not nest): one pack hook
        # serves every group, where one made for each group lived on with each of its saves
        self._open_group: GroupT | None = None
        self._pack_open = self._pack_into_open_group
        self._unpack_open = self._unpack_handle
        # implementations that do nothing when a group opens or backward reaches one are not asked
        self._tells_opening = type(self)._group_opening is not Engine._group_opening
        self._tells_reached = type(self)._backward_reaches is not Engine._backward_reaches
        # only implementations that reload ahead need each group's autograd sequence numbers (graph.py)
        self._prefetches = type(self)._prefetch_depth is not Engine._prefetch_depth
        self._asks = plan.acts_at()  # where the plan acts (read again as each step begins)
        plan.attach(self)

    # ------------------------------------------------------------------ implementation
    @property
    def host_budget(self) -> int:
        """The most host memory (bytes) this offloader may hold (its ``host_budget`` setting)."""
        return self._host.budget

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

    def _inputs_copied(self, group: GroupT) -> None:
        """``group``'s copies out must be done before any later work on the device (a later
        in-place write must not reach them): implementations whose copies run alongside
        compute order them here."""

    def _group_opening(self) -> None:
        """A group is about to open (or would, were it not kept whole): implementations may
        finish earlier work here."""

    def _backward_reaches(self, group: GroupT) -> None:
        """Backward unpacked something ``group`` saved for the first time: reloads may start."""

    def _prefetch_depth(self) -> int:
        """How many groups ahead this implementation asks :func:`actoffload.graph.upcoming`
        for when backward reaches a group (0: never)."""
        return 0

    def _host_bytes(self) -> tuple[int, int]:
        """``(in_use, pooled)`` host bytes."""
        raise NotImplementedError

    def host_allocations(self) -> int | None:
        """Host buffers this offloader has allocated so far, or ``None`` where it does not count
        them: a plan's step that allocated none (pinned none) ran at its own pace."""
        return None

    # ------------------------------------------------------------------ for plans
    def host_room(self) -> int:
        """Bytes the host budget has room for now: the budget less what copies hold (host buffers
        a pool keeps free count as room: it lets them go for others; an estimate)."""
        in_use, _ = self._host_bytes()
        return max(0, self.host_budget - in_use)

    def reserve_host_blocks(self, span_bytes: list[int]) -> Callable[[], None]:
        """Get host memory ready, ahead of time, for a commit that will move spans of these
        sizes; returns what gives the reservation back. (Implementations that pin a pool
        do it on a background thread; the others need nothing.)"""
        return lambda: None

    def host_pinning(self) -> tuple[int, BaseException | None]:
        """``(bytes still being reserved, the error that stopped the last reservation)``."""
        return 0, None

    # ------------------------------------------------------------------ opening and closing
    @compat.not_traced  # (Dynamo cannot trace threading.get_ident: a break here, not a warning)
    def _serves_another_thread(self) -> bool:
        """Whether this offloader serves the forwards of a thread other than the calling one (R8)."""
        return self._owner is not None and self._owner != threading.get_ident()

    def _enter(self, name: str, recomputable: bool = False, parts: int = 0, inputs: int = 0,
               compiled: bool = False) -> GroupT | None:
        """Open group ``name``; ``parts``: it is a module whose parts are groups of their own,
        opened as one group only where the plan recomputes it whole (else ``None``: nothing);
        ``compiled``: a recomputable module running compiled code, recomputed plainly only."""
        if compat.in_backward():
            # Activation checkpointing re-runs a forward inside backward, under hooks of its
            # own that must see what it saves: a group opened there does nothing. (A backward pass
            # is running: with reentrant checkpointing, whose forward saved nothing, this may be
            # the first the offloader sees of it.)
            if not self._backward_began:
                self._backward_begins()
            return None
        if torch.jit.is_tracing():
            return None  # torch.jit.trace records the forward: a group's hooks and copies would enter its graph
        if compat.in_function_transform():
            # torch.func's grad and vjp take no saved-tensor hooks, jvp no .data write to a version
            # guard, and a module recomputed in a backward outside vmap meets its batched tensors
            # escaped: what a transformed function saves is left to autograd (R2)
            return None
        me = threading.get_ident()
        opened = _open_on.get(me)
        if opened is not None:
            open_name, whole, _ = opened
            if whole:
                return None  # a part of a module run whole: that module's group holds its saves
            raise RuntimeError(
                f"cannot open group {name!r} inside group {open_name!r}: groups do not nest (R2); "
                "close the outer group first, or wrap the inner modules instead of the outer one"
            )
        saves = torch.is_grad_enabled()
        if self._owner is None or (saves and not self._owner_saves):
            with self._lock:
                if self._owner is None or (saves and not self._owner_saves and self._owner not in _open_on):
                    self._owner, self._owner_saves = me, saves
        if self._owner != me:
            if not saves:
                return None  # (another thread's forward that saves nothing, an evaluation say: R2 leaves it be)
            raise RuntimeError(
                f"group {name!r} opened on thread {me}, but this offloader serves the forwards of thread "
                f"{self._owner}: an Offloader serves the forwards of one thread. Run the training forwards on one "
                "thread (a forward under torch.no_grad() may run on any), or give each thread a copy of the model "
                "wrapped with an ao.Offloader of its own."
            )
        outer = compat.current_saved_tensors_hooks()
        if outer is not None and not compat.hooks_own_saves(outer):
            outer = None  # other hooks (a tool watching saves): the group's own take precedence
        if parts:
            self._begin_step_if_new(name)  # the plan to ask is this step's
            if outer is not None or not (recomputable and self.plan.runs_whole(parts, inputs)):
                return None
        if self._pending:  # (a group is only added by this thread: read without the lock)
            self._advance_schedule(opening=True)
        if (self._backward_began or not self._in_step or self._failures > self._step_failures
                or name == self._step_first):  # (read again under the lock)
            self._begin_step_if_new(name)
        if self._step_first is None and torch.is_grad_enabled():  # (after an evaluation forward began the step)
            self._step_first = name
        if self._tells_opening:
            self._group_opening()
        if outer is None:
            opening = self.plan.opening(name, recomputable, parts) if "opening" in self._asks else OFFLOAD
            if not opening.hooked:
                return None  # autograd holds what it saves, as without an offloader
        unique = name
        if self._taken(name):  # "name#k": counted on from the last k given, not from 2
            self._let_namesakes_go(name)
            k = self._repeats.get(name, 1)
            while self._taken(unique):
                k += 1
                unique = f"{name}#{k}"
            self._repeats[name] = k
            self._namesakes.setdefault(name, {name: None})[unique] = None
        position = len(self._window)
        self._window[unique] = _OPEN  # (not in stats() until it exits)
        self._opening_number += 1
        self._opened[unique] = (name, self._opening_number)
        prev = self._last_group() if self._last_group is not None and self._prefetches else None
        # a node of the graph that tells whether backward reaches prev (graph.py), only where
        # reloading ahead may go there: each costs a node its Python object
        links = prev is not None and self._may_reload_ahead_to(prev)
        group = self._new_group(unique, prev if links else None, compat.sequence_nr() if self._prefetches else 0)
        if links:
            group.link_tries = graph.LINK_TRIES
        group.position, group.recomputable, group.parts = position, recomputable, parts
        if compiled:
            group.compiled = True
        if self._prefetches:
            self._last_group = weakref.ref(group)
        if outer is not None:
            pack, unpack = self._delegating_hooks(group, outer)
        else:
            if opening is not OFFLOAD:  # (else each stays as Group has it: False)
                group.recompute = recomputable and opening.recompute
                group.release_inputs = group.recompute and opening.release_inputs
                group.kept_whole = opening.keep_all and not group.recompute
                group.guard_inputs = group.recompute and opening.guard_inputs
                group.selective = group.recompute and opening.selective and not compiled
                group.selective_calls = opening.selective_calls if group.selective else None
                group.selective_attention = group.selective and opening.selective_attention
            if "opened" in self._asks:
                self.plan.opened(group)
            if group.kept_whole:
                group.kept_storages = {}
                pack, unpack = partial(self._pack_kept, group), partial(self._unpack_kept, group)
            else:
                pack, unpack = self._pack_open, self._unpack_open
        self._open_group = group
        compat.push_saved_tensors_hooks(pack, unpack)
        _open_on[me] = (name, bool(parts), None if group.kept_whole else group.saved)  # type: ignore[assignment]  # (a list while it is open)
        return group

    def _unlist(self, name: str) -> None:
        """Take group ``name`` out of the window; nor does it keep its number, where it was the
        last "name#k" given."""
        self._window.pop(name, None)
        self._holders.pop(name, None)
        opened = self._opened.pop(name, None)
        if opened is not None and opened[0] in self._namesakes:
            self._namesakes[opened[0]].pop(name, None)
        base, _, k = name.rpartition("#")
        if k.isdigit() and self._repeats.get(base) == int(k):
            self._repeats[base] = int(k) - 1

    def _let_namesakes_go(self, name: str) -> None:
        """A group of ``name`` opens again: the window's groups of that name already let go leave
        it, outlived by this one (so not reported: :meth:`_let_go_names`). Else, in a loop of
        forwards with gradients and no backward pass, every other one's "name#k" stayed until
        the next backward."""
        for other in list(self._namesakes.get(name, ())):
            holder = self._holders.get(other)
            if holder is not None and holder.died is not None:
                self._unlist(other)

    def _taken(self, name: str) -> bool:
        """Whether ``name`` is a group's in the window. One whose group was let go before any
        backward pass (its graph with it: a forward an exception cut short, retried) is not: it
        leaves the window, its saves freed (R8), and the name is given again."""
        if name not in self._window:
            return False
        holder = self._holders.get(name)
        if holder is None or holder() is not None:
            return True  # (open, or alive)
        self._unlist(name)
        return False

    def _let_go_names(self) -> set[str]:
        """The groups of the window let go with their graph, their saves freed (R8), and so not
        reported: after an exception closed a later group (its forward cut short), or, before any
        backward pass began, once a later group of the name it was given outlived it (a forward
        discarded and run again: ``out = model(x); out = model(x)``). A forward discarded and
        not run again stays reported as it ran until the next one.

        Outlived, not merely opened after it: a forward's graph is let go from its output back,
        so a module applied twice in a row whose graph goes without a backward pass (dropped, or
        a backward that raised before reaching it) stays two groups, whether the graph went
        before stats() was read or after (autograd's device thread may let it go a little after
        ``backward()`` raised). (Applied in parallel branches, the order autograd lets the
        branches go decides.) One pass over the window, each name's groups by opening."""
        if self._backward_began:
            return set(self._gone)  # (decided as it began: the groups backward frees are not let go)
        by_name: dict[str, list[tuple[int, str, _Holder | None]]] = {}
        for name in list(self._window):
            opened = self._opened.get(name)
            if opened is not None:  # (no holder: still open)
                by_name.setdefault(opened[0], []).append((opened[1], name, self._holders.get(name)))
        gone: set[str] = set()  # (none decided yet: backward has not begun)
        for groups in by_name.values():
            outlasting = 0.0  # the latest any later group of the name was let go (inf: one lives)
            for _, name, holder in sorted(groups, key=lambda g: g[0], reverse=True):
                died = None if holder is None else holder.died
                if holder is not None and died is not None and (
                        self._failures > holder.failures or outlasting > died):
                    gone.add(name)
                outlasting = max(outlasting, float("inf") if died is None else died)
        return gone

    def _may_reload_ahead_to(self, prev: GroupT) -> bool:
        """Whether reloading ahead may reach ``prev`` from the group opening after it."""
        depth = self._prefetch_depth()
        return depth > 1 or (depth == 1 and (prev.state is GroupState.PENDING or bool(prev.moved)))

    def _decide_cut_short(self, name: str) -> bool:
        """Whether the step's forward was cut short, or let go, without a backward pass (R8): the
        group opening now, ``name``, opens the step's first group again, and every group of the
        step that saved something was let go with its graph. The forward began again (a batch
        skipped or retried, an evaluation with gradients on whose loss was read and dropped): it
        begins a step for the plan, from its first group. Where a group of the step lives on, the
        step goes on: an earlier micro-batch's forward waits for its backward, or the forward
        caught an exception itself (a fallback; its first module called again, or a module shared
        by every layer, opens a group of the first one's name). (A copy still in flight may hold
        a let-go group a while: the step then goes on, and its plan re-plans, as it would for any
        step that opens more groups than planned.)

        After an exception since the step began, it is decided once per exception, at the next
        group opening whatever its name, and the decision recorded (the lock held): asked again
        before the next exception, it answers no. Without one, some group of the step must have
        saved something: a forward none of whose groups did (a plan runs them all without hooks,
        or they save nothing) says nothing of its graph, and goes on."""
        if self._backward_began:
            return False
        if self._failures != self._step_failures:
            self._step_failures = self._failures
        elif name != self._step_first or not self._holders:
            return False
        return name == self._step_first and all(holder() is None for holder in self._holders.values())

    def _begin_step_if_new(self, name: str) -> None:
        """A group opening (``name``) after a backward pass began (or the first ever, or after an
        exception cut the forward short: :meth:`_decide_cut_short`) begins a step."""
        with self._lock:
            # (a step cut short keeps its window: the cut-short forward's groups are let go as R8
            # says, by their graphs, and their names given again once they are)
            cut_short = self._decide_cut_short(name)
            new_step = self._backward_began or not self._in_step or cut_short
            if self._backward_began:
                self._window.clear()
                self._holders.clear()
                self._opened.clear()
                self._namesakes.clear()
                self._gone = set()
                self._repeats.clear()
                self._backward_began = False
                self._in_step = False  # until the plan has begun it (should it raise, the next group begins it)
            if new_step:
                self._step_failures = self._failures
                self._step_first = name if torch.is_grad_enabled() else None
        if new_step:
            marks.new_step()
            if cut_short:
                self._forward_let_go()
                self.plan.forward_cut_short()
            self.plan.step_begins()  # may raise (no plan fits): the next group begins it again
            self._asks = self.plan.acts_at()
            with self._lock:
                self._in_step = True

    def _forward_let_go(self) -> None:
        """The step's forward was cut short or let go (:meth:`_decide_cut_short`), and a step
        begins: what the implementation still holds for it (copies in flight) may go, before
        the plan reads what the step begins with."""

    def _delegating_hooks(self, group: GroupT, outer: tuple[Callable, Callable]) -> tuple[Callable, Callable]:
        """A group opened inside saved-tensor hooks that must see every save (activation
        checkpointing around it, ``allow_mutation_on_saved_tensors()``) hands every save on to
        them and stays resident: they own what is saved there. Checkpointing, say, recomputes the
        region in backward, where no group opens, and pairs the recomputed saves with the
        forward's by position: it must see the same saves both times."""
        group.state = GroupState.INERT
        outer_pack, outer_unpack = outer

        def pack(t: torch.Tensor) -> DelegatedHandle:
            group.summary["saved"] += 1
            group.summary["kept"]["inert"] = group.summary["saved"]
            return DelegatedHandle(group, outer_pack(t), outer_unpack)

        return pack, self._unpack_open

    def _checkpoint_contexts(self, group: GroupT) -> tuple[Any, Any]:
        """``context_fn`` for the activation checkpointing the plan runs ``group`` under."""
        return checkpointing.contexts(group, self.plan.checkpoint_saves_observer(group),
                                      partial(self._recomputation, group),
                                      self.plan.op_meter(group) if not group.compiled else None,
                                      (partial(self._pack, group), self._unpack))

    def _recomputation(self, group: GroupT) -> Any:
        """The plan's context for ``group``'s recomputation. A recomputation in backward also
        says that the backward pass runs and has reached the group, as an unpack does: where its
        inputs are in a tuple, checkpoint keeps them itself, and nothing of the group (of the
        step, where every group is recomputed) comes through this offloader's hooks."""
        if compat.in_backward():
            if not self._backward_began:
                self._backward_begins()
            if not group.reached:
                self._reached(group)
        return self.plan.recomputation(group)

    def _exit(self, group: GroupT | None, failed: bool) -> None:
        if group is None:
            if failed:  # a group the plan ran without hooks (it keeps everything) cut short all the same
                self._forward_failed()
            return
        _open_on.pop(threading.get_ident(), None)
        compat.pop_saved_tensors_hooks()
        self._open_group = None
        if self._prefetches:
            group.end_seq = compat.sequence_nr()
            group.link_candidate = None  # unconfirmed by its saves: its graph may not reach it
        if group.state is not GroupState.INERT and "closing" in self._asks:
            self.plan.closing(group)
        if failed:
            # Never committed; it stays with its graph and is freed with it (R8).
            group.state = GroupState.ABORTED
            self._unlist(group.name)  # its name too: the forward run again takes it
            self._forward_failed()
            return
        if group.saved or group.summary["saved"]:
            self._window[group.name] = group.summary
            self._holders[group.name] = _Holder(group, self._failures)
        else:
            # It saved nothing (frozen, or only ops that save nothing): not listed, so that steps
            # whose backward never reaches a group (it has nothing to unpack) add nothing either
            self._unlist(group.name)
        if group.state is GroupState.INERT:
            return
        group.state = GroupState.PENDING
        group.exited_at = self._openings
        self._pending.append(weakref.ref(group))
        if group.recompute:
            # What a recomputed group saves are its module's inputs, which the caller may write
            # in place once the forward is over (``h += block(h)``, which autograd allows where
            # nothing saved h): committed now, and where the plan guards them, copied before any
            # later work can write them (clones of those that stay), for the recomputation to
            # read as the forward did (R6's exception for inputs a plan saved).
            self._commit(group)
            if group.guard_inputs and group.state is GroupState.COMMITTED:
                self._inputs_copied(group)
        elif self.keep_last == 0:
            self._advance_schedule(opening=False)

    def _forward_failed(self) -> None:
        """An exception cut a step's forward short (R8): counted, and the plan told. Not a
        recomputation in backward (which checkpoint stops early with an exception of its own, and
        where no group opens), nor an evaluation forward (``no_grad``: no step's)."""
        if not compat.in_backward() and torch.is_grad_enabled():
            self._failures += 1
            self.plan.group_failed()

    def _advance_schedule(self, opening: bool) -> None:
        """Commit every pending group after which ``keep_last`` groups have opened (R4).

        Called when a group opens (``opening``) and, for ``keep_last=0``, when one exits. A group
        is due ``keep_last`` openings after its exit: the due ones are the first to have exited.
        """
        self._openings += opening
        pending = self._pending
        while pending:
            g = pending[0]()
            if g is not None and g.state is GroupState.PENDING:  # (else freed with its graph, or reached)
                if self._openings - g.exited_at < self.keep_last:
                    return
                pending.popleft()
                self._commit(g)
            else:
                pending.popleft()

    # ------------------------------------------------------------------ deciding
    def _plan(self, group: GroupT, committed: bool, nothing_moves: bool = False) -> policy.SavePlan:
        """What ``group`` moves and keeps (``nothing_moves``: the host memory its plan's share
        asked for was short, and the plan lets it stay)."""
        device = self.device
        plan = policy.plan_facts(
            [policy.fact_of(s.tensor, device, s.is_parameter) for s in group.saved],  # (policy.plan_group)
            # guarded inputs that stayed would be cloned on the device (R9's bytes): move even small ones
            min_offload_bytes=0 if group.guard_inputs and committed else self.min_offload_bytes,
            policy=self.policy,
            committed=committed,
            moved_earlier=self._moved_earlier if committed else None,
            move_at_most=0 if nothing_moves else self.plan.move_at_most(group) if "move_at_most" in self._asks else None,
        )
        summary = plan.summary()
        if group.recompute:  # what it saved are its inputs; the rest comes back by recomputing
            summary["recomputed"] = True
        if self._window.get(group.name) is group.summary:  # (not after a step began with a group of its name)
            self._window[group.name] = summary
        group.summary = summary
        return plan

    def _moved_earlier(self, key: int, aliases: list[policy.SavedFact]) -> bool:
        """An earlier group's copy of storage ``key`` serves ``aliases`` (R5)."""
        return self._shared.copy_of(key, aliases) is not None

    def _commit(self, group: GroupT) -> None:
        """Decide (policy) and start moving what the plan says (implementation)."""
        if group.kept_whole:
            group.state = GroupState.COMMITTED
            self.plan.committed(group, policy.SavePlan([], [], stayed=[("budget", sum(group.kept_storages.values()))]))
            if self._observers:
                self._report_commit(group)
            return
        plan = self._plan(group, committed=True)
        if not plan.spans and not plan.shared and not group.guard_inputs:  # all stays: each buffer as it is
            if "committed" in self._asks:
                self.plan.committed(group, plan)
            group.state = GroupState.COMMITTED
            group.decided()
            if self._observers:
                self._report_commit(group)
            return
        tensors = [s.tensor for s in group.saved]
        moved = [self._new_moved(span, tensors[span.members[0]].untyped_storage()) for span in plan.spans]  # type: ignore[union-attr]
        try:
            if moved:  # nothing to move (a plan keeps its inputs): no copy to order or await
                self._move_out(group, moved)
        except BaseException as e:  # host memory short, or an allocator's own error: nothing moved
            if not (isinstance(e, HostMemoryError) and self.plan.stays_when_host_short):
                group.state = GroupState.RESIDENT
                self._plan(group, committed=False)
                group.decided()
                if self._observers:
                    self._report_commit(group)
                self._forward_failed()  # raised into the forward, which it cuts short as an exception in a group does
                raise
            plan, moved = self._plan(group, committed=True, nothing_moves=True), []  # it stays, moving nothing
        if "committed" in self._asks:  # (what it moves, once its host memory was had)
            self.plan.committed(group, plan)
        needed: list[Moved] = list(moved)
        uses = [len(span.members) for span in plan.spans]
        saved_at = [min(span.members) for span in plan.spans]
        for span, m in zip(plan.spans, moved):
            self._let_go(group, span, m)
            m.guard = group.saved[span.members[0]].guard
            m.version_at_copy = m.guard._version  # type: ignore[union-attr]  # the copy sees this version
            self._shared.remember(span.storage_key, m, tensors[span.members[0]])  # type: ignore[arg-type]
        for span in plan.shared:
            earlier = self._shared.copy_of(span.storage_key,
                                          [policy.fact_of(tensors[i], self.device) for i in span.members])
            assert earlier is not None, "the plan saw this copy a moment ago"
            self._let_go(group, span, earlier)
            needed.append(earlier)
            uses.append(len(span.members))
            saved_at.append(min(span.members))
        # (tuples: the collector stops walking those of plain numbers, and a step keeps one per group)
        group.moved, group.uses, group.saved_at = tuple(needed), tuple(uses), tuple(saved_at)
        group.state = GroupState.COMMITTED
        if group.guard_inputs:
            for s in group.saved:
                if s.tensor is not None and s.derived and s.view is None:  # stays: a private clone
                    s.guard, s.tensor, s.cloned = compat.version_guard(s.tensor), s.tensor.clone(), True
        group.decided()  # each buffer now lives exactly as long as its handle
        if self._observers:
            self._report_commit(group)

    def _report_commit(self, group: GroupT) -> None:
        for obs in listening(self._observers):
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

    def _freeze(self, group: GroupT) -> None:
        """Backward began before the commit: the group stays resident (keep_last)."""
        with self._lock:
            if group.state is not GroupState.PENDING:
                return
            group.state = GroupState.RESIDENT
        if not group.kept_whole:
            self._plan(group, committed=False)
            # Decided: each kept buffer is freed as soon as autograd releases its handle, node
            # by node, as without an offloader (not when the whole group's backward is over).
            group.decided()
        if self._observers:
            self._report_commit(group)

    # ------------------------------------------------------------------ hooks
    # The hooks autograd calls: kept out of torch.compile here, at their entry points.
    @compat.not_traced
    def _unpack_handle(self, handle: Handle | MultiHandle | DelegatedHandle) -> torch.Tensor:
        return self._unpack(handle)

    @compat.not_traced
    def _pack_into_open_group(self, t: torch.Tensor) -> Handle | MultiHandle:
        group = self._open_group
        assert group is not None, "a save reached a group's hooks after the group closed"
        return self._pack(group, t)

    def _pack(self, group: GroupT, t: torch.Tensor) -> Handle | MultiHandle:
        if self._cuda and compat.stream_is_capturing(self.device):
            raise RuntimeError(
                "actoffload cannot offload inside a CUDA graph capture (R10): copies to host memory "
                "cannot be captured. Capture outside any offload group (or capture only blocks that "
                "run outside groups), or train this part without an offloader."
            )
        if group.link_tries and not t.is_leaf:
            graph.note_save(group, t)
        if type(t) is not torch.Tensor and multibuffer.is_multibuffer(t):  # (a plain tensor is not: no call)
            return self._pack_multi(group, t)
        return Handle(group, self._add(group, t))

    def _pack_multi(self, group: GroupT, t: torch.Tensor, derived: bool = False,
                    parameter: bool = False) -> MultiHandle:
        # its buffers have no autograd history of their own: the tensor's says whether autograd
        # made them, and whether they are a parameter's (a leaf that requires grad, R3)
        derived = derived or not t.is_leaf
        parameter = parameter or policy.is_parameter(t)
        parts = multibuffer.split(t)
        saved: list[SavedBuffer | MultiHandle | None] = []
        for b in parts.buffers:
            if b is None:
                saved.append(None)
            elif multibuffer.is_multibuffer(b):
                saved.append(self._pack_multi(group, b, derived, parameter))
            else:
                buffer = self._add(group, b)
                buffer.derived |= derived
                buffer.is_parameter |= parameter
                saved.append(buffer)
        try:
            guard: torch.Tensor | None = compat.version_guard(t)
        except (NotImplementedError, RuntimeError, TypeError):
            guard = None
        return MultiHandle(group, parts.rebuild, saved, tuple(t.shape), t._version, guard)

    def _add(self, group: GroupT, t: torch.Tensor) -> SavedBuffer:
        if t.is_leaf:
            # no autograd history: maybe a detached view of a weight, known only by its storage
            parameter = policy.is_parameter(t) or (not t.requires_grad and marks.is_parameter_storage(t))
            s = SavedBuffer(t, parameter, derived=False)
        else:  # made by autograd: a parameter only as a view of one
            s = SavedBuffer(t, t._base is not None and policy.is_parameter(t), derived=True)
        group.saved.append(s)  # type: ignore[union-attr]  # (a list while it is open, which is when it saves)
        if self._observers:
            for obs in listening(self._observers):
                obs.on_save(group.name, t)
        return s

    def _pack_kept(self, group: GroupT, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A save of a group that keeps everything: autograd holds it; only its bytes are counted
        (each storage once), so that a memory plan notices when the workload changes."""
        if group.link_tries and not t.is_leaf:
            graph.note_save(group, t)
        try:
            group.kept_storages[compat.storage_key(t)] = t.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError):  # no storage of its own (a wrapper subclass)
            group.kept_storages[id(t)] = t.nbytes
        group.summary["saved"] += 1
        group.summary["kept"]["budget"] = group.summary["saved"]
        # held as a detach()ed alias where it has an autograd history (as SavedBuffer holds one):
        # an op's output held as itself closes a cycle through the C++ node saving it, which
        # Python's collector cannot see, and a forward let go without a backward pass would live
        # on (the alias shares its version counter: autograd checks no version of what
        # saved-tensor hooks hand back, R6)
        return t if t.is_leaf else t.detach(), t._version

    def _backward_begins(self) -> None:
        """A backward pass is running (it unpacked a save of this step, or checkpointing runs a
        forward again): the next group opened outside backward begins a step."""
        if not self._backward_began:
            with self._lock:  # (what was let go before it began, run again since, stays unreported)
                self._gone = self._let_go_names()
                self._backward_began = True
            if "backward_begins" in self._asks:
                self.plan.backward_begins()

    def _unpack_kept(self, group: GroupT, packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        t, version = packed
        if compat.in_backward():
            if not self._backward_began:
                self._backward_begins()
            if not group.reached:  # its first unpack (each later one costs nothing)
                self._reached(group)
        if t._version != version:
            raise modified_error(group, t.shape, version, t._version)
        return t

    def _unpack(self, handle: Handle | MultiHandle | DelegatedHandle) -> torch.Tensor:
        if isinstance(handle, DelegatedHandle):
            if compat.in_backward() and not self._backward_began:
                self._backward_begins()
            return handle.unpack(handle.packed)
        group: GroupT = handle.group  # type: ignore[assignment]
        if not (group.reached and self._backward_began) and compat.in_backward():  # (both once a pass)
            if not self._backward_began:
                self._backward_begins()
            if not group.reached:
                self._reached(group)
        # (read outside backward, as graph viewers read grad_fn._saved_*: restored, nothing more)
        return self._restore_handle(handle)

    def _reached(self, group: GroupT) -> None:
        """Backward's first unpack of ``group``: a group not committed yet stays resident; the
        plan hears of it, and the implementation may start reloads."""
        if group.state is GroupState.PENDING:
            self._freeze(group)
        with self._lock:
            if group.reached:
                return
            group.reached = True
        if "reached" in self._asks:
            self.plan.reached(group)
        if self._tells_reached:
            self._backward_reaches(group)

    def _restore_handle(self, handle: Handle | MultiHandle) -> torch.Tensor:
        group: GroupT = handle.group  # type: ignore[assignment]
        if isinstance(handle, Handle):
            return self._restore(group, handle.saved)
        if handle.guard is not None and handle.guard._version != handle.version:
            raise modified_error(group, handle.shape, handle.version, handle.guard._version)
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
        if s.cloned and s.guard is not None:
            held = s.guard  # the original's version counter
        if held._version != s.version:
            if group.recompute:
                self.plan.inputs_written(group)
            if not self._copied_before_write(group, s):
                shape = s.view.size if s.view is not None else (s.tensor if s.tensor is not None else held).shape
                raise modified_error(group, shape, s.version, held._version)
        if s.tensor is not None:
            t = s.tensor
            if group.release_inputs and s.derived and compat.in_backward() and not compat.backward_keeps_graph():
                # A memory plan's recomputed group saves only its inputs, and its recomputation is
                # their one use in this pass: let go of them, so that they are freed with what the
                # recomputation saved (as reloaded inputs are, which is what the plan's model
                # measured), not only when the group's whole backward is over. Leaves and
                # constants stay: something else holds them anyway.
                s.tensor = None
                if s.cloned:
                    s.guard = None
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

    @staticmethod
    def _copied_before_write(group: Group, s: SavedBuffer) -> bool:
        """An input a plan's recomputed group saved, written in place after its forward, whose
        copy holds the bytes as saved: the recomputation reads that copy, as the forward read
        the input (autograd itself saved no such tensor, so it raises nothing either)."""
        copied = s.view is not None and s.view.moved.version_at_copy == s.version
        # (not where the module wrote it in its own forward: the copy came after that write)
        return group.guard_inputs and not group.wrote_inputs and (copied or s.cloned)

    # ------------------------------------------------------------------ stats
    def _stats(self) -> dict[str, Any]:
        with self._lock:
            for ref in list(self._pending):  # not committed yet: report as keep_last would leave them
                g = ref()
                if g is not None and g.state is GroupState.PENDING and not g.kept_whole:
                    self._plan(g, committed=False)
            let_go = self._let_go_names()
            groups = {name: {k: dict(v) if isinstance(v, dict) else v for k, v in s.items()}
                      for name, s in list(self._window.items()) if s and name not in let_go}
        in_use, pooled = self._host_bytes()
        return {
            "impl": self.impl,
            "groups": groups,
            "offloaded_bytes": sum(g["offloaded_bytes"] for g in groups.values()),
            "host_bytes_in_use": in_use,
            "host_bytes_pooled": pooled,
            **self.plan.stats(),
        }

