"""R5: aliases are moved once and each comes back with its own size, stride and offset."""

import pytest
import torch

import actoffload as ao
from helpers import DEVICES, IMPLS, off_for


class _SaveAll(torch.autograd.Function):
    """Saves the given aliases; backward checks they came back exactly, then passes grad."""

    @staticmethod
    def forward(ctx, x, *aliases):
        ctx.save_for_backward(*aliases)
        ctx.expected = [(a.shape, a.stride(), a.storage_offset() * a.element_size(), a.detach().clone()) for a in aliases]
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        restored = ctx.saved_tensors
        offsets = [r.storage_offset() * r.element_size() for r in restored]  # in bytes
        for r, (shape, stride, offset, value), o in zip(restored, ctx.expected, offsets):
            assert r.shape == shape and r.stride() == stride, (r.shape, shape, r.stride(), stride)
            assert torch.equal(r, value)
        # relative byte offsets and storage sharing are preserved
        exp_offsets = [e[2] for e in ctx.expected]
        assert [o - offsets[0] for o in offsets] == [o - exp_offsets[0] for o in exp_offsets]
        assert len({r.untyped_storage().data_ptr() for r in restored}) == 1
        ctx.checked = True
        return (g,) + (None,) * len(restored)


def _aliases(base):
    return {
        "transpose": [base, base.t()],
        "slices": [base[2:5], base[10:], base[:, 7]],
        "reshape_expand": [base.reshape(-1), base[0].expand(4, -1)],
        "as_strided": [base.as_strided((5, 5), (3, 1), 11), base.as_strided((2, 3), (1, 2), 100)],
        "dtype_view": [base.view(torch.uint8)[1:], base[1:3]],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", list(_aliases(torch.zeros(32, 32))))
def test_R5_aliases_restored_with_their_own_strides(impl, device, kind):
    base = torch.randn(32, 32, device=device)
    aliases = _aliases(base)[kind]
    x = torch.randn(4, device=device, requires_grad=True)
    off = off_for(impl, device, keep_last=0)
    with off.group("g"):
        y = _SaveAll.apply(x, *aliases)
    del aliases, base
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 1 and g["kept"].get("alias", 0) == g["saved"] - 1
    assert off.stats()["host_bytes_in_use"] <= 32 * 32 * 4  # never more than the span
    y.sum().backward()
    assert y.grad_fn.checked


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R5_transpose_alias_restored_with_its_own_strides_through_matmul(impl, device):
    a = torch.randn(64, 48, device=device, requires_grad=True)
    off = off_for(impl, device, keep_last=0)
    with off.group("g"):
        h = a.exp()
        y = h @ h.t()  # saves h and h.t(): same pointer, different strides (exp saved h too)
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 1 and g["kept"] == {"alias": 2}
    assert g["offloaded_bytes"] == 64 * 48 * 4
    y.sum().backward()
    h = a.detach().exp()
    expected = (torch.ones(64, 64, device=device) @ h + torch.ones(64, 64, device=device).t() @ h) * h
    assert torch.allclose(a.grad, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_R5_span_covers_only_what_the_aliases_touch(impl):
    big = torch.randn(1000, 100)
    x = torch.randn(4, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0)
    with off.group("g"):
        y = _SaveAll.apply(x, big[10:20], big[15:30])
    assert off.stats()["groups"]["g"]["offloaded_bytes"] == 20 * 100 * 4
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R5_one_vetoed_alias_keeps_the_whole_storage(impl):
    base = torch.randn(64, 64)
    x = torch.randn(4, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0)
    with off.group("g"):
        y = _SaveAll.apply(x, base[:10], base[20:])
        ao.mark_not_offload(base[20:])
    assert off.stats()["groups"]["g"]["kept"] == {"vetoed": 2}
    y.sum().backward()
