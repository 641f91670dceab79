"""Group lifecycle shared by every implementation: hooks, commit schedule, checks, stats.

An implementation (``ref``, ``fast``) subclasses :class:`OffloaderBase` and supplies
only *how bytes move*: :meth:`~OffloaderBase._move_out` at commit,
:meth:`~OffloaderBase._device_bytes` at unpack, and optionally
:meth:`~OffloaderBase._on_backward`. *What* moves is decided by
:func:`actoffload.policy.plan_group`; *when* a group commits (R4's keep_last rule),
the version check (R6), the multi-buffer protocol (R7) and lifetimes (R8) live here,
once.

Lifetimes: the graph owns the pack handles, handles own their group, a group owns
its saved buffers and their host copies. The offloader keeps only weak references
to groups, so freeing the graph frees everything (R8).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import multibuffer, policy

# Group states
OPEN, PENDING, COMMITTED, RESIDENT, ABORTED = "open", "pending", "committed", "resident", "aborted"

_local = threading.local()  # .open: name of the group open on this thread (groups do not nest)


def group_open() -> bool:
    """Whether an offload group is open on this thread (ops skip offload work otherwise)."""
    return getattr(_local, "open", None) is not None


class HostMemoryError(MemoryError):
    """Pinned host memory ran out while committing a group; the group stays resident."""


class SavedBuffer:
    """One plain tensor saved in a group: resident (``tensor``) or moved (``moved``).

    ``tensor`` is a ``detach()``ed alias: same storage and version counter, but no
    ``grad_fn``. Holding the saved tensor itself would, for an op's output, close a
    cycle through the C++ autograd node (tensor -> grad_fn -> handle -> group ->
    tensor) that Python's garbage collector cannot see, and a graph freed without
    backward would leak.
    """

    __slots__ = ("tensor", "is_parameter", "version", "guard", "moved", "dtype", "size", "stride", "offset")

    def __init__(self, t: torch.Tensor):
        self.is_parameter = policy.is_parameter(t)  # detach() forgets it
        self.tensor: torch.Tensor | None = t.detach()
        self.version = t._version
        self.guard: torch.Tensor | None = None
        self.moved: Moved | None = None


class Moved:
    """A span that was moved off the device; implementations hang their state on it.

    ``storage`` is the device storage the span lives in, referenced until the
    implementation has copied it out (and releases it).
    """

    def __init__(self, span: policy.Span, storage: torch.UntypedStorage, device: torch.device):
        self.span = span
        self.nbytes = span.nbytes
        self.storage: torch.UntypedStorage | None = storage
        self.device = device
        self.host: torch.Tensor | None = None

    def source(self) -> torch.Tensor:
        """The span's bytes on the device, as a flat uint8 tensor sharing the storage."""
        out = torch.empty(0, dtype=torch.uint8, device=self.device)
        return out.set_(self.storage, self.span.start, (self.nbytes,), (1,))

    def source_ptr(self) -> int:
        return self.storage.data_ptr() + self.span.start


class Group:
    """The saved buffers of one forward of one group."""

    def __init__(self, name: str, prev: "Group | None"):
        self.name = name
        self.saved: list[SavedBuffer] = []
        self.state = OPEN
        self.opened_after = 0  # groups of the same offloader opened since this one
        self.moved: list[Moved] = []
        self.summary: dict = {"saved": 0, "offloaded": 0, "offloaded_bytes": 0, "kept": {}}
        self.prev = weakref.ref(prev) if prev is not None else None  # group opened before this one

    def add(self, t: torch.Tensor) -> SavedBuffer:
        s = SavedBuffer(t)
        self.saved.append(s)
        return s


class _Handle:
    """What the pack hook returns for a plain tensor; the graph owns it."""

    __slots__ = ("group", "saved")

    def __init__(self, group: Group, saved: SavedBuffer):
        self.group = group
        self.saved = saved


class _MultiHandle:
    """What the pack hook returns for a multi-buffer tensor (R7)."""

    __slots__ = ("group", "cls", "state", "saved")

    def __init__(self, group: Group, cls: type, state: Any, saved: list[SavedBuffer | None]):
        self.group = group
        self.cls = cls
        self.state = state
        self.saved = saved


class WeakStorage:
    """A weak reference to a storage: ``get()`` gives it back while anything still uses it.

    Restored tensors reach their reload buffer only through its storage (autograd
    re-wraps what an unpack hook returns), so a weak reference to the storage, not to
    a tensor object, is what tells whether a reload is still alive.
    """

    __slots__ = ("_ref",)

    def __init__(self, t: torch.Tensor):
        self._ref = StorageWeakRef(t.untyped_storage())

    def get(self, device: torch.device) -> torch.Tensor | None:
        """A flat uint8 tensor over the whole storage, or ``None`` once it was freed."""
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _version_guard(t: torch.Tensor) -> torch.Tensor:
    """A storage-less tensor sharing ``t``'s version counter (R6 after ``t`` is dropped).

    ``detach()`` shares the version counter; assigning ``.data`` swaps the storage out
    but keeps the counter, so in-place writes to ``t`` or any view of it still show.
    """
    guard = t.detach()
    guard.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return guard


class GroupContext:
    """Context manager returned by :meth:`OffloaderBase.group`."""

    def __init__(self, offloader: "OffloaderBase", name: str):
        self._offloader = offloader
        self._name = name
        self._group: Group | None = None
        self._hooks = None

    def __enter__(self) -> "GroupContext":
        self._group, self._hooks = self._offloader._enter(self._name)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        group, hooks = self._group, self._hooks
        self._group = self._hooks = None
        self._offloader._exit(group, hooks, failed=exc_type is not None)
        return False


class OffloaderBase:
    """Shared behaviour of every implementation; see ``actoffload.Offloader`` for the API."""

    impl = "base"

    def __init__(self, device, min_offload_bytes, policy_name, keep_last, prefetch):
        self.device = device
        self._cuda = device.type == "cuda"
        self.min_offload_bytes = min_offload_bytes
        self.policy = policy_name
        self.keep_last = keep_last
        self.prefetch = prefetch
        self._lock = threading.RLock()
        self._pending: list[weakref.ref] = []  # exited, not yet committed, in open order
        self._latest: dict[str, dict] = {}  # group name -> summary of its latest forward
        self._last_group: weakref.ref | None = None

    # ------------------------------------------------------------------ groups
    def group(self, name: str) -> GroupContext:
        """A unit of saved activations offloaded and reloaded together (R2).

        Example::

            off = ao.Offloader()
            for i, block in enumerate(blocks):
                with off.group(f"block{i}"):
                    x = block(x)
            x.sum().backward()
        """
        if not isinstance(name, str):
            raise TypeError(f"group name must be a str, got {type(name).__name__}")
        return GroupContext(self, name)

    def _enter(self, name: str):
        open_name = getattr(_local, "open", None)
        if open_name is not None:
            raise RuntimeError(
                f"cannot open group {name!r} inside group {open_name!r}: groups do not nest (R2); "
                "close the outer group first, or wrap the inner modules instead of the outer one"
            )
        self._advance_schedule(opening=True)
        prev = self._last_group() if self._last_group is not None else None
        group = Group(name, prev)
        self._last_group = weakref.ref(group)
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t, _g=group: self._pack(_g, t), self._unpack
        )
        hooks.__enter__()
        _local.open = name
        return group, hooks

    def _exit(self, group: Group, hooks, failed: bool) -> None:
        _local.open = None
        hooks.__exit__(None, None, None)
        with self._lock:
            if failed:
                # Never committed; it stays with its graph and is freed with it (R8).
                group.state = ABORTED
                return
            group.state = PENDING
            self._latest[group.name] = group.summary
            self._pending.append(weakref.ref(group))
        if self.keep_last == 0:
            self._advance_schedule(opening=False)

    def _advance_schedule(self, opening: bool) -> None:
        """Commit every pending group after which ``keep_last`` groups have opened (R4).

        Called when a group opens (``opening``) and, for ``keep_last=0``, when one exits.
        """
        due: list[Group] = []
        with self._lock:
            waiting = []
            for ref in self._pending:
                g = ref()
                if g is None or g.state != PENDING:
                    continue  # freed with its graph, or its backward already began
                g.opened_after += opening
                if g.opened_after >= self.keep_last:
                    due.append(g)
                else:
                    waiting.append(ref)
            self._pending = waiting
        for g in due:
            self._commit(g)

    def _plan(self, group: Group, committed: bool) -> policy.GroupPlan:
        plan = policy.plan_group(
            [s.tensor for s in group.saved],
            parameters=[s.is_parameter for s in group.saved],
            device=self.device,
            min_offload_bytes=self.min_offload_bytes,
            policy=self.policy,
            committed=committed,
        )
        group.summary.clear()
        group.summary.update(plan.summary())
        return plan

    def _commit(self, group: Group) -> None:
        """Decide (policy) and start moving what the plan says (implementation)."""
        plan = self._plan(group, committed=True)
        moved = [Moved(span, group.saved[span.members[0]].tensor.untyped_storage(), self.device) for span in plan.spans]
        try:
            self._move_out(group, moved)
        except HostMemoryError:
            group.state = RESIDENT
            self._plan(group, committed=False)
            group.saved = []
            raise
        for m in moved:
            for i in m.span.members:
                s = group.saved[i]
                t = s.tensor
                s.dtype, s.size, s.stride = t.dtype, tuple(t.shape), t.stride()
                # offset inside the span, in elements: a whole number (policy.Span aligns start)
                s.offset = (t.storage_offset() * t.element_size() - m.span.start) // t.element_size()
                s.guard = _version_guard(t)
                s.moved = m
                s.tensor = None
        group.moved = moved
        group.state = COMMITTED
        group.saved = []  # decided: each buffer now lives exactly as long as its handle

    # ------------------------------------------------------------------ hooks
    def _pack(self, group: Group, t: torch.Tensor):
        if self._cuda and torch._C._cuda_isCurrentStreamCapturing():
            raise RuntimeError(
                "actoffload cannot offload inside a CUDA graph capture (R10): copies to host "
                "memory cannot be captured; capture outside any offload group"
            )
        if type(t) is not torch.Tensor and multibuffer.is_multibuffer(t):
            cls, state, buffers = multibuffer.split(t)
            return _MultiHandle(group, cls, state, [None if b is None else group.add(b) for b in buffers])
        return _Handle(group, group.add(t))

    def _unpack(self, handle) -> torch.Tensor:
        group = handle.group
        if group.state == PENDING:
            self._freeze(group)
        self._on_backward(group)
        if type(handle) is _MultiHandle:
            buffers = [None if s is None else self._restore(group, s) for s in handle.saved]
            return multibuffer.rebuild(handle.cls, handle.state, buffers)
        return self._restore(group, handle.saved)

    def _freeze(self, group: Group) -> None:
        """Backward began before the commit: the group stays resident (keep_last)."""
        with self._lock:
            if group.state != PENDING:
                return
            group.state = RESIDENT
        self._plan(group, committed=False)
        # Decided: each kept buffer is freed as soon as autograd releases its handle, node
        # by node, as without an offloader (not when the whole group's backward is over).
        group.saved = []

    def _restore(self, group: Group, s: SavedBuffer) -> torch.Tensor:
        now = (s.tensor if s.tensor is not None else s.guard)._version
        if now != s.version:
            raise RuntimeError(
                f"one of the tensors saved for backward in offload group {group.name!r} "
                f"(shape {list(s.size if s.tensor is None else s.tensor.shape)}) was modified by an "
                f"in-place operation after it was saved: version {s.version} at save, {now} now (R6). "
                "Use an out-of-place operation, or clone the tensor before modifying it."
            )
        if s.tensor is not None:
            return s.tensor
        dev = self._device_bytes(group, s.moved)
        # dev starts at the span's first byte, which policy.Span aligns for every alias
        out = torch.empty(0, dtype=s.dtype, device=dev.device)
        return out.set_(dev.untyped_storage(), dev.storage_offset() // out.element_size() + s.offset, s.size, s.stride)

    # ------------------------------------------------------------------ host memory
    def _raw_host_alloc(self, nbytes: int) -> torch.Tensor:
        """One host buffer, pinned when the device is CUDA (tests replace this to inject faults)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _alloc_host(self, nbytes: int) -> torch.Tensor:
        """Allocate host memory or raise :class:`HostMemoryError` naming the size (R10)."""
        try:
            return self._raw_host_alloc(nbytes)
        except (RuntimeError, MemoryError) as e:
            raise HostMemoryError(
                f"could not allocate {nbytes} bytes of host memory to offload into ({e}); the group "
                "stays resident. Raise min_offload_bytes or keep_last, or free host memory."
            ) from e

    # ------------------------------------------------------------------ implementation
    def _move_out(self, group: Group, moved: list[Moved]) -> None:
        """Copy each span's ``source`` to host memory (setting ``host``); may finish later."""
        raise NotImplementedError

    def _device_bytes(self, group: Group, moved: Moved) -> torch.Tensor:
        """The span's bytes back on the device, ready on the current stream.

        A flat uint8 tensor of at least ``moved.nbytes`` bytes starting at the span's
        first byte (a fresh buffer, or the original storage while it still lives).
        """
        raise NotImplementedError

    def _on_backward(self, group: Group) -> None:
        """Called at every unpack; implementations may start reloads here."""

    def _host_bytes(self) -> tuple[int, int]:
        """``(in_use, pooled)`` host bytes."""
        raise NotImplementedError

    def _extra_stats(self) -> dict:
        return {}

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """What the latest forward of each group did, and host memory now.

        Example::

            s = off.stats()
            s["groups"]["block0"]   # {'saved': 7, 'offloaded': 5, 'offloaded_bytes': ..., 'kept': {'parameter': 2}}
            s["host_bytes_in_use"]  # 0 once every graph is freed
        """
        with self._lock:
            for ref in self._pending:  # not committed yet: report as keep_last would leave them
                g = ref()
                if g is not None and g.state == PENDING:
                    self._plan(g, committed=False)
            groups = {name: {k: dict(v) if isinstance(v, dict) else v for k, v in s.items()}
                      for name, s in self._latest.items()}
        in_use, pooled = self._host_bytes()
        out = {
            "impl": self.impl,
            "groups": groups,
            "offloaded_bytes": sum(g["offloaded_bytes"] for g in groups.values()),
            "host_bytes_in_use": in_use,
            "host_bytes_pooled": pooled,
        }
        out.update(self._extra_stats())
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={str(self.device)!r}, min_offload_bytes={self.min_offload_bytes}, "
            f"policy={self.policy!r}, keep_last={self.keep_last}, prefetch={self.prefetch})"
        )

