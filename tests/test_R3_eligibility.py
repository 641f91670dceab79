"""R3: a buffer moves only if on the device, not a parameter, big enough, not vetoed, opted in when needed."""

import pytest
import torch
import torch.nn.functional as F

import actoffload as ao
from helpers import DEVICES, IMPLS, off_for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R3_linear_weight_view_is_kept_as_parameter(impl, device):
    lin = torch.nn.Linear(32, 32).to(device)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    F.linear(x, lin.weight).sum().backward()
    expected = lin.weight.grad.clone()
    lin.weight.grad = None
    off = off_for(impl, device, keep_last=0)
    with off.group("lin"):
        y = F.linear(x, lin.weight)  # saves x and weight.t() (a view, not the Parameter)
    g = off.stats()["groups"]["lin"]
    assert g["kept"] == {"parameter": 1} and g["offloaded"] == 1
    y.sum().backward()
    assert torch.equal(lin.weight.grad, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R3_buffers_below_min_offload_bytes_stay(impl, device):
    x = torch.randn(256, device=device, requires_grad=True)  # 1 KiB
    off = off_for(impl, device, keep_last=0, min_offload_bytes=1025)
    with off.group("g"):
        y = x.exp()
    assert off.stats()["groups"]["g"]["kept"] == {"small": 1}
    off2 = off_for(impl, device, keep_last=0, min_offload_bytes=1024)
    with off2.group("g"):
        y = x.exp()
    assert off2.stats()["groups"]["g"]["offloaded_bytes"] == 1024
    y.sum().backward()


class _SaveOther(torch.autograd.Function):
    """Saves an extra tensor of the caller's choosing (to test non-device saves)."""

    @staticmethod
    def forward(ctx, x, other):
        ctx.save_for_backward(x, other)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        x, other = ctx.saved_tensors
        assert other.device == ctx.other_device
        return g * 2, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("other_device", ["meta", "other"])
def test_R3_tensors_off_the_compute_device_stay(impl, device, other_device):
    if other_device == "other":
        other_device = "cuda" if device == "cpu" and torch.cuda.is_available() else "cpu"
        if other_device == device:
            pytest.skip("needs a second device type")
    x = torch.randn(1024, device=device, requires_grad=True)
    other = torch.randn(1024, device=other_device)
    off = off_for(impl, device, keep_last=0)
    with off.group("g"):
        y = _SaveOther.apply(x, other)
    y.grad_fn.other_device = other.device
    assert off.stats()["groups"]["g"]["kept"] == {"device": 1}
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2))


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_policy_marked_moves_only_opted_in(impl):
    off = off_for(impl, "cpu", keep_last=0, policy="marked")
    x = torch.randn(1024, requires_grad=True)
    with off.group("g"):
        a = x.exp()  # saves a (output)
        b = a.sin()  # saves a again: same storage
        c = x.cos()  # saves x
        ao.mark_activation_offload(a)
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 1 and g["kept"] == {"alias": 1, "not_marked": 1}
    (b + c).sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_reason_order_device_before_parameter_before_veto(impl):
    w = torch.nn.Parameter(torch.randn(1024))
    ao.mark_not_offload(w)
    off = off_for(impl, "cpu", keep_last=0, policy="marked", min_offload_bytes=1 << 30)
    x = torch.randn(1024, requires_grad=True)
    with off.group("g"):
        y = (x * w).sum()
    # x: not marked (and small); w: parameter (and vetoed, not marked, small)
    assert off.stats()["groups"]["g"]["kept"] == {"not_marked": 1, "parameter": 1}
    y.backward()
