"""Measuring what a forward leaves resident: the storages saved for backward still alive.

On CUDA ``torch.cuda.memory_allocated()`` answers directly; on the CPU (host memory
standing in for device memory) there is no allocator counter, so :class:`SavedTracker`
records every storage handed to the offloader (or, without one, to a counting
saved-tensors hook) and sums those still alive.
"""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class SavedTracker:
    """Records the storages saved for backward during a forward.

    Example::

        with SavedTracker(off, exclude=model.parameters()) as tracker:
            loss = model(x).sum()
        tracker.resident_bytes()   # bytes of saved storages still alive (not parameters)
    """

    def __init__(self, offloader=None, exclude=()):
        self._off = offloader
        self._exclude = {p.untyped_storage()._cdata for p in exclude}
        self._seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def record(self, t: torch.Tensor) -> None:
        """Count the storage of ``t`` (once) unless it is excluded."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st._cdata not in self._exclude and st._cdata not in self._seen:
            self._seen[st._cdata] = (StorageWeakRef(st), st.nbytes())

    def __enter__(self) -> "SavedTracker":
        # Outside groups a counting hook sees every save; inside a group the offloader's
        # hooks take precedence, so its pack is observed instead.
        self._hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: (self.record(t), t)[1], lambda t: t)
        self._hooks.__enter__()
        if self._off is not None:
            pack = self._off._pack

            def spy(group, t):
                from . import multibuffer

                for b in multibuffer.buffers_of(t) if multibuffer.is_multibuffer(t) else [t]:
                    if b is not None:
                        self.record(b)
                return pack(group, t)

            self._off._pack = spy
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        if self._off is not None:
            del self._off._pack  # back to the class's method

    def resident_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self._seen.values() if not ref.expired())
