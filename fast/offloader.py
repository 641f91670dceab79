"""The fast offloader: same decisions as ref, bytes moved off the critical path.

Mechanisms, each in its own module: copy streams and events (``streams.py``), the
pinned pool (``pool.py``), packing of small buffers (``packing.py``). This file is the
schedule that ties them together:

- **Commit** (a group's forward is over, ``keep_last`` later): the copy stream waits
  for an event on the compute stream, packs the group's small spans into one staging
  buffer with one Triton launch, and copies it and each large span into pool blocks.
  The sources stay referenced until the copy's event has fired (polled without
  blocking), so the allocator cannot hand their memory to new work before the copy has
  read it; at most ``max_inflight`` groups wait that way, older ones make the compute
  stream wait on their event instead (stream-ordered, still no host synchronization).
- **Backward**: the first unpack of a group starts its reload (if not prefetched) and
  the reload of the ``prefetch`` groups opened before it. Reload buffers are allocated
  on the compute stream (so its allocator reuses them when backward frees them); the
  reload stream first waits for that allocation point and for the group's offload copy.
  Every restored tensor makes the consuming stream wait on the reload's event: a
  reload is never used before it completes.
- **Lifetime**: a group's pool blocks go back to the pool when the group is freed with
  its graph; a block's fence (its last reload) orders its next reuse. A reload is held
  strongly until each of its saved buffers has been unpacked once, then only weakly,
  so ``retain_graph`` backwards reuse it while it lives and reload it otherwise.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

from actoffload.engine import COMMITTED, Group, Moved, OffloaderBase, WeakStorage

from .packing import Packer
from .pool import PinnedPool
from .streams import CopyStreams


class _Offloaded:
    """Fast's record of one committed group: pool blocks, packed layout, copy state."""

    __slots__ = ("blocks", "packed", "packed_offsets", "packed_total", "large", "done", "inflight", "reloading")

    def __init__(self):
        self.blocks = []
        self.packed: list[Moved] = []  # small spans, moved in one packed copy
        self.packed_offsets: list[int] = []
        self.packed_total = 0
        self.large: list[Moved] = []  # spans moved one copy each
        self.done = None  # event: every offload copy of the group has finished
        self.inflight = True  # its sources are still referenced (copy maybe not finished)
        self.reloading = False  # its reload was enqueued (or its sources reused)


class FastOffloader(OffloaderBase):
    """Stream-overlapped implementation; create it through ``actoffload.Offloader(impl="fast")``."""

    impl = "fast"
    pack_below = 4 << 20  # spans smaller than this share one packed copy (benchmarks/ chose it)
    # Groups whose copy out may still hold their device memory. More lets compute run
    # further ahead of a slower bus (d=2048 stack on an H100: 2 is 12% faster than 1) and
    # lets backward use more of the last groups in place; fewer lowers peak memory
    # (there: 3.76 vs 2.97 GiB, against 8.76 without offloading). Set per offloader.
    max_inflight = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._streams = CopyStreams(self.device)
        self._pool = PinnedPool(self._alloc_host)
        self._packer = Packer(self.device)
        self._inflight: collections.deque = collections.deque()  # (record, staging buffer, spans) whose copy out may run
        self._inflight_lock = threading.Lock()
        self.counters = collections.Counter()
        # Set to a list to record (direction, bytes, start event, end event) of every copy
        # batch, timed on the copy stream itself (benchmarks/ reads it; CUDA only).
        self.copy_timings: list | None = None

    def _timing_event(self):
        if self.copy_timings is None or self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, direction: str, nbytes: int, start) -> None:
        if start is not None:
            self.copy_timings.append((direction, nbytes, start, self._timing_event()))

    # ------------------------------------------------------------------ host memory
    def _raw_host_alloc(self, nbytes: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8)
        # Pin exactly nbytes: PyTorch's pinned allocator rounds to a power of two.
        host = torch.empty(nbytes, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0))
        weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
        return host

    def _release_blocks(self, blocks) -> None:
        for b in blocks:
            self._pool.put(b)

    def _group_freed(self, rec: "_Offloaded") -> None:
        """The graph let the group go: its host blocks return to the pool, and sources it
        still holds (reused in place by backward) are released once their copy is ordered."""
        self._release_blocks(rec.blocks)
        if rec.inflight:
            with self._inflight_lock:
                for entry in [e for e in self._inflight if e[0] is rec]:
                    self._inflight.remove(entry)
                    self._streams.wait(rec.done)  # the memory is reused only after the copy
                    self._release_sources(entry)

    # ------------------------------------------------------------------ offload
    def _move_out(self, group: Group, moved: list[Moved]) -> None:
        rec = _Offloaded()
        rec.packed = [m for m in moved if m.nbytes < self.pack_below]
        rec.large = [m for m in moved if m.nbytes >= self.pack_below]
        rec.packed_offsets, rec.packed_total = self._packer.layout([m.nbytes for m in rec.packed])
        sizes = ([rec.packed_total] if rec.packed else []) + [m.nbytes for m in rec.large]
        try:  # all host memory first: all or nothing (R10)
            for n in sizes:
                rec.blocks.append(self._pool.get(n))
        except MemoryError:
            self._release_blocks(rec.blocks)
            raise
        large_blocks = rec.blocks[1:] if rec.packed else rec.blocks
        for m, block in zip(rec.large, large_blocks):
            m.host = block.tensor[: m.nbytes]
        sources = [m.source() for m in rec.large]
        if rec.packed:  # host work first, off the copy stream's timeline
            table = self._packer.prepare([m.source_ptr() for m in rec.packed], rec.packed_offsets,
                                         [m.nbytes for m in rec.packed], rec.packed_total)
        with self._streams.on_d2h(self._streams.record(), *(b.fence for b in rec.blocks)):
            start = self._timing_event()
            stage = None
            if rec.packed:
                stage = self._packer.pack(table, rec.packed_total)
                rec.blocks[0].tensor[: rec.packed_total].copy_(stage, non_blocking=True)
            for m, src in zip(rec.large, sources):
                m.host.copy_(src, non_blocking=True)
            self._timed("d2h", sum(m.nbytes for m in moved), start)
        rec.done = self._streams.record(self._streams.d2h)
        for m in moved:
            m.dev = m.weak = m.ready = None
            m.uses_left = 0
        self.counters["d2h_copies"] += len(rec.large) + bool(rec.packed)
        self.counters["packed_spans"] += len(rec.packed)
        self.counters["d2h_bytes"] += sum(m.nbytes for m in moved)
        group.fast = rec
        weakref.finalize(group, self._group_freed, rec)
        with self._inflight_lock:
            # the sources (kept alive through each Moved's storage) and the staging buffer
            self._inflight.append((rec, stage, list(moved)))
        self._reap()

    def _reap(self) -> None:
        """Release the sources of finished copies; at most ``max_inflight`` groups keep theirs.

        For older ones the compute stream waits for their copy before it goes on, so the
        allocator can hand their memory to later compute work: stream-ordered, no host wait.
        """
        with self._inflight_lock:
            while self._inflight and self._inflight[0][0].done.query():
                self._release_sources(self._inflight.popleft())
            while len(self._inflight) > self.max_inflight:
                entry = self._inflight.popleft()
                self._streams.wait(entry[0].done)  # later compute work waits for the copy
                self.counters["compute_waits"] += 1
                self._release_sources(entry)

    @staticmethod
    def _release_sources(entry) -> None:
        rec, _stage, moved = entry
        rec.inflight = False
        for m in moved:
            m.storage = None

    def synchronize(self) -> None:
        """Block until every offload copy has finished and its sources are released."""
        with self._inflight_lock:
            while self._inflight:
                entry = self._inflight.popleft()
                entry[0].done.synchronize()
                self._release_sources(entry)

    # ------------------------------------------------------------------ reload
    def _on_backward(self, group: Group) -> None:
        if group.__dict__.get("fast_reached"):
            return  # the common case: every unpack after the group's first
        group.fast_reached = True
        self._reap()  # first free what finished copies no longer need, then allocate reloads
        self._start_reload(group)
        prev = group.prev() if group.prev is not None else None
        for _ in range(self.prefetch):
            if prev is None:
                break
            if self._start_reload(prev):
                self.counters["prefetched_groups"] += 1
            prev = prev.prev() if prev.prev is not None else None

    def _start_reload(self, group: Group) -> bool:
        """Bring a committed group back once (first touch or prefetch); True if started now."""
        rec = getattr(group, "fast", None)
        if group.state != COMMITTED or rec is None or rec.reloading:
            return False
        rec.reloading = True
        if rec.inflight:
            # Its copy out may not even have finished: the data is still on the device,
            # produced on the compute stream, so use it in place (no bus, no wait). Each
            # span is then freed as soon as backward is done with it, as without an
            # offloader; record_stream (once per span, bounded) makes the allocator hold
            # its memory back until the copy reading it has finished.
            for m in group.moved:
                m.dev, m.ready, m.uses_left = m.source(), None, len(m.span.members)
                if self._streams.cuda:
                    m.dev.record_stream(self._streams.d2h)
            with self._inflight_lock:
                for entry in [e for e in self._inflight if e[0] is rec]:
                    self._inflight.remove(entry)
                    self._release_sources(entry)
            self.counters["reused_in_flight_groups"] += 1
        else:
            self._reload(group)
        return True

    def _reload(self, group: Group) -> None:
        """Enqueue the reload of every span of ``group`` not currently on the device."""
        rec: _Offloaded = group.fast
        need = [m for m in group.moved if m.dev is None and (m.weak is None or m.weak.get(self.device) is None)]
        if not need:
            return
        for m in need:  # on the compute stream: its allocator reuses them after backward
            m.dev = torch.empty(m.nbytes, dtype=torch.uint8, device=self.device)
        needed = set(map(id, need))
        packed = [(m, off) for m, off in zip(rec.packed, rec.packed_offsets) if id(m) in needed]
        large = [m for m in rec.large if id(m) in needed]
        if packed:  # host work first, off the copy stream's timeline
            table = self._packer.prepare([m.dev.data_ptr() for m, _ in packed], [o for _, o in packed],
                                         [m.nbytes for m, _ in packed], rec.packed_total)
        allocated = self._streams.record()
        with self._streams.on_h2d(allocated, rec.done):
            start = self._timing_event()
            if packed:
                stage = torch.empty(rec.packed_total, dtype=torch.uint8, device=self.device)
                stage.copy_(rec.blocks[0].tensor[: rec.packed_total], non_blocking=True)
                self._packer.unpack(table, stage)
            for m in large:
                m.dev.copy_(m.host, non_blocking=True)
            self._timed("h2d", sum(m.nbytes for m in need), start)
        ready = self._streams.record(self._streams.h2d)
        for b in rec.blocks:
            b.fence = ready  # the next writer of this host block waits for this read
        for m in need:
            m.ready = ready
            m.uses_left = len(m.span.members)
        self.counters["h2d_copies"] += len(large) + bool(packed)
        self.counters["h2d_bytes"] += sum(m.nbytes for m in need)

    def _device_bytes(self, group: Group, moved: Moved) -> torch.Tensor:
        dev = None
        if moved.dev is None:
            dev = moved.weak.get(self.device) if moved.weak is not None else None
            if dev is None:  # a later backward (retain_graph) after the reload was freed
                self._reload(group)
        if moved.dev is not None:  # held for the uses still to come in this backward
            dev = moved.dev
            moved.uses_left -= 1
            if moved.uses_left <= 0:  # from now on only the restored tensors keep it alive
                moved.weak = WeakStorage(dev)
                moved.dev = None
        self._streams.wait(moved.ready)  # never used before the reload completes
        return dev

    # ------------------------------------------------------------------ stats
    def _host_bytes(self) -> tuple[int, int]:
        return self._pool.in_use, self._pool.pooled

    def _extra_stats(self) -> dict:
        return {
            "host_allocations": self._pool.allocations,
            "packer": self._packer.name,
            "pack_below": self.pack_below,
            "copies": dict(self.counters),
        }
