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
        y = F.linear(x * 1, lin.weight)  # saves its input and weight.t() (a view, not the Parameter)
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
        y = _SaveOther.apply(x * 1, other)
    y.grad_fn.other_device = other.device
    assert off.stats()["groups"]["g"]["kept"] == {"device": 1} and off.stats()["groups"]["g"]["offloaded"] == 1
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2))


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_policy_marked_moves_only_opted_in(impl):
    off = off_for(impl, "cpu", keep_last=0, policy="marked")
    x = torch.randn(1024, requires_grad=True)
    with off.group("g"):
        a = x.exp()  # saves a (output)
        b = a.sin()  # saves a again: same storage
        c = (x * 1).cos()  # saves x * 1
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
        y = (x.exp() * w).sum()
    # e = x.exp(), saved twice: not marked (and small); w: parameter (and vetoed, not marked, small)
    assert off.stats()["groups"]["g"]["kept"] == {"not_marked": 2, "parameter": 1}  # exp and mul both save e
    y.backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["leaf", "view_of_leaf"])
def test_R3_leaves_that_require_grad_stay_the_graph_holds_them(impl, device, which):
    """AccumulateGrad keeps such a leaf alive as long as the graph: moving it frees nothing."""
    x = torch.randn(64, 64, device=device, requires_grad=True)
    off = off_for(impl, device, keep_last=0)
    with off.group("g"):
        y = (x if which == "leaf" else x[2:]).sin()
    assert off.stats()["groups"]["g"]["kept"] == {"parameter": 1}
    y.sum().backward()
    assert torch.equal(x.grad[2:], x.detach()[2:].cos())


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_a_jagged_nested_tensor_stays_resident_and_backward_matches(impl):
    """A jagged nested tensor is a wrapper subclass, but not one to take apart (R7): rebuilt from
    moved buffers it got a ragged size of its own, and backward raised on the mismatch."""
    def grads(off):
        torch.manual_seed(0)
        nt = torch.nested.nested_tensor([torch.randn(30, 64), torch.randn(50, 64), torch.randn(20, 64)],
                                        layout=torch.jagged, requires_grad=True)
        if off is None:
            z = torch.sin(F.gelu(nt))
        else:
            with off.group("g"):
                z = torch.sin(F.gelu(nt))
        z.values().sum().backward()
        return nt.grad.values()

    off = ao.Offloader(impl=impl, device="cpu", keep_last=0, min_offload_bytes=0)
    assert torch.equal(grads(off), grads(None))
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 0 and set(g["kept"]) == {"device"}


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_a_multi_buffer_leaf_that_requires_grad_stays_as_a_parameter(impl):
    """Its buffers are leaves that do not require grad, but the tensor they make up is one that
    does: autograd holds it, so moving its buffers would free nothing (as for a plain leaf)."""
    from torch.testing._internal.two_tensor import TwoTensor

    off = ao.Offloader(impl=impl, device="cpu", keep_last=0, min_offload_bytes=0)
    x = TwoTensor(torch.randn(64, 64), torch.randn(64, 64)).requires_grad_(True)
    with off.group("g"):
        y = x * x
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 0 and set(g["kept"]) == {"parameter"}, g
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R3_grouped_mlp_on_tokens_that_require_grad_keeps_their_bytes_as_a_parameter(impl):
    """The fused op saves its tokens inside a GroupedTensor of its own; tokens that are a leaf
    requiring grad stay, as a plain op's save of them would."""
    from actoffload.ops import GroupedMLP

    torch.manual_seed(0)
    m = GroupedMLP(2, 32, 16, activation="gelu")
    ao.select_modules(m, {"expert_fc1"})
    off = ao.Offloader(impl=impl, device="cpu", keep_last=0, min_offload_bytes=64)  # (the 24-byte offsets stay)
    tokens = torch.randn(64, 32, requires_grad=True)
    with off.group("moe"):
        y = m(tokens, [40, 24])
    g = off.stats()["groups"]["moe"]
    assert g["offloaded_bytes"] == 0 and g["kept"]["parameter"] == 3, g  # the tokens, w1, w2
    y.sum().backward()
