"""A pinned host memory pool, reused across steps and sized by bytes.

Blocks come in size classes a little larger than asked (less than 1/32 more at any size,
exact below 64 bytes, and a piece cut from a larger block less than a page more again, so
host memory in use stays within R9's 5% of what was offloaded however small the tensors)
and go back to a free list when the data in them dies. The same model asks for the same
sizes every step, so after the first step no host memory is allocated at all.

A request of a class with no free block is carved out of the smallest larger free block
(from 1 MiB on, at a page boundary), and pieces freed beside each other in one allocation
join again: a step of another sequence length reuses what a longer one pinned instead of
pinning anew (on an H200 the decoder's first 1536-token step after 2048-token ones pinned
26-45 new blocks and took 295-472 ms where checkpointing took 84-99; cut from the longer
steps' blocks, it pinned 4 and took 162 ms), and once every piece is back the allocation is
whole again for the longer step.

A block's ``fence`` is the event after which the last copy *reading* it (a reload)
is done; whoever writes into a reused block makes its stream wait on that fence
first (and on those of the pieces it was joined from), so a block is never overwritten
under an in-flight copy and the host never waits.

Free blocks are host memory held, and count against the host budget: where an allocation
would pass it, the free blocks that are whole allocations are let go (once the copies using
them are done) and the allocation is asked again, so that a step of a shorter length, whose
size classes the longer step's blocks cannot serve, fits the budget the longer one did. A
free piece of an allocation another piece of which is in use cannot be let go: with blocks
cut from larger ones (from 1 MiB), a shorter step may still find the budget short.

Blocks go back from finalizers (a copy record's), which may run inside one of the pool's
own sections on the same thread (a garbage-collection pass begun at an allocation there):
such a block is handed to the section, which puts it back as it ends
(:class:`~actoffload.locks.OwnedLock`).
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Callable, Iterable

import torch

from actoffload.hostmem import HostMemoryError
from actoffload.locks import OwnedLock


def size_class(nbytes: int) -> int:
    """Round up to a multiple of 1/32 of the size's power of two (exact below 64 bytes): less
    than 1/32 more than asked at any size. (A 64-byte minimum held 16 times the bytes of a
    4-byte tensor, breaking R9's bound where ``min_offload_bytes`` lets tiny tensors move.)

    >>> size_class(4), size_class(1000), size_class(1 << 20), size_class((1 << 20) + 1)
    (4, 1008, 1048576, 1081344)
    """
    granule = 1 << max(0, nbytes.bit_length() - 6)
    return (nbytes + granule - 1) // granule * granule


SPLIT_MIN = 1 << 20  # requests from this size on may be carved out of a larger free block
PAGE = 4096  # where a block is cut: pieces start a whole number of pages into their allocation


class HostBlock:
    """One pooled host buffer: ``tensor`` holds ``size`` bytes, at ``offset`` in ``slab``, the
    allocation it is part of. ``fence``: the last read of it; ``earlier``: reads of the pieces
    it was joined from (or of the block it was cut from), not yet known to be done."""

    __slots__ = ("tensor", "size", "fence", "earlier", "slab", "offset")

    def __init__(self, tensor: torch.Tensor, slab: torch.Tensor | None = None, offset: int = 0):
        self.tensor = tensor
        self.size = tensor.numel()
        self.fence = None
        self.earlier: tuple = ()
        self.slab = tensor if slab is None else slab
        self.offset = offset

    def waits(self) -> tuple:
        """The events a writer into this block waits for first."""
        return self.earlier if self.fence is None else (self.fence, *self.earlier)

    def read_until(self, event) -> None:
        """A copy reads (or writes) this block until ``event``: the next writer, and whoever
        frees it, waits for it (and, as the copy ran after its writer, which waited for the
        earlier reads, for nothing else)."""
        self.fence, self.earlier = event, ()

    def _part(self, start: int, end: int) -> "HostBlock":
        part = HostBlock(self.slab[self.offset + start : self.offset + end], self.slab, self.offset + start)
        part.fence, part.earlier = self.fence, self.earlier
        return part


def _pending(events) -> tuple:
    """``events`` less those known to be done (a query, not a wait)."""
    return tuple(e for e in events if e is not None and not e.query())


class PinnedPool:
    """Size-classed free lists of host buffers.

    :meth:`reserve` allocates blocks on a background thread, into the free lists: a fresh
    fast offloader that recomputes while it warms up asks for the blocks its steps will
    need, so that pinning (slow: the pages are touched and locked) runs while the GPU works
    instead of in front of each copy.

    Example::

        pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        block = pool.get(3 << 20)      # at least 3 MiB
        ...
        pool.put(block)                # reused by the next get() of the same class (or cut, from 1 MiB)
        pool.reserve([1 << 30])        # allocated meanwhile; pool.reserving says how much is left
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]):
        self._allocate = allocate
        self._free: dict[int, list[HostBlock]] = {}  # free blocks by size
        self._sizes: list[int] = []  # the sizes of free blocks, ascending (best fit)
        self._starts: dict[tuple[int, int], HostBlock] = {}  # free blocks by (allocation, offset)
        self._ends: dict[tuple[int, int], HostBlock] = {}  # free blocks by (allocation, offset of their end)
        # put() may run from a finalizer inside a section holding it (a collection pass that
        # began at an allocation there freed a copy record): it then hands its block over
        self._lock = OwnedLock()
        self._queue: collections.deque[int] = collections.deque()  # size classes to reserve
        self._owned: collections.Counter[int] = collections.Counter()  # blocks allocated, by size class
        self._expected: collections.Counter[int] = collections.Counter()  # blocks expected in use together
        self._worker: threading.Thread | None = None
        self.reserving = 0  # bytes reserved and not yet allocated
        self.reserve_error: Exception | None = None  # why reserving stopped early, if it did
        self.in_use = 0
        self.pooled = 0
        self.allocations = 0  # host allocations made so far (flat after the first step)

    def get(self, nbytes: int) -> HostBlock:
        size = size_class(nbytes)
        with self._lock:
            block = self._take(size)
            if block is not None:
                self.in_use += block.size
                return block
        block = HostBlock(self._new_allocation(size))
        with self._lock:
            self.allocations += 1
            self._owned[size] += 1
            self.in_use += size
        return block

    def _new_allocation(self, size: int) -> torch.Tensor:
        """``size`` bytes of new host memory; over the host budget, where what the free blocks
        hold counts too, those are let go first (may raise HostMemoryError: nothing taken)."""
        try:
            return self._allocate(size)
        except HostMemoryError:
            if not self.trim():
                raise  # nothing else to let go
        return self._allocate(size)  # asked again outside the handler: its error is the one to see

    def _take(self, size: int) -> HostBlock | None:
        """A free block of ``size``, else (from ``SPLIT_MIN`` on) one cut from the smallest larger
        free block, the rest staying free; ``None`` where there is none (the caller holds the lock)."""
        if self._free.get(size):
            return self._unlist(self._free[size][-1])
        if size < SPLIT_MIN:
            return None
        i = bisect.bisect_left(self._sizes, size)
        if i == len(self._sizes):
            return None
        block = self._unlist(self._free[self._sizes[i]][-1])
        cut = -(-size // PAGE) * PAGE
        if cut >= block.size:
            return block  # less than a page more than asked: whole
        self._list(block._part(cut, block.size))
        return block._part(0, cut)

    def _list(self, block: HostBlock) -> None:
        """Make ``block`` free (the caller holds the lock)."""
        free = self._free.setdefault(block.size, [])
        if not free:
            bisect.insort(self._sizes, block.size)
        free.append(block)
        key = id(block.slab)
        self._starts[key, block.offset] = block
        self._ends[key, block.offset + block.size] = block
        self.pooled += block.size

    def _unlist(self, block: HostBlock) -> HostBlock:
        """Take ``block`` off the free lists (the caller holds the lock)."""
        free = self._free[block.size]
        if free[-1] is block:
            free.pop()
        else:
            free.remove(block)
        if not free:
            del self._free[block.size]
            del self._sizes[bisect.bisect_left(self._sizes, block.size)]
        key = id(block.slab)
        del self._starts[key, block.offset]
        del self._ends[key, block.offset + block.size]
        self.pooled -= block.size
        return block

    def expect(self, sizes: Iterable[int]) -> Callable[[], None]:
        """Blocks of ``sizes`` will be in use along with those expected before: :meth:`reserve`
        those the pool neither owns nor has queued. Returns the call that says they no longer
        will be (their group is gone)."""
        classes = [size_class(n) for n in sizes]
        short = []
        with self._lock:
            for c in classes:
                self._expected[c] += 1
                if self._expected[c] > self._owned[c] + self._queue.count(c):
                    short.append(c)
        self.reserve(short)

        def done() -> None:
            with self._lock:
                self._expected.subtract(classes)

        return done

    def reserve(self, sizes: Iterable[int]) -> None:
        """Allocate a block for each of ``sizes`` on a background thread and pool it. A failure
        (over the host budget, out of memory) drops what is still queued and is kept in
        :attr:`reserve_error`; a later :meth:`get` of that size allocates, and says so."""
        classes = [size_class(n) for n in sizes]
        if not classes:
            return
        with self._lock:
            self.reserve_error = None
            self._queue.extend(classes)
            self.reserving += sum(classes)
            self._wake_worker()

    def _wake_worker(self) -> None:
        """Start the reserving thread if there is work and none runs (the caller holds the lock)."""
        if self._worker is None and self._queue:
            self._worker = threading.Thread(target=self._reserve_queued, daemon=True)
            self._worker.start()

    def _reserve_queued(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue:
                        return
                    size = self._queue[0]
                block = HostBlock(self._allocate(size))
                with self._lock:
                    self._queue.popleft()
                    self.allocations += 1
                    self._owned[size] += 1
                    self.reserving -= size
                    self._list(block)
        except Exception as e:  # noqa: BLE001  any failure stops reserving; get() then allocates, and says why
            with self._lock:
                self.reserve_error = e
                self._queue.clear()
                self.reserving = 0
        finally:
            with self._lock:
                self._worker = None
                self._wake_worker()  # reserved after the last look at the queue: serve it too

    def wait_reserved(self) -> None:
        """Wait until every reserved block is allocated (or reserving failed)."""
        while True:
            with self._lock:
                worker = self._worker
            if worker is None:
                return
            worker.join()
            with self._lock:
                if self._worker is worker:  # it ended without clearing itself: nothing will
                    self._worker = None

    def put(self, block: HostBlock) -> None:
        """``block`` is free again: joined with the free blocks beside it in its allocation."""
        self._lock.run(self._put_held, block)  # (maybe from a finalizer inside a section holding it)

    def _put_held(self, block: HostBlock) -> None:
        """:meth:`put` (the caller holds the lock)."""
        self.in_use -= block.size
        key = id(block.slab)
        before = self._ends.get((key, block.offset))
        after = self._starts.get((key, block.offset + block.size))
        if before is None and after is None:
            self._list(block)
            return
        first = self._unlist(before) if before is not None else block
        last = self._unlist(after) if after is not None else block
        joined = first._part(0, last.offset + last.size - first.offset)
        joined.fence = None
        joined.earlier = _pending(w for b in (before, block, after) if b is not None for w in b.waits())
        self._list(joined)

    def put_all(self, blocks: list[HostBlock]) -> None:
        for b in blocks:
            self.put(b)

    def trim(self) -> int:
        """Free every pooled block that is a whole allocation (a piece of one in use stays),
        once the copies that may still use it are done (waited for); returns the bytes released."""
        with self._lock:
            whole = [b for free in self._free.values() for b in free if b.offset == 0 and b.size == b.slab.numel()]
            for b in whole:
                self._unlist(b)
                self._owned[b.size] -= 1
        for b in whole:
            for event in _pending(b.waits()):
                event.synchronize()  # a copy may still use it: freed under the copy, pinned memory is reused
        return sum(b.size for b in whole)
