"""``QuantizedTensor``: an FP8 (e4m3) tensor made of several buffers (rule R7).

Buffers: the FP8 data, an fp32 ``scale_inv`` (one number), and optionally the
transposed FP8 data that a backward GEMM would want. The big buffers are worth
offloading; the scale is not, and the offloader judges each on its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Round-to-nearest into 3 mantissa bits: relative error at most 2**-4 for normal values,
# absolute error at most half the smallest subnormal step (2**-10) times scale_inv below.
FP8_REL_ERROR = 2.0**-4
FP8_ABS_ERROR = 2.0**-10


class QuantizedTensor(torch.Tensor):
    """An FP8 e4m3 tensor: ``data * scale_inv`` approximates the original values.

    It behaves as a tensor of the original dtype: any op on it runs on
    ``dequantize()``. Build it with :func:`quantize`.

    Example::

        q = ao.quantize(torch.randn(64, 64), with_transpose=True)
        x = q.dequantize()          # float32, within FP8's error of the input
        buffers, state = copy.copy(q).prepare_for_saving()
    """

    # None once handed over by prepare_for_saving (only ever called on a copy)
    _data: torch.Tensor | None
    _scale_inv: torch.Tensor | None
    _transpose: torch.Tensor | None

    @staticmethod
    def __new__(cls, data, scale_inv, transpose=None, dtype=torch.float32):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )
        self._data = data
        self._scale_inv = scale_inv
        self._transpose = transpose
        return self

    def __init__(self, data, scale_inv, transpose=None, dtype=torch.float32):
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"scale_inv={self._scale_inv.item() if self._scale_inv is not None else None}, "
            f"transpose={self._transpose is not None})"
        )

    def __copy__(self):
        return QuantizedTensor(self._data, self._scale_inv, self._transpose, self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The values in the original dtype: ``data * scale_inv``."""
        assert self._data is not None and self._scale_inv is not None, "buffers handed over by prepare_for_saving"
        return (self._data.to(torch.float32) * self._scale_inv).to(self.dtype)

    # --- the multi-buffer protocol (R7) ---
    def prepare_for_saving(self):
        buffers = [self._data, self._scale_inv, self._transpose]
        self._data = self._scale_inv = self._transpose = None  # handed over
        return buffers, (tuple(self.shape), self.dtype)

    @classmethod
    def restore_from_saved(cls, state, buffers):
        shape, dtype = state
        data, scale_inv, transpose = buffers
        if data is None or tuple(data.shape) != shape:
            raise ValueError(f"QuantizedTensor.restore_from_saved: data of shape {shape} expected")
        return cls(data, scale_inv, transpose, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]  # torch's own signature
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (t,) = args
            return QuantizedTensor(t._data, t._scale_inv, t._transpose, t.dtype)

        def plain(a):
            return a.dequantize() if isinstance(a, QuantizedTensor) else a

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def quantize(x: torch.Tensor, with_transpose: bool = False) -> QuantizedTensor:
    """Quantize ``x`` to FP8 e4m3 with one per-tensor scale.

    ``|dequantize(q) - x| <= FP8_REL_ERROR * |x| + FP8_ABS_ERROR * scale_inv``.

    >>> q = quantize(torch.tensor([1.0, -2.0, 0.5]))
    >>> q.dequantize()
    tensor([ 1.0000, -2.0000,  0.5000])
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating-point tensor, got {x.dtype}")
    amax = x.detach().abs().max().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    data = (x.detach().to(torch.float32) * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    transpose = data.t().contiguous() if with_transpose and data.dim() == 2 else None
    if with_transpose and data.dim() != 2:
        raise ValueError(f"with_transpose needs a 2-D tensor, got {data.dim()}-D")
    return QuantizedTensor(data, (1.0 / scale).reshape(1), transpose, x.dtype)
