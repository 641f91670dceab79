"""Weak references to storages: how implementations know whether a reload is still alive."""

from __future__ import annotations

import torch

from . import compat


class WeakStorage:
    """A weak reference to a storage: ``get()`` gives it back while anything still uses it.

    Restored tensors reach their reload buffer only through its storage (autograd
    re-wraps what an unpack hook returns), so a weak reference to the storage, not to
    a tensor object, is what tells whether a reload is still alive.

    Example::

        buf = torch.empty(16, dtype=torch.uint8)
        ref = WeakStorage(buf)
        ref.get(buf.device) is not None   # True while buf (or a view of it) lives
    """

    __slots__ = ("_ref",)

    def __init__(self, t: torch.Tensor):
        self._ref = compat.storage_weakref(t)

    def get(self, device: torch.device) -> torch.Tensor | None:
        """A flat uint8 tensor over the whole storage, or ``None`` once it was freed."""
        storage = compat.storage_from_weakref(self._ref)
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
