"""``GroupedTensor``: G tensors held in one contiguous buffer (rule R7).

The MoE expert block keeps the tokens of every expert in one ``[N, ...]`` buffer,
expert ``g`` owning rows ``offsets[g]:offsets[g+1]``. Buffers: the data (big, worth
offloading) and the int64 ``offsets`` (tiny, stays resident); the split sizes are
plain Python state.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_map


_HANDED_OVER = "this object's buffers were handed over by prepare_for_saving"


class GroupedTensor(torch.Tensor):
    """A ``[N, *rest]`` tensor whose rows are split into groups of ``split_sizes`` rows.

    Any op on it runs on the underlying data; :meth:`split` gives the groups back
    exactly (views, no copy).

    Example::

        g = ao.GroupedTensor.from_tensors([torch.randn(3, 8), torch.randn(0, 8), torch.randn(5, 8)])
        a, empty, b = g.split()
        g.split_sizes        # [3, 0, 5]
    """

    # None once handed over by prepare_for_saving (only ever called on a copy)
    _data: torch.Tensor | None
    _split_sizes: list[int]
    _offsets: torch.Tensor | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, split_sizes: Sequence[int], offsets: torch.Tensor | None = None):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=data.device, requires_grad=False
        )
        sizes = [int(s) for s in split_sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != (data.shape[0] if data.dim() else 0):
            raise ValueError(
                f"GroupedTensor: split sizes {sizes} must be >= 0 and sum to the data's "
                f"first dimension ({data.shape[0] if data.dim() else 0})"
            )
        if offsets is None:
            offsets = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(data.device)
        self._data = data
        self._split_sizes = sizes
        self._offsets = offsets
        return self

    def __init__(self, data, split_sizes, offsets=None):
        pass

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> "GroupedTensor":
        """Concatenate tensors that agree in dtype, device and trailing shape."""
        if not tensors:
            raise ValueError("GroupedTensor.from_tensors needs at least one tensor")
        first = tensors[0]
        for t in tensors:
            if t.dim() == 0 or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    "GroupedTensor.from_tensors: every tensor needs >= 1 dimension and the same "
                    f"dtype, device and trailing shape; got {tuple(first.shape)} {first.dtype} "
                    f"{first.device} and {tuple(t.shape)} {t.dtype} {t.device}"
                )
        return cls(torch.cat([t.detach() for t in tensors]), [t.shape[0] for t in tensors])

    @property
    def split_sizes(self) -> list[int]:
        return list(self._split_sizes)

    @property
    def offsets(self) -> torch.Tensor:
        assert self._offsets is not None, _HANDED_OVER
        return self._offsets

    @property
    def data_buffer(self) -> torch.Tensor:
        assert self._data is not None, _HANDED_OVER
        return self._data

    def split(self) -> list[torch.Tensor]:  # type: ignore[override]  # a GroupedTensor's own split
        """The groups, as views of the one data buffer."""
        return list(torch.split(self.data_buffer, self._split_sizes))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"GroupedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, split_sizes={self._split_sizes})"

    def __copy__(self):
        return GroupedTensor(self._data, self._split_sizes, self._offsets)

    # --- the multi-buffer protocol (R7) ---
    def prepare_for_saving(self):
        buffers = [self._data, self._offsets]
        self._data = self._offsets = None  # handed over
        return buffers, list(self._split_sizes)

    @classmethod
    def restore_from_saved(cls, state, buffers):
        data, offsets = buffers
        return cls(data, state, offsets)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]  # torch's own signature
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (t,) = args
            return GroupedTensor(t._data, t._split_sizes, t._offsets)

        def plain(a):
            return a._data if isinstance(a, GroupedTensor) else a

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))
