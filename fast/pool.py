"""A pinned host memory pool, reused across steps and sized by bytes.

Blocks come in size classes a little larger than asked (less than 1/32 more at any size,
exact below 64 bytes, so host memory in use stays within R9's 5% of what was offloaded
however small the tensors) and go back to a free list when the data in them dies. The same model asks for the same sizes every step, so
after the first step no host memory is allocated at all.

A block's ``fence`` is the event after which the last copy *reading* it (a reload)
is done; whoever writes into a reused block makes its stream wait on that fence
first, so a block is never overwritten under an in-flight copy and the host never
waits.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable

import torch


def size_class(nbytes: int) -> int:
    """Round up to a multiple of 1/32 of the size's power of two (exact below 64 bytes): less
    than 1/32 more than asked at any size. (A 64-byte minimum held 16 times the bytes of a
    4-byte tensor, breaking R9's bound where ``min_offload_bytes`` lets tiny tensors move.)

    >>> size_class(4), size_class(1000), size_class(1 << 20), size_class((1 << 20) + 1)
    (4, 1008, 1048576, 1081344)
    """
    granule = 1 << max(0, nbytes.bit_length() - 6)
    return (nbytes + granule - 1) // granule * granule


class HostBlock:
    """One pooled host buffer: ``tensor`` holds ``size`` bytes."""

    __slots__ = ("tensor", "size", "fence")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.size = tensor.numel()
        self.fence = None


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
        pool.put(block)                # reused by the next get() of the same class
        pool.reserve([1 << 30])        # allocated meanwhile; pool.reserving says how much is left
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]):
        self._allocate = allocate
        self._free: dict[int, list[HostBlock]] = {}
        self._lock = threading.Lock()
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
            free = self._free.get(size)
            if free:
                block = free.pop()
                self.pooled -= size
                self.in_use += size
                return block
        block = HostBlock(self._allocate(size))  # may raise HostMemoryError: nothing changed
        with self._lock:
            self.allocations += 1
            self._owned[size] += 1
            self.in_use += size
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
                    self._free.setdefault(size, []).append(block)
                    self.pooled += size
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
        with self._lock:
            self._free.setdefault(block.size, []).append(block)
            self.in_use -= block.size
            self.pooled += block.size

    def put_all(self, blocks: list[HostBlock]) -> None:
        for b in blocks:
            self.put(b)

    def trim(self) -> int:
        """Free every pooled block; returns the bytes released."""
        with self._lock:
            released, self.pooled = self.pooled, 0
            for size, blocks in self._free.items():
                self._owned[size] -= len(blocks)
            self._free.clear()
        return released
