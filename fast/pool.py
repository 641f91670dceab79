"""A pinned host memory pool, reused across steps and sized by bytes.

Blocks come in size classes a little larger than asked (at most 1/32 more from 2 KiB
up, 64-byte granules below, so host memory in use stays within R9's 5% of what was
offloaded at any realistic size) and go back to a free list
when the data in them dies. The same model asks for the same sizes every step, so
after the first step no host memory is allocated at all.

A block's ``fence`` is the event after which the last copy *reading* it (a reload)
is done; whoever writes into a reused block makes its stream wait on that fence
first, so a block is never overwritten under an in-flight copy and the host never
waits.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


def size_class(nbytes: int) -> int:
    """Round up to a multiple of 1/32 of the size's power of two (at least 64 bytes).

    >>> size_class(1000), size_class(1 << 20), size_class((1 << 20) + 1)
    (1024, 1048576, 1081344)
    """
    if nbytes <= 64:
        return 64
    granule = max(64, 1 << (nbytes.bit_length() - 6))
    return (nbytes + granule - 1) // granule * granule


class Block:
    """One pooled host buffer: ``tensor`` holds ``size`` bytes."""

    __slots__ = ("tensor", "size", "fence")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.size = tensor.numel()
        self.fence = None


class PinnedPool:
    """Size-classed free lists of host buffers.

    With ``ahead``, a request the pool cannot serve also starts allocating one more block of
    its size class on a background thread: the groups of a first step ask for the same
    sizes one after another, and pinning host memory is slow (the pages are touched and
    locked), so the next group finds its block ready while the GPU was busy. At most one
    block per size class is allocated ahead; it stays pooled if nothing asks for it.

    Example::

        pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        block = pool.get(3 << 20)      # at least 3 MiB
        ...
        pool.put(block)                # reused by the next get() of the same class
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], ahead: bool = False):
        self._allocate = allocate
        self.ahead = ahead
        self._free: dict[int, list[Block]] = {}
        self._lock = threading.Lock()
        self._allocating: dict[int, threading.Thread] = {}  # size class -> allocating ahead
        self.in_use = 0
        self.pooled = 0
        self.allocations = 0  # host allocations made so far (flat after the first step)

    def get(self, nbytes: int) -> Block:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                block = free.pop()
                self.pooled -= size
                self.in_use += size
                return block
        block = Block(self._allocate(size))  # may raise HostMemoryError: nothing changed
        with self._lock:
            self.allocations += 1
            self.in_use += size
            if self.ahead and size not in self._allocating:
                thread = threading.Thread(target=self._allocate_ahead, args=(size,), daemon=True)
                self._allocating[size] = thread
                thread.start()
        return block

    def _allocate_ahead(self, size: int) -> None:
        try:
            block = Block(self._allocate(size))
        except MemoryError:  # over the host budget, or out of memory: the next get() will say so
            return
        finally:
            with self._lock:
                self._allocating.pop(size, None)
        with self._lock:
            self.allocations += 1
            self._free.setdefault(size, []).append(block)
            self.pooled += size

    def wait_ahead(self) -> None:
        """Wait until no block is being allocated ahead (for tests and shutdown)."""
        while True:
            with self._lock:
                threads = list(self._allocating.values())
            if not threads:
                return
            for t in threads:
                t.join()

    def put(self, block: Block) -> None:
        with self._lock:
            self._free.setdefault(block.size, []).append(block)
            self.in_use -= block.size
            self.pooled += block.size

    def put_all(self, blocks: list[Block]) -> None:
        for b in blocks:
            self.put(b)

    def trim(self) -> int:
        """Free every pooled block; returns the bytes released."""
        with self._lock:
            released, self.pooled = self.pooled, 0
            self._free.clear()
        return released
