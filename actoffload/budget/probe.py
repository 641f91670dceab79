"""What the budget controller reads from the device: memory and time, measured.

On CUDA: the caching allocator's counters and CUDA events. On the CPU there is no
allocator to read: memory reads zero (the plan then rests on the bytes the groups save,
which the engine knows) and time is the host clock; that keeps every code path of the
controller testable without a GPU.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..hostmem import exact_host_allocator
from ..settings import device_memory
from .reclaim import reclaim_above

_BANDWIDTH: dict[str, tuple[float, float]] = {}  # device -> (d2h, h2d) bytes per second


class Probe:
    """Device memory and time for one device. The budget controller reads the device only
    through these methods (and ``cuda``), so a test or a diagnostic may hand it an object of
    its own with the same methods (``BudgetController(..., probe=...)``).

    Example::

        probe = Probe(torch.device("cuda"))
        probe.reset_peak(); t0 = probe.mark()
        ...                                   # device work
        probe.peak(), probe.seconds(t0, probe.mark())
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # the device works on while the host goes ahead: host work beside the step (planning in
        # a helper process) costs the step nothing where the host waits on the device anyway
        self.asynchronous = self.cuda
        self._host_allocations: Callable[[], int | None] = lambda: None

    def count_host_allocations(self, count: Callable[[], int | None]) -> None:
        """Read the offloader's host allocations so far through ``count`` (:meth:`host_allocations`)."""
        self._host_allocations = count

    def host_allocations(self) -> int | None:
        """Host buffers the offloader has allocated so far (``None``: not counted): a step
        that pinned none ran at its plan's pace."""
        return self._host_allocations()

    def allocated(self) -> int:
        return self._stat("allocated_bytes", "current")

    def peak(self) -> int:
        """The most bytes allocated since the last :meth:`reset_peak`."""
        return self._stat("allocated_bytes", "peak")

    def peak_reserved(self) -> int:
        """The most bytes the caching allocator held from the device since the last
        :meth:`reset_peak` (what runs out: allocated bytes, its rounding, and its cache)."""
        return self._stat("reserved_bytes", "peak")

    def reserved(self) -> int:
        """The bytes the caching allocator holds from the device now."""
        return self._stat("reserved_bytes", "current")

    def _stat(self, kind: str, field: str) -> int:
        """One of the allocator's counters, from its nested statistics: ``torch.cuda.memory_allocated``
        and its kin flatten every counter in Python first (about 0.5 ms a read on an H200's host,
        five or six reads a step), where the nested ones come as they are (0 before CUDA starts)."""
        if not self.cuda:
            return 0
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        return int(stats.get(kind, {}).get("all", {}).get(field, 0))

    def trim(self) -> None:
        """Give the allocator's cached blocks back to the device (``torch.cuda.empty_cache``)."""
        if self.cuda:
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()

    def reclaim_above(self, budget: int, owner: object) -> str:
        """Have the allocator give idle cached blocks back before it grows past ``budget``,
        while ``owner`` lives (:mod:`~.reclaim`); what was done, in words."""
        return reclaim_above(self.device, budget, owner)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_totals(self) -> tuple[int, int]:
        """``(total, outside)``: the device's memory, and what is held on it outside this
        process's PyTorch allocator (other processes, this process's CUDA context, NCCL's
        buffers): on CUDA ``total - free - reserved`` from ``torch.cuda.mem_get_info`` and the
        allocator's reserved bytes (its cache is this process's to reuse, so it is not outside).
        On the CPU: the machine's RAM, and nothing outside (the budget there counts only what
        the groups save). What a share of the device's memory as a budget rests on
        (:func:`actoffload.settings.budget_of`), read at the first step."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            return total, max(0, total - free - self.reserved())
        return device_memory(self.device), 0

    def mark(self) -> Any:
        """A point in time on the compute stream (an event on CUDA)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def host_clock(self) -> float | None:
        """The host's own clock, apart from the device's (``None`` on the CPU, where the two
        are one): whether a step waits on the host shows where the host's time for a piece of
        work reaches the device's."""
        return time.perf_counter() if self.cuda else None

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (waits for ``end`` on CUDA)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def bandwidth(self) -> tuple[float, float]:
        """Pinned copy bandwidth ``(device to host, host to device)`` in bytes per second,
        measured once per device and process (the bus does not change)."""
        if not self.cuda:
            return 10e9, 10e9  # a nominal figure: CPU "copies" are memcpy
        key = str(self.device)
        if key not in _BANDWIDTH:
            _BANDWIDTH[key] = self._measure_bandwidth()
        return _BANDWIDTH[key]

    def _measure_bandwidth(self) -> tuple[float, float]:
        n = 64 << 20
        dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        host = exact_host_allocator(n, pinned=True)
        out = []
        for copy in (lambda: host.copy_(dev, non_blocking=True), lambda: dev.copy_(host, non_blocking=True)):
            copy()  # warm up
            start = self.mark()
            for _ in range(3):
                copy()
            out.append(3 * n / self.seconds(start, self.mark()))
        return out[0], out[1]
