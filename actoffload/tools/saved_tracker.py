"""Measuring what a forward leaves resident: the storages saved for backward still alive.

On CUDA ``torch.cuda.memory_allocated()`` answers directly; on the CPU (host memory
standing in for device memory) there is no allocator counter, so :class:`SavedTracker`
records every storage saved for backward (inside groups through the offloader's
observer interface, outside them through a counting saved-tensors hook) and sums those
still alive.
"""

from __future__ import annotations

import gc
from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import actoffload as ao


class SavedTracker(ao.Observer):
    """Records the storages saved for backward during a forward.

    Example::

        with SavedTracker(off, exclude=model.parameters()) as tracker:
            loss = model(x).sum()
        tracker.resident_bytes()   # bytes of saved storages still alive (not parameters)
    """

    def __init__(self, offloader: ao.Offloader | None = None, exclude: Iterable[torch.Tensor] = ()):
        self._off = offloader
        self._exclude = {p.untyped_storage()._cdata for p in exclude}
        self._seen: dict[int, tuple[StorageWeakRef, int]] = {}
        self._handle: Any = None
        self._hooks: Any = None

    def record(self, t: torch.Tensor) -> None:
        """Count the storage of ``t`` (once) unless it is excluded or has none."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st._cdata not in self._exclude and st._cdata not in self._seen:
            self._seen[st._cdata] = (StorageWeakRef(st), st.nbytes())

    def on_save(self, group: str, tensor: torch.Tensor) -> None:
        self.record(tensor)

    def __enter__(self) -> SavedTracker:
        # Outside groups this hook sees every save; inside a group the offloader's hooks
        # take precedence, and the offloader reports each save to on_save instead.
        self._hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: (self.record(t), t)[1], lambda t: t)
        self._hooks.__enter__()
        if self._off is not None:
            self._handle = self._off.add_observer(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        if self._handle is not None:
            self._handle.remove()

    def resident_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self._seen.values() if not ref.expired())
