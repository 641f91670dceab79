"""The reference offloader: the oracle that defines actoffload's semantics.

Plain and synchronous on purpose. Rule by rule (``docs/semantics.md``), where each one
lives:

- R2 scope, nesting, R4's commit schedule, R5's storages shared between groups, R6
  version check, R7 multi-buffer protocol, R8 lifetimes: ``actoffload.engine`` (shared
  with fast).
- R3 eligibility, R4 marks, R5 alias spans: ``actoffload.policy.plan_group``.
- The moves themselves, below: at commit each span is copied to host memory (pinned
  when the device is CUDA) and waits there; at unpack it is copied back. Copies are
  blocking, so nothing here can race.
- R5, R8: a reload is cached only through a weak reference to its storage
  (``Moved.cached_reload``), so every alias restored while it lives shares it, and it
  lives exactly as long as a restored tensor uses it; a second backward
  (``retain_graph``) reloads again.
- R9, R10: host memory comes from ``actoffload.hostmem.HostMemory``, which counts it
  while it lives and raises :class:`~actoffload.HostMemoryError` (the group stays
  resident) when it cannot be had.
"""

from __future__ import annotations

import torch

from actoffload.hostmem import HostAllocator, allocate_all, cached_host_allocator
from actoffload.offloader import Offloader
from actoffload.policy import Span
from actoffload.records import Group, Moved


class RefOffloader(Offloader[Group, Moved]):
    """Synchronous reference implementation; create it with ``ao.Offloader(impl="ref")``."""

    impl = "ref"

    def _default_host_allocator(self) -> HostAllocator:
        return cached_host_allocator  # ref allocates and frees every step: PyTorch caches pinned memory

    def _new_group(self, name: str, prev: Group | None, first_seq: int) -> Group:
        return Group(name, prev, first_seq)

    def _new_moved(self, span: Span, storage: torch.UntypedStorage) -> Moved:
        return Moved(span, storage, self.device)

    def _move_out(self, group: Group, moved: list[Moved]) -> None:
        hosts = allocate_all((m.nbytes for m in moved), self._host.allocate)
        for m, host in zip(moved, hosts):
            host.copy_(m.source())  # blocking
            m.storage = None
            m.host = host

    def _device_bytes(self, group: Group, moved: Moved) -> torch.Tensor:
        dev = moved.cached_reload()
        if dev is None:
            assert moved.host is not None
            dev = torch.empty(moved.nbytes, dtype=torch.uint8, device=self.device)
            dev.copy_(moved.host)  # blocking
            moved.remember_reload(dev)
        return dev

    def _host_bytes(self) -> tuple[int, int]:
        return self._host.allocated, 0
