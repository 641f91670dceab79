"""R1, R3, R7: every kind of tensor PyTorch can save either round-trips exactly or stays
resident with a reason; never a crash, never a silently different gradient."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.testing._internal.two_tensor import TwoTensor

import actoffload as ao
from helpers import IMPLS, off_for


def _grads(fn, leaves, off):
    """Gradients of ``fn()`` w.r.t. ``leaves``, run inside one group (or with no offloader)."""
    for t in leaves:
        t.grad = None
    if off is None:
        out = fn()
    else:
        with off.group("g"):
            out = fn()
        with off.group("next"):  # commits "g" (keep_last=1) or just follows it
            out = out * 1
    out.abs().sum().backward() if out.is_complex() else out.sum().backward()
    return [t.grad.clone() for t in leaves]


def _assert_same(fn, leaves, impl, keep_last=0):
    expected = _grads(fn, leaves, None)
    off = off_for(impl, "cpu", keep_last=keep_last)
    got = _grads(fn, leaves, off)
    for a, b in zip(got, expected):
        assert torch.equal(a, b), f"max |diff| {(a - b).abs().max()}"
    return off


@pytest.mark.parametrize("impl", IMPLS)
def test_R1_conjugate_view_comes_back_conjugated(impl):
    x = torch.randn(64, 64, dtype=torch.complex64)
    w = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)
    off = _assert_same(lambda: (x * 2).conj() * w, [w], impl)
    assert off.stats()["groups"]["g"]["offloaded"] >= 1  # the conj view moved, and came back right


@pytest.mark.parametrize("impl", IMPLS)
def test_R1_matmul_with_an_adjoint_view(impl):
    q = torch.randn(32, 16, dtype=torch.complex64, requires_grad=True)
    k = torch.randn(32, 16, dtype=torch.complex64, requires_grad=True)
    _assert_same(lambda: (q * 1) @ (k * 1).mH, [q, k], impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_R1_negative_bit_view_keeps_its_sign(impl):
    z = torch.randn(64, 64, dtype=torch.complex64)
    w = torch.randn(64, 64, requires_grad=True)

    def fn():
        n = (z * 2).conj().imag  # a view with the negative bit set
        assert n.is_neg()
        return n * w

    _assert_same(fn, [w], impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_R1_parameter_data_replaced_after_the_save_is_seen_in_backward(impl):
    """``x * w`` saves the parameter itself; PyTorch's backward then sees its new ``.data``."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    new = torch.full((64, 64), 3.0)

    def run(off):
        w.data = torch.ones(64, 64)
        x.grad = None
        if off is None:
            y = x * w
        else:
            with off.group("g"):
                y = x * w
        w.data = new
        y.sum().backward()
        return x.grad.clone()

    assert torch.equal(run(off_for(impl, "cpu", keep_last=0)), run(None))


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_detached_view_of_a_parameter_is_recognised_by_its_storage(impl):
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0)
    with off.group("g"):
        F.linear(x * 1, lin.weight.detach(), lin.bias)  # saves weight.detach().t(), no _base
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 0 and g["kept"] == {"parameter": 1}


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_a_parameter_whose_data_was_replaced_is_still_recognised_under_wrap(impl):
    lin = torch.nn.Linear(64, 64)
    lin.weight.data = torch.randn(64, 64)  # a new storage, registered nowhere
    off = off_for(impl, "cpu", keep_last=0)

    class Detached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return F.linear(x, self.lin.weight.detach(), self.lin.bias)

    m = Detached()
    with ao.wrap(m, off):
        m(torch.randn(8, 64, requires_grad=True) * 1)
    assert off.stats()["groups"]["0"]["kept"] == {"parameter": 1}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", [64, 1024], ids=["small", "large"])
def test_R7_wrapper_subclass_moves_by_its_inner_tensors(impl, size):
    """TwoTensor speaks __tensor_flatten__ (as DTensor and torchao's Float8 do): its two inner
    tensors are saved buffers of their own, and the wrapper comes back as a TwoTensor."""
    a = torch.randn(size, 64, requires_grad=True)
    t = TwoTensor(torch.randn(size, 64), torch.randn(size, 64))
    off = _assert_same(lambda: (a * t).sin(), [a], impl)
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] >= 2  # a*t's two inner tensors (sin saves its input)


@pytest.mark.parametrize("impl", IMPLS)
def test_R6_in_place_write_to_a_saved_wrapper_subclass_raises(impl):
    a = torch.randn(64, 64, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0)
    with off.group("g"):
        h = a * TwoTensor(torch.randn(64, 64), torch.randn(64, 64))
        y = h.sin()  # saves h
    with torch.no_grad():
        h.add_(1)  # bumps the wrapper's version, not its inner tensors'
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R1_forward_mode_ad_inside_a_group_matches_with_a_zero_tensor_kept(impl):
    """Dual tensors move like any other (autograd keeps their tangents beside the saved
    primal); the ZeroTensor a non-dual operand's tangent becomes has no data and stays."""
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    tangent = torch.randn(64, 64)

    def run(off):
        with fwAD.dual_level():
            d = fwAD.make_dual(x * 1, tangent)
            if off is None:
                z = (d * w).sin() * 2
            else:
                with off.group("g"):
                    y = (d * w).sin()  # d * w saves w's tangent: a ZeroTensor
                with off.group("h"):
                    z = y * 2
            jvp = fwAD.unpack_dual(z).tangent.clone()
            (g,) = torch.autograd.grad(z.sum(), w, create_graph=True)  # forward over reverse
            return jvp, g.detach().clone(), fwAD.unpack_dual(g).tangent.clone()

    off = off_for(impl, "cpu", keep_last=0)
    for a, b in zip(run(off), run(None)):
        assert torch.equal(a, b)
    g = off.stats()["groups"]["g"]
    assert g["kept"].get("device") == 1 and g["offloaded"] >= 2


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_nested_tensor_stays_resident_with_reason_device(impl):
    w = torch.randn(64, 64, requires_grad=True)

    nt = torch.nested.nested_tensor([torch.randn(2, 64), torch.randn(3, 64)])

    def run(off):
        w.grad = None
        if off is None:
            y = F.linear(nt, w)
            z = y * 2
        else:
            with off.group("g"):
                y = F.linear(nt, w)  # saves the nested input
            with off.group("h"):  # opening it commits "g": no error here either
                z = y * 2
        torch.nested.to_padded_tensor(z, 0.0).sum().backward()
        return w.grad.clone()

    off = off_for(impl, "cpu", keep_last=0)
    assert torch.equal(run(off), run(None))
    assert off.stats()["groups"]["g"]["kept"].get("device", 0) >= 1


def _stays_resident_and_comes_back(impl, saved, check):
    """Save ``saved`` (a constant) inside a group; it must stay (reason device) and come back
    from backward passing ``check``."""
    seen = []

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(saved)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(check(ctx.saved_tensors[0]))
            return g * 2

    off = off_for(impl, "cpu", keep_last=0)
    with off.group("g"):
        y = Save.apply(torch.randn(64, 64, requires_grad=True))
    assert off.stats()["groups"]["g"]["kept"] == {"device": 1}
    y.sum().backward()
    assert seen == [True]


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_quantized_dtype_tensor_stays_resident(impl):
    q = torch.quantize_per_tensor(torch.randn(64, 64), 0.1, 0, torch.qint8)
    _stays_resident_and_comes_back(impl, q, lambda r: r.is_quantized and torch.equal(r.int_repr(), q.int_repr()))


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_python_subclass_with_storage_stays_resident_and_keeps_its_type(impl):
    class Tagged(torch.Tensor):
        pass

    _stays_resident_and_comes_back(impl, torch.randn(64, 64).as_subclass(Tagged), lambda r: type(r) is Tagged)


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_detached_weight_is_recognised_after_the_model_moved(impl):
    """``model.to(...)``/``model.cuda()`` give parameters new storages without registering
    them again: a detached view of a weight must still be recognised."""
    lin = torch.nn.Linear(64, 64).to(torch.float64)  # a new storage, as .cuda() makes
    x = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0)
    with off.group("g"):
        F.linear(x * 1, lin.weight.detach(), lin.bias)
    assert off.stats()["groups"]["g"]["kept"] == {"parameter": 1}
