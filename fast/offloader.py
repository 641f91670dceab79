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
- **Backward**: the first unpack of a group starts its reload (or the rest of it, if
  prefetched) and the reload of the next ``prefetch`` groups this backward pass will
  reach, each in part: the spans its forward saved last (backward needs them first),
  whole spans until half its bytes, and its packed small spans, so that reloading ahead
  holds about half a group, not a whole one. Reload
  buffers are allocated on the compute stream (so its allocator reuses them when
  backward frees them); the reload stream first waits for that allocation point and for
  the span's offload copy. Every restored tensor makes the consuming stream wait on the
  reload's event: a reload is never used before it completes. Large spans whose copy out
  is still in flight are used in place instead (no bus, no wait); packed ones were let go
  once packed and come back from the host.
- **Lifetime**: a commit's pool blocks go back to the pool when nothing uses its spans
  any more (its group, and any later group that shares a span, are freed); a block's
  fence (its last reload) orders its next reuse. A reload is held strongly until each
  saved buffer of the group that asked for it has been unpacked once, then only weakly,
  so ``retain_graph`` backwards reuse it while it lives and reload it otherwise.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

from actoffload import plans
from actoffload.graph import upcoming
from actoffload.hostmem import Finalizers, allocate_all
from actoffload.locks import OwnedLock
from actoffload.observe import listening, wants_copies
from actoffload.offloader import Offloader
from actoffload.plans import WARMUPS, Plan
from actoffload.policy import Span
from actoffload.records import Group, GroupState, Moved, holds_span
from actoffload.settings import check_choice, check_count, resolve_device
from actoffload.warmup import WarmUp

from .packing import PACKERS, Packer
from .pool import HostBlock, PinnedPool
from .streams import CopyStreams

# Of a group reloaded ahead, the share of bytes brought back before backward reaches it.
# Whole groups ahead made fast's peak exceed ref's by more than a group (ref reloads a
# tensor only when backward unpacks it); half keeps most of the overlap. A memory budget's
# plan brings whole groups back (its model counts them whole, _prefetch_share).
PREFETCH_SHARE = 0.5


class _Copied:
    """One commit's copy out: the pool blocks it filled and the event of its last copy.

    Every span it moved holds it (``FastMoved.copied``), so its blocks stay out of the
    pool exactly as long as some group may still reload from them.
    """

    __slots__ = ("blocks", "packed_total", "done", "inflight", "__weakref__")

    def __init__(self) -> None:
        self.blocks: list[HostBlock] = []
        self.packed_total = 0  # bytes of the packed block (blocks[0]) in use; 0: nothing packed
        self.done: Any = None  # event: every copy of this commit has finished
        self.inflight = True  # its sources are still referenced (copy maybe not finished)


class FastMoved(Moved):
    """A span in fast: where its host bytes are, and its reload (if any)."""

    copied: _Copied | None = None
    data_ptr_at_copy: int | None = None  # the source's address when its copy was enqueued (large spans)
    # the caller freed the source (``resize_(0)``) while its copy was in flight: the host copy
    # may hold other bytes; backward takes the span from the caller's storage (refilled) or raises
    caller_freed = False
    packed_offset: int | None = None  # its offset in the packed block, if packed
    dev: torch.Tensor | None = None  # reload (or in-place source) held for uses to come
    # (once only restored tensors hold it: Moved.reloaded)
    ready: Any = None  # event after which ``dev`` holds the bytes
    uses_left = 0


def _first_needed(spans: list[FastMoved], saved_at: list[int],
                  share: float) -> tuple[list[FastMoved], list[FastMoved]]:
    """Split a group's spans into those to reload ahead and the rest: the last saved in
    forward (``saved_at``: each one's first save; backward needs them first), whole spans
    until ``share`` of the bytes is reached, and every packed one (one copy brings them all)."""
    total = sum(m.nbytes for m in spans)
    first: list[FastMoved] = []
    rest: list[FastMoved] = []
    taken = 0
    for _, m in sorted(zip(saved_at, spans), key=lambda pair: -pair[0]):
        if m.packed_offset is not None or taken < share * total:
            first.append(m)
            taken += m.nbytes
        else:
            rest.append(m)
    return first, rest


def _freed_in_flight(group: Group, m: FastMoved) -> RuntimeError:
    return RuntimeError(
        f"a storage saved in offload group {group.name!r} was freed (resize_(0)) while its copy to the host "
        f"was still in flight, and was not refilled before backward: the copy may have read bytes of other work, "
        f"so bytes [{m.span.start}, {m.span.start + m.nbytes}) of it are lost. Refill the storage before backward "
        "(as autograd itself needs), or free it only after offloader.synchronize()."
    )


def _add_held_uses(spans: Iterable[tuple[Moved, int]]) -> None:
    """Spans already back on the device (held for other uses) are held for these uses too."""
    for m, uses in spans:
        if isinstance(m, FastMoved) and m.dev is not None:
            m.uses_left += uses


class FastGroup(Group):
    """A group in fast: whether its reload was started, and what is left to reload."""

    reloading = False  # its reload was enqueued (or its sources used in place)
    # prefetched in part: the spans (and their uses) that come back when backward reaches it
    # (a group sets its own list: this empty one is only ever read)
    reload_rest: list[tuple[FastMoved, int]] = []


class FastOffloader(Offloader[FastGroup, FastMoved]):
    """Stream-overlapped implementation; create it with ``ao.Offloader(impl="fast")``.

    Its own settings, with what they cost:

    - ``max_inflight`` (default 1): groups whose copy out may still hold their device
      memory while compute runs on. Each costs up to one group's activations of device
      memory at the peak; more lets compute run further ahead of a slower bus (where
      copies take longer than compute) and lets backward use
      more of the last groups in place. 0 makes compute wait for every copy out.
    - ``prefetch`` (default 1): groups reloaded ahead of the one backward is in, each in
      part: the spans backward needs first, about half its bytes, and the rest when
      backward reaches it. Each costs about half a group's activations of device
      memory; 0 makes each group's backward wait for its own reload.
    - ``pack_below`` (default 4 MiB): spans smaller than this (two or more in a commit) are
      gathered into one buffer by a Triton kernel and cross the bus in one copy (per-tensor copies reach
      full bus speed only from about 1-4 MiB). Costs one staging buffer of that group's
      packed bytes while it copies.
    - ``packer``: ``"auto"`` (Triton kernels on CUDA, their PyTorch reference on the
      CPU), ``"triton"`` (also on the CPU, through Triton's interpreter: slow, for
      testing the kernels) or ``"torch"`` (the reference everywhere).
    - ``warmup`` (default ``"auto"``: ``"recompute"`` on CUDA, ``"offload"`` elsewhere, where
      nothing is pinned, and with a ``memory_budget``, whose first steps profile by
      recomputing already): how a fresh offloader's first steps go. ``"offload"``
      offloads from the first step, pinning each pool block when first needed (pinning
      costs about as much per byte as the copy out, so that step runs slower than a steady
      one). ``"recompute"`` (:class:`actoffload.warmup.WarmUp`): while the blocks the first
      step asked for are pinned on a background thread, modules given to ``ao.wrap`` run
      under activation checkpointing; no step waits for pinning. Modules that update
      batch-norm statistics and modules under ``torch.compile`` are not recomputed; groups
      opened by hand offload from the start.
    - ``memory_budget`` (bytes, a size such as ``"60GiB"``, or a share of the device's memory:
      ``"auto"``, ``"90%"``, resolved at the first step; default none): the most device
      memory a training step may allocate, everything included; each group then keeps,
      offloads or recomputes as the fastest plan that fits says, and ``max_inflight``,
      ``prefetch`` and ``keep_last`` are the plan's (given other than their defaults, they
      raise ``ValueError``; :class:`actoffload.budget.plan.BudgetPlan`;
      docs/budgets.md says what it counts and how it chooses). A budget no plan reaches raises
      ``ValueError`` naming the smallest reachable peak.
    - ``plan``: a plan of one's own (:class:`actoffload.Plan`) instead of the two above.

    Example::

        off = ao.Offloader(impl="fast", max_inflight=1, prefetch=1)
        off = ao.Offloader(impl="fast", memory_budget="60GiB")
    """

    impl = "fast"

    def __init__(self, impl: str | None = None, *, max_inflight: int = 1, prefetch: int = 1,
                 pack_below: int = 4 << 20, packer: str = "auto", warmup: str = "auto",
                 memory_budget: int | str | None = None, plan: Plan | None = None, **settings: Any):
        self.max_inflight = check_count("max_inflight", max_inflight)
        self.prefetch = check_count("prefetch", prefetch)
        self.pack_below = check_count("pack_below", pack_below)
        self.warmup = check_choice("warmup", warmup, WARMUPS)
        device = resolve_device(settings.pop("device", None))
        chosen = plans.for_fast(warmup=self.warmup, memory_budget=memory_budget, device=device, plan=plan,
                                window=(self.max_inflight, self.prefetch),
                                keep_last=check_count("keep_last", settings.get("keep_last", 1)))
        super().__init__(impl, device=device, plan=chosen, **settings)
        if self.warmup == "auto":  # as plans.for_fast resolved it
            self.warmup = "recompute" if isinstance(self.plan, WarmUp) and self.plan.warming else "offload"
        self._packer = Packer(self.device, check_choice("packer", packer, PACKERS))
        self._streams = CopyStreams(self.device)
        self._pool = PinnedPool(self._host.allocate)
        # (copy record, staging buffer, spans) whose copy out may still run
        self._inflight: collections.deque[tuple[_Copied, torch.Tensor | None, list[FastMoved]]] = collections.deque()
        self._inflight_lock = OwnedLock()  # _group_freed, a finalizer, may run inside a section holding it
        self._finalizers = Finalizers()  # pool blocks back when a copy dies; sources when a group does
        # (one bound method each for every commit's finalizers, not one a commit)
        self._put_blocks_back, self._on_group_freed = self._pool.put_all, self._group_freed
        self._on_reloads_freed = self._wait_for_reloads
        self._unreported: list[tuple[str, int, Any, Any]] = []  # copies timed, not yet told (_tell_copies)
        self._unreported_lock = threading.Lock()  # (backward's reloads may run on autograd's threads)
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def memory_budget(self) -> int | str | None:
        """The plan's memory budget (bytes, or a share of the device's memory), if it keeps one."""
        return self.plan.memory_budget

    @property
    def settings(self) -> dict[str, Any]:
        max_inflight, prefetch = self._copy_window()  # a memory budget's plan's, as of its latest step
        return {**super().settings, "max_inflight": max_inflight, "prefetch": prefetch,
                "pack_below": self.pack_below, "packer": self._packer.name, "warmup": self.warmup,
                "memory_budget": self.memory_budget}

    # ------------------------------------------------------------------ the engine's points
    def _copy_window(self) -> tuple[int, int]:
        """``(max_inflight, prefetch)`` in effect: the plan's, else the settings."""
        planned = self._planned_window()
        return planned if planned is not None else (self.max_inflight, self.prefetch)

    def _planned_window(self) -> tuple[int, int] | None:
        return self.plan.copy_window() if "copy_window" in self._asks else None

    def _prefetch_depth(self) -> int:
        return self._copy_window()[1]

    def _prefetch_share(self) -> float:
        """The share of a group's bytes reloaded ahead: all of them under a memory budget's plan,
        whose model counts the groups ahead whole. The rest of a half waits for backward to reach
        its group, then (the host far ahead of the device) for the device to finish the group
        before, whose memory it may take: on an H200, transformers' 8B-shaped Llama at 32k
        offloading every layer with a window of one idled 40 ms a layer on it."""
        return PREFETCH_SHARE if self._planned_window() is None else 1.0

    def _forward_let_go(self) -> None:
        # its copies still in flight serve no backward, and their sources would count in what the
        # next step begins with (a budget re-profiles where that moves): let go at once
        self._reap(keep=0)

    def _group_opening(self) -> None:
        # Copies finished while the last group ran: free their sources now, not at the next
        # group that moves something (groups that keep everything may come in between).
        if self._inflight:  # (read without the lock: only this thread adds entries)
            self._reap()

    def reserve_host_blocks(self, span_bytes: list[int]) -> Callable[[], None]:
        return self._pool.expect(self._layout(span_bytes)[2])

    def host_pinning(self) -> tuple[int, BaseException | None]:
        return self._pool.reserving, self._pool.reserve_error

    def _new_group(self, name: str, prev: Group | None, first_seq: int) -> FastGroup:
        return FastGroup(name, prev, first_seq)

    def _new_moved(self, span: Span, storage: torch.UntypedStorage) -> FastMoved:
        return FastMoved(span, storage, self.device)

    # ------------------------------------------------------------------ copy timing (observers)
    def _timing_event(self) -> Any:
        if not self._cuda or not any(wants_copies(o) for o in self._observers):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _report_copy(self, direction: str, nbytes: int, start: Any) -> None:
        """Time a copy just enqueued (its end event); observers hear of it at :meth:`_tell_copies`."""
        if start is not None:
            end = self._timing_event()
            with self._unreported_lock:
                self._unreported.append((direction, nbytes, start, end))

    def _tell_copies(self) -> None:
        """Tell observers of the copies timed so far: once the copies' sources and destinations
        are in the offloader's keeping, so that an observer that raises loses nothing to a copy
        still running."""
        if not self._unreported:  # (read without the lock: nothing timed, the common case)
            return
        with self._unreported_lock:
            told, self._unreported = self._unreported, []
        error: BaseException | None = None
        for direction, nbytes, start, end in told:
            for obs in listening(self._observers):
                if wants_copies(obs):
                    try:
                        obs.on_copy(direction, nbytes, start, end)
                    except Exception as e:  # the others still hear of it; the first error is raised
                        error = error or e
        if error is not None:
            raise error

    # ------------------------------------------------------------------ offload
    def _layout(self, nbytes: list[int]) -> tuple[list[int], int, list[int]]:
        """A commit moving spans of ``nbytes``: the offsets of the small ones (in order) in its
        packed block, that block's bytes, and the pool blocks it takes (the packed one, then
        one per other span). A lone small span is not packed: one copy either way, and packing
        it would only add a staging buffer and a second copy."""
        packed = [n for n in nbytes if n < self.pack_below]
        if len(packed) < 2:
            return [], 0, list(nbytes)
        offsets, total = self._packer.layout(packed)
        return offsets, total, [total] + [n for n in nbytes if n >= self.pack_below]

    def _move_out(self, group: FastGroup, moved: list[FastMoved]) -> None:
        rec = _Copied()
        offsets, rec.packed_total, sizes = self._layout([m.nbytes for m in moved])
        packed = [m for m in moved if m.nbytes < self.pack_below] if offsets else []
        large = [m for m in moved if m.nbytes >= self.pack_below] if offsets else moved
        rec.blocks = allocate_all(sizes, self._pool.get, self._pool.put)  # all host memory first (R10)
        self._finalizers.add(rec, self._put_blocks_back, rec.blocks)  # (the list, not rec: rec must die)
        for m, off in zip(packed, offsets):
            m.copied, m.packed_offset = rec, off
            m.host = rec.blocks[0].tensor[off : off + m.nbytes]
        for m, block in zip(large, rec.blocks[1:] if packed else rec.blocks):
            m.copied = rec
            m.host = block.tensor if block.size == m.nbytes else block.tensor[: m.nbytes]
        sources = [m.source() for m in large]
        table = None
        if packed:  # host work first, off the copy stream's timeline
            table = self._packer.prepare([m.source() for m in packed], offsets, rec.packed_total)
        # The stage comes from the compute stream's pool, as every other device buffer: a block
        # cached for a copy stream serves no other stream, and would grow what the allocator reserves.
        stage = self._packer.stage(rec.packed_total) if packed else None
        with self._streams.on_d2h(self._streams.record(), *(w for b in rec.blocks for w in b.waits())):
            start = self._timing_event()
            if stage is not None:
                self._packer.pack(table, stage)
                rec.blocks[0].tensor[: rec.packed_total].copy_(stage, non_blocking=True)
            for m, src in zip(large, sources):
                m.host.copy_(src, non_blocking=True)  # type: ignore[union-attr]
            self._report_copy("d2h", sum(m.nbytes for m in moved), start)
        rec.done = self._streams.record(self._streams.d2h)
        for b in rec.blocks:  # the copy writes them until then: whoever frees or rewrites one waits
            b.read_until(rec.done)
        # The large sources are not record_stream'ed: their references (``m.storage``) are let go
        # only once the copy has finished, or once the compute stream waits for it (_reap), so
        # the compute stream's pool reuses their memory in stream order, at once. A block freed
        # with a stream use recorded is reused only once the host has seen that stream pass the
        # free, and the host runs ahead of the device: every source of the forward stayed
        # reserved (fast's reserved peak was no offloading's). A caller that frees a source
        # itself (``resize_(0)``) while its copy is in flight is found when it is let go
        # (:func:`_release_sources`).
        for m in large:
            m.data_ptr_at_copy = m.storage.data_ptr()  # type: ignore[union-attr]
        if self._streams.d2h is not None:
            # The packed ones' bytes are in the stage: an in-flight group holds its large sources
            # and the stage (its bytes once), not the packed sources too; backward reloads them.
            # Let go now, their memory waits for the copy stream to pass the pack.
            for m in packed:
                m.source().record_stream(self._streams.d2h)
                m.storage = None
            if stage is not None:
                stage.record_stream(self._streams.d2h)
        self.counters["d2h_copies"] += len(large) + bool(packed)
        self.counters["packed_spans"] += len(packed)
        self.counters["d2h_bytes"] += sum(m.nbytes for m in moved)
        self._finalizers.add(group, self._on_group_freed, weakref.ref(rec))
        with self._inflight_lock:
            # the sources (kept alive through each span's storage) and the staging buffer
            self._inflight.append((rec, stage, list(moved)))
        self._reap()
        self._tell_copies()

    def _group_freed(self, rec_ref: weakref.ref[_Copied]) -> None:
        """The graph let the group go: sources its copy still holds are released once the
        compute stream is ordered after the copy (their memory is reused only after it)."""
        self._inflight_lock.run(self._group_freed_held, rec_ref)  # (maybe inside a section holding it)

    def _group_freed_held(self, rec_ref: weakref.ref[_Copied]) -> None:
        rec = rec_ref()
        if rec is None or not rec.inflight:
            return
        for entry in [e for e in self._inflight if e[0] is rec]:
            self._inflight.remove(entry)
            self._streams.wait(rec.done)
            self._release_sources(entry)

    def _wait_for_reloads(self, spans: list[FastMoved]) -> None:
        for m in spans:
            if m.dev is not None and m.ready is not None:  # (used: the compute stream waited already)
                self._streams.wait(m.ready)

    def _reap(self, keep: int | None = None) -> None:
        """Release the sources of finished copies; at most ``keep`` groups (``max_inflight``)
        keep theirs.

        For older ones the compute stream waits for their copy before it goes on, so the
        allocator can hand their memory to later compute work: stream-ordered, no host wait.
        """
        if not self._inflight:  # (read without the lock: only this thread adds entries)
            return
        with self._inflight_lock:
            while self._inflight and self._inflight[0][0].done.query():
                self._release_sources(self._inflight.popleft())
            while len(self._inflight) > (self._copy_window()[0] if keep is None else keep):
                entry = self._inflight.popleft()
                self._streams.wait(entry[0].done)  # later compute work waits for the copy
                self.counters["compute_waits"] += 1
                self._release_sources(entry)

    def _hold_back(self, entry: tuple[_Copied, torch.Tensor | None, list[FastMoved]]) -> None:
        """A copy's sources about to be let go with the copy perhaps still reading them, and the
        compute stream not waiting for it (a group reached in backward uses spans of it in place:
        waiting would stall backward on the bus): the allocator holds each back until the copy
        stream has passed it. Its other spans may be another group's (a storage saved by two
        groups moves once, with the earlier one's copy)."""
        if self._streams.d2h is None:
            return
        for m in entry[2]:
            if m.storage is not None and m.dev is None and m.source_intact():  # (in place: held already)
                m.source().record_stream(self._streams.d2h)

    @staticmethod
    def _release_sources(entry: tuple[_Copied, torch.Tensor | None, list[FastMoved]]) -> None:
        """Let go of a finished (or waited for) copy's sources. One the caller freed meanwhile
        (``resize_(0)``, refilled or not) had its memory handed to other work while the copy
        may still have been reading it: its host copy is not trusted, and the span stays with
        the caller's storage, as it would stay with autograd (:meth:`FastMoved.caller_freed`)."""
        rec, _stage, moved = entry
        rec.inflight = False
        for m in moved:
            if m.caller_freed:  # judged freed already (backward touched it): its storage stays the span's
                continue
            if m.data_ptr_at_copy is not None and m.storage is not None and (
                    not m.source_intact() or m.storage.data_ptr() != m.data_ptr_at_copy):
                m.caller_freed = True
                continue
            m.storage = None

    def synchronize(self) -> None:
        """Block until every offload copy has finished and its sources are released."""
        with self._inflight_lock:
            while self._inflight:
                entry = self._inflight.popleft()
                entry[0].done.synchronize()
                self._release_sources(entry)

    # ------------------------------------------------------------------ reload
    def _backward_reaches(self, group: FastGroup) -> None:
        if self._inflight:  # first free what finished copies no longer need, then allocate reloads
            self._reap()
        if not self._start_reload(group):
            with self._lock:
                rest, group.reload_rest = group.reload_rest, []
            if rest:
                _add_held_uses(rest)  # brought back meanwhile for another group
                self._reload(group)
        if group.link is None:
            return  # it found no node of the group before it: backward reaches none through it
        share = self._prefetch_share()
        for ahead in upcoming(group, self._copy_window()[1]):
            if self._start_reload(ahead, share):
                self.counters["prefetched_groups"] += 1

    def _start_reload(self, group: FastGroup, share: float = 1.0) -> bool:
        """Bring a committed group back once (first touch or prefetch: ``share`` of its bytes,
        those backward needs first); True if started now."""
        with self._lock:
            if group.state is not GroupState.COMMITTED or group.reloading:
                return False
            group.reloading = True
        if not group.moved:  # nothing of it left the device
            return True
        for m in group.moved:
            if m.storage is not None and not m.source_intact():
                if isinstance(m, FastMoved) and (m.caller_freed or (m.copied is not None and m.copied.inflight)):
                    # freed by the caller while its copy was in flight (let go of since, or not yet):
                    # its memory may have gone to other work before the copy read it. The caller may
                    # still refill it before the node that reads it (a hook): judged there
                    m.caller_freed = True
                    continue
                m.storage = None  # the caller resized it since the commit: back from the host copy
        in_place = [m for m in group.moved if m.storage is not None and m.source_intact()]
        if in_place:
            # Their copy out may not even have finished: the data is still on the device,
            # produced on the compute stream, so use it in place (no bus, no wait). Each
            # span is then freed as soon as backward is done with it, as without an
            # offloader; record_stream (once per span, bounded) makes the allocator hold
            # its memory back until the copy reading it has finished.
            for m in in_place:
                assert isinstance(m, FastMoved)
                m.dev, m.ready = m.source(), None
                if self._streams.d2h is not None:
                    m.dev.record_stream(self._streams.d2h)
            records = {id(m.copied) for m in in_place if isinstance(m, FastMoved)}
            with self._inflight_lock:
                for entry in [e for e in self._inflight if id(e[0]) in records]:
                    self._inflight.remove(entry)
                    self._hold_back(entry)
                    self._release_sources(entry)
            self.counters["reused_in_flight_groups"] += 1
        _add_held_uses(zip(group.moved, group.uses))  # in place, or reloaded for another group
        rest = self._reload(group, share)
        with self._lock:
            group.reload_rest = rest
        return True

    def _reload(self, group: FastGroup, share: float = 1.0) -> list[tuple[FastMoved, int]]:
        """Enqueue the reload of every span of ``group`` that is neither held nor still alive,
        to be held until each of the group's buffers it serves was unpacked once; with
        ``share`` < 1, only those backward needs first (:func:`_first_needed`). Returns the
        spans left for later, with their uses."""
        need: list[FastMoved] = []
        saved_at: list[int] = []
        uses_of: dict[int, int] = {}
        for m, uses, at in zip(group.moved, group.uses, group.saved_at):
            assert isinstance(m, FastMoved)
            if m.dev is None and m.cached_reload() is None:
                if m.caller_freed:  # no copy to trust: only the caller's storage, refilled (_device_bytes)
                    continue
                need.append(m)
                saved_at.append(at)
                uses_of[id(m)] = uses
        later: list[FastMoved] = []
        if share < 1.0:
            need, later = _first_needed(need, saved_at, share)
        for m in need:
            m.uses_left = uses_of[id(m)]
        rest = [(m, uses_of[id(m)]) for m in later]
        if not need:
            return rest
        # on the compute stream: its allocator reuses them after backward
        dev = {id(m): torch.empty(m.nbytes, dtype=torch.uint8, device=self.device) for m in need}
        by_copy: dict[int, list[FastMoved]] = {}
        for m in need:
            by_copy.setdefault(id(m.copied), []).append(m)
        allocated = self._streams.record()
        for spans in by_copy.values():
            self._reload_from(spans[0].copied, spans, allocated, dev)  # type: ignore[arg-type]
        for m in need:  # published after its ready event: whoever sees the reload waits for it
            m.dev = dev[id(m)]
        # A reload backward never uses (it stopped short of the group) is freed with the last
        # group holding its span, its copy in perhaps still writing it: as the group that asked
        # for it goes (before its spans do), the compute stream waits for those copies.
        self._finalizers.add(group, self._on_reloads_freed, need)
        self.counters["h2d_bytes"] += sum(m.nbytes for m in need)
        self._tell_copies()
        return rest

    def _reload_from(self, rec: _Copied, need: list[FastMoved], allocated: Any,
                     dev: dict[int, torch.Tensor]) -> None:
        packed = [m for m in need if m.packed_offset is not None]
        large = [m for m in need if m.packed_offset is None]
        if 2 * sum(m.nbytes for m in packed) < rec.packed_total:
            # a few spans of another group's packed copy (a shared storage): copy just them
            large, packed = large + packed, []
        table = None
        if packed:  # host work first, off the copy stream's timeline
            table = self._packer.prepare([dev[id(m)] for m in packed],
                                         [m.packed_offset for m in packed],  # type: ignore[misc]
                                         rec.packed_total)
        stage = None
        if packed:  # from the compute stream's pool (see _move_out); its reuse waits for the copy stream
            stage = self._packer.stage(rec.packed_total)
            allocated = self._streams.record()
        with self._streams.on_h2d(allocated, rec.done):
            start = self._timing_event()
            if stage is not None:
                stage.copy_(rec.blocks[0].tensor[: rec.packed_total], non_blocking=True)
                self._packer.unpack(table, stage)
            for m in large:
                dev[id(m)].copy_(m.host, non_blocking=True)  # type: ignore[arg-type]
            self._report_copy("h2d", sum(m.nbytes for m in need), start)
        ready = self._streams.record(self._streams.h2d)
        if stage is not None and self._streams.h2d is not None:
            stage.record_stream(self._streams.h2d)
        for b in rec.blocks:
            b.read_until(ready)  # the next writer of this host block waits for this read
        for m in need:
            m.ready = ready
        self.counters["h2d_copies"] += len(large) + bool(packed)

    def _device_bytes(self, group: FastGroup, moved: FastMoved) -> torch.Tensor:
        if moved.dev is not None and not holds_span(moved.dev, moved.nbytes):
            # a source used in place that the caller resized since: back from the host copy
            # (restoring from it would grow the caller's storage back, uninitialised)
            moved.dev, moved.uses_left = None, 0
        if moved.caller_freed and moved.dev is None:
            # freed while its copy was in flight: only the caller's storage holds its bytes, refilled
            # by now as autograd itself would need it, or nowhere
            if moved.storage is None or not moved.source_intact():
                raise _freed_in_flight(group, moved)
            return moved.source()
        dev = None
        if moved.dev is None:
            dev = moved.cached_reload()
            if dev is None:  # a later backward (retain_graph) after the reload was freed
                self._reload(group)
        if moved.dev is not None:  # held for the uses still to come in this backward
            dev = moved.dev
            moved.uses_left -= 1
            if moved.uses_left <= 0:  # from now on only the restored tensors keep it alive
                moved.remember_reload(dev)
                moved.dev = None
        self._streams.wait(moved.ready)  # never used before the reload completes
        assert dev is not None
        return dev

    # ------------------------------------------------------------------ stats
    def _host_bytes(self) -> tuple[int, int]:
        return self._pool.in_use, self._pool.pooled

    def host_allocations(self) -> int:
        return self._pool.allocations

    def _stats(self) -> dict[str, Any]:
        return {**super()._stats(), "host_allocations": self._pool.allocations, "packer": self._packer.name,
                "pack_below": self.pack_below, "copies": dict(self.counters)}

    def _inputs_copied(self, group: FastGroup) -> None:
        # later compute waits for these copies, so no later write reaches their sources first;
        # the sources are then let go (backward reads the copies, not the sources)
        copies = {id(m.copied): m.copied for m in group.moved if isinstance(m, FastMoved) and m.copied is not None}
        with self._inflight_lock:
            for entry in [e for e in self._inflight if id(e[0]) in copies]:
                self._inflight.remove(entry)
                self._streams.wait(entry[0].done)
                self._release_sources(entry)
