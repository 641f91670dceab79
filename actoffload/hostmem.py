"""Host memory for offloaded bytes: one allocator, one budget, one error.

Every host buffer an offloader fills comes from :meth:`HostMemory.allocate`, which counts
it against the host budget until it is freed. The allocator is injectable (tests inject
failures, a user may bring their own pinned arena); the default pins exactly the bytes
asked for when the device is CUDA.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
import weakref
from typing import Callable, Iterable, TypeVar

import torch

from . import compat
from .locks import OwnedLock
from .settings import memory_fraction

HostAllocator = Callable[[int, bool], torch.Tensor]
"""``allocator(nbytes, pinned) -> torch.Tensor``: a 1-D uint8 CPU tensor of ``nbytes``."""

HOST_BUDGET_FRACTION = 0.8  # of this machine's RAM, shared among the local ranks


class Finalizers:
    """``add(obj, fn, *args)``: call ``fn(*args)`` once ``obj`` is freed, while this object
    lives. A weak reference with a callback, kept in a dict: an eighth of the cost of
    ``weakref.finalize`` (which registers each one for the interpreter's exit), and a commit
    that moves a few bytes made several."""

    def __init__(self) -> None:
        self._pending: dict[weakref.ref, tuple[Callable[..., None], tuple]] = {}
        self._fire_when_freed = self._fire  # (one bound method for every reference, not one each)

    def add(self, obj: object, fn: Callable[..., None], *args: object) -> None:
        self._pending[weakref.ref(obj, self._fire_when_freed)] = (fn, args)

    def _fire(self, ref: weakref.ref) -> None:
        entry = self._pending.pop(ref, None)
        if entry is not None:
            entry[0](*entry[1])

    def __len__(self) -> int:
        return len(self._pending)


class HostMemoryError(MemoryError):
    """Host memory for a commit could not be had; the group stays resident (R10)."""


HUGE_PAGE = 2 << 20


def _huge_page_backed(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory, in 2 MiB pages where the kernel allows, with its
    pages faulted in by all cores: locking 512 times fewer, already present pages is what
    makes pinning about twice as fast as pinning a plain allocation."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no transparent huge pages here
        region.madvise(mmap.MADV_HUGEPAGE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    host.zero_()
    return host


def exact_host_allocator(nbytes: int, pinned: bool) -> torch.Tensor:
    """A new host buffer of exactly ``nbytes``, page-locked in place when ``pinned``. Pinning
    is slow, so this suits a caller that keeps its buffers (fast's pool)."""
    if pinned and nbytes >= HUGE_PAGE:
        host = _huge_page_backed(nbytes)
    else:
        host = torch.empty(nbytes, dtype=torch.uint8)
    if pinned:
        compat.pin_exactly(host)
    return host


def cached_host_allocator(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host buffer from PyTorch's pinned-memory cache (sizes rounded up to a power of two,
    freed buffers reused): suits a caller that allocates and frees every step (ref)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def machine_ram() -> int:
    """Bytes of RAM this process may use: the cgroup limit where there is one, else all."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def host_budget_of(spec: int | str) -> int:
    """Bytes a host budget parsed by :func:`~actoffload.settings.parse_memory_budget` means: a
    size stands as given; a share of this machine's RAM (``"auto"``: :data:`HOST_BUDGET_FRACTION`,
    the default) is divided among the ranks of this host (``LOCAL_WORLD_SIZE``), whose
    offloaders share that RAM.

    >>> host_budget_of(1 << 30), host_budget_of("50%") == int(machine_ram() * 0.5) // local_ranks()
    (1073741824, True)
    """
    if isinstance(spec, int):
        return spec
    fraction = HOST_BUDGET_FRACTION if spec == "auto" else memory_fraction(spec)
    assert fraction is not None
    ram, ranks = machine_ram(), local_ranks()
    share = int(ram * fraction) // ranks
    if share < 1 << 20:  # nothing a plan could offload into: say so now, not at the first step
        raise ValueError(f"host_budget={spec!r} leaves {share} bytes of this machine's {ram:,} bytes of RAM"
                         f"{f' for each of its {ranks} local ranks (LOCAL_WORLD_SIZE)' if ranks > 1 else ''}; "
                         f"give a larger share or a size such as '8GiB'")
    return share


def local_ranks() -> int:
    """The ranks of this host (``LOCAL_WORLD_SIZE``, as torchrun sets it, else one)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a count of ranks (a whole number of at least 1, "
                         f"as torchrun sets it): the host budget's share of RAM is divided among them; "
                         f"set it right or unset it")
    return int(value)


class HostMemory:
    """Allocates host buffers through ``allocator`` and keeps their total under ``budget``.

    Example::

        host = HostMemory(exact_host_allocator, pinned=False, budget=1 << 30)
        buf = host.allocate(4096)          # counted until ``buf`` is freed
        host.allocated                     # 4096
    """

    def __init__(self, allocator: HostAllocator, pinned: bool, budget: int):
        self._allocator = allocator
        self.pinned = pinned
        self.budget = budget
        self._lock = OwnedLock()  # _count, a finalizer, may run inside a section holding it
        self.allocated = 0  # bytes of live buffers from this object
        self._freed = Finalizers()
        self._uncount = self._count  # (one bound method for every buffer's finalizer, not one each)
        # PyTorch's own allocators give what they are asked for; an injected one is checked
        self._trusted = allocator in (exact_host_allocator, cached_host_allocator)

    def _count(self, delta: int) -> None:
        self._lock.run(self._add, delta)

    def _add(self, delta: int) -> None:
        self.allocated += delta

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes``, or :class:`HostMemoryError` naming what was short."""
        with self._lock:  # checked and counted at once: a pool may allocate on two threads
            if self.allocated + nbytes > self.budget:
                raise HostMemoryError(
                    f"offloading {nbytes:,} more bytes would exceed the host budget of {self.budget:,} bytes "
                    f"({self.allocated:,} in use); the group stays resident. Raise host_budget, offload less "
                    "(min_offload_bytes, keep_last, policy='marked')."
                )
            self.allocated += nbytes
        try:
            host = self._allocator(nbytes, self.pinned)
            if not self._trusted and not isinstance(host, torch.Tensor):
                raise TypeError(f"the host allocator returned a {type(host).__name__}; it must return a 1-D uint8 "
                                f"CPU tensor of exactly {nbytes} bytes")
            if not self._trusted and (host.dtype != torch.uint8 or host.dim() != 1 or host.numel() != nbytes
                                      or host.device.type != "cpu"):
                raise TypeError(
                    f"the host allocator returned a {tuple(host.shape)} {host.dtype} tensor on {host.device}; "
                    f"it must return a 1-D uint8 CPU tensor of exactly {nbytes} bytes"
                )
        except (RuntimeError, MemoryError, OSError) as e:  # (OSError: a mapping refused)
            self._count(-nbytes)
            raise HostMemoryError(
                f"could not allocate {nbytes:,} bytes of host memory to offload into ({e}); the group "
                "stays resident. Raise min_offload_bytes or keep_last, or free host memory."
            ) from e
        except BaseException:
            self._count(-nbytes)
            raise
        self._freed.add(host, self._uncount, -nbytes)
        return host


T = TypeVar("T")


def allocate_all(sizes: Iterable[int], get: Callable[[int], T], give_back: Callable[[T], None] | None = None) -> list[T]:
    """One host buffer per size from ``get``, or none: where one cannot be had (any error,
    :class:`HostMemoryError` among them), those already had go back through ``give_back`` (without
    it, they are let go: the error's traceback holds none of them) and the error is raised. A
    commit moves all of a group or nothing (R10).

    >>> allocate_all([4, 8], lambda n: bytearray(n))
    [bytearray(b'\\x00\\x00\\x00\\x00'), bytearray(b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00')]
    """
    had: list[T] = []
    try:
        for n in sizes:
            had.append(get(n))
    except BaseException:
        if give_back is not None:
            for b in had:
                give_back(b)
        had.clear()
        raise
    return had
