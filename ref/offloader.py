"""The reference offloader: the oracle that defines actoffload's semantics.

Plain and synchronous on purpose. Rule by rule (SPEC.md), where each one lives:

- R2 scope, nesting, R4's commit schedule, R6 version check, R7 multi-buffer
  protocol, R8 lifetimes: ``actoffload.engine.OffloaderBase`` (shared with fast).
- R3 eligibility, R4 marks, R5 alias spans: ``actoffload.policy.plan_group``.
- The moves themselves, below: at commit each span is copied to host memory
  (pinned when the device is CUDA) and waits there; at unpack it is copied back.
  Copies are blocking, so nothing here can race.
- R5, R8: a reload is cached only through a weak reference to its storage, so every
  alias restored while it lives shares it, and it lives exactly as long as a restored
  tensor uses it; a second backward (``retain_graph``) reloads again.
- R9: host bytes in use are counted when allocated and uncounted when freed.
- R10: host allocation failure raises :class:`~actoffload.engine.HostMemoryError`
  and the group stays resident.
"""

from __future__ import annotations

import threading
import weakref

import torch

from actoffload.engine import Group, Moved, OffloaderBase, WeakStorage


class RefOffloader(OffloaderBase):
    """Synchronous reference implementation; create it through ``actoffload.Offloader(impl="ref")``."""

    impl = "ref"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host_lock = threading.Lock()
        self._host_in_use = 0

    def _count_host(self, delta: int) -> None:
        with self._host_lock:
            self._host_in_use += delta

    def _move_out(self, group: Group, moved: list[Moved]) -> None:
        hosts = [self._alloc_host(m.nbytes) for m in moved]  # all or nothing (R10)
        for m, host in zip(moved, hosts):
            host.copy_(m.source())  # blocking
            m.storage = None
            m.host = host
            m.reloaded = None
            self._count_host(m.nbytes)
            weakref.finalize(host, self._count_host, -m.nbytes)

    def _device_bytes(self, group: Group, moved: Moved) -> torch.Tensor:
        dev = moved.reloaded.get(self.device) if moved.reloaded is not None else None
        if dev is None:
            dev = torch.empty(moved.nbytes, dtype=torch.uint8, device=self.device)
            dev.copy_(moved.host)  # blocking
            moved.reloaded = WeakStorage(dev)
        return dev

    def _host_bytes(self) -> tuple[int, int]:
        return self._host_in_use, 0
