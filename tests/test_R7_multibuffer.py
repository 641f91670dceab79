"""R7: tensors made of several buffers: each buffer judged alone, wrapper always rebuilt."""

import copy

import pytest
import torch

import actoffload as ao
from helpers import DEVICES, IMPLS, off_for


class _SaveQuantized(torch.autograd.Function):
    """y = x * 3; saves an FP8 copy of x as a QuantizedTensor, checks it in backward."""

    @staticmethod
    def forward(ctx, x, with_transpose):
        q = ao.quantize(x, with_transpose=with_transpose)
        ctx.expected = q.dequantize().clone()
        ctx.save_for_backward(q)
        ctx.caller_copy = q
        return x * 3

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        assert isinstance(q, ao.QuantizedTensor)
        assert torch.equal(q.dequantize(), ctx.expected)
        ctx.checked = True
        return g * 3, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_transpose", [False, True])
def test_R7_quantized_data_moves_and_scale_stays(impl, device, with_transpose):
    x = torch.randn(256, 128, device=device, requires_grad=True)
    off = off_for(impl, device, keep_last=0, min_offload_bytes=1024)
    with off.group("fp8"):
        y = _SaveQuantized.apply(x, with_transpose)
    g = off.stats()["groups"]["fp8"]
    n_big = 2 if with_transpose else 1
    assert g["saved"] == 1 + n_big and g["offloaded"] == n_big
    assert g["kept"] == {"small": 1}  # scale_inv: 4 bytes
    assert g["offloaded_bytes"] == n_big * 256 * 128  # FP8: one byte each
    q = y.grad_fn.caller_copy
    assert q._data is not None and q._scale_inv is not None  # caller's object untouched
    y.sum().backward()
    assert y.grad_fn.checked


class _Pair(torch.Tensor):
    """A type the library has never seen: two buffers, counts its rebuilds."""

    rebuilds = 0

    @staticmethod
    def __new__(cls, a, b):
        self = torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device=a.device)
        self.a, self.b = a, b
        return self

    def __init__(self, a, b):
        pass

    def __copy__(self):
        return _Pair(self.a, self.b)

    def prepare_for_saving(self):
        out = [self.a, None, self.b]
        self.a = self.b = None
        return out, "state"

    @classmethod
    def restore_from_saved(cls, state, buffers):
        assert state == "state" and buffers[1] is None
        cls.rebuilds += 1
        return cls(buffers[0], buffers[2])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


class _SavePair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pair):
        ctx.save_for_backward(pair)
        ctx.expected = (pair.a.clone(), pair.b.clone())
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        assert type(p) is _Pair
        assert torch.equal(p.a, ctx.expected[0]) and torch.equal(p.b, ctx.expected[1])
        return g, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["moved", "nothing_moved"])
def test_R7_unknown_type_is_rebuilt_with_restore_from_saved_even_if_nothing_moved(impl, device, min_bytes):
    pair = _Pair(torch.randn(100, device=device), torch.randn(3, device=device))
    x = torch.randn(4, device=device, requires_grad=True)
    off = off_for(impl, device, keep_last=0, min_offload_bytes=min_bytes)
    with off.group("g"):
        y = _SavePair.apply(x, pair)
    assert pair.a is not None and pair.b is not None  # called on a copy
    g = off.stats()["groups"]["g"]
    assert g["saved"] == 2 and g["offloaded"] == (2 if min_bytes == 0 else 0)  # None not counted
    before = _Pair.rebuilds
    y.sum().backward()
    assert _Pair.rebuilds == before + 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R7_grouped_tensor_data_moves_offsets_stay(impl, device):
    parts = [torch.randn(n, 64, device=device) for n in (5, 0, 300, 1)]
    gt = ao.GroupedTensor.from_tensors(parts)
    x = torch.randn(4, device=device, requires_grad=True)

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(gt)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (r,) = ctx.saved_tensors
            assert isinstance(r, ao.GroupedTensor) and r.split_sizes == [5, 0, 300, 1]
            for a, b in zip(r.split(), parts):
                assert torch.equal(a, b)
            assert torch.equal(r.offsets.cpu(), torch.tensor([0, 5, 5, 305, 306]))
            return g

    off = off_for(impl, device, keep_last=0, min_offload_bytes=1024)
    with off.group("g"):
        y = Save.apply(x)
    g = off.stats()["groups"]["g"]
    assert g["offloaded_bytes"] == 306 * 64 * 4 and g["kept"] == {"small": 1}
    y.sum().backward()


def test_R7_prepare_for_saving_must_return_tensors():
    class Bad(_Pair):
        def prepare_for_saving(self):
            return ["not a tensor"], None

        def __copy__(self):
            return Bad(self.a, self.b)

    from actoffload import multibuffer

    with pytest.raises(TypeError, match="Bad.prepare_for_saving returned a str"):
        multibuffer.split(Bad(torch.ones(2), torch.ones(2)))


def test_R7_split_never_mutates_the_callers_object():
    q = ao.quantize(torch.randn(8, 8), with_transpose=True)
    data, scale, t = q._data, q._scale_inv, q._transpose
    from actoffload import multibuffer

    parts = multibuffer.split(q)
    assert q._data is data and q._scale_inv is scale and q._transpose is t
    assert parts.buffers[0] is data
    again = parts.rebuild(parts.buffers)
    assert type(again) is ao.QuantizedTensor and torch.equal(again.dequantize(), q.dequantize())
    assert copy.copy(q)._data is data
