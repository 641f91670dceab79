"""R2: only tensors saved while a group is open are candidates; groups do not nest."""

import pytest
import torch

from helpers import DEVICES, IMPLS, off_for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R2_outside_a_group_nothing_is_saved_or_moved(impl, device):
    off = off_for(impl, device, keep_last=0)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with off.group("inside"):
        y = x.exp()
    z = y.sin()  # saved outside any group: autograd keeps it as usual
    s = off.stats()
    assert s["groups"]["inside"]["saved"] == 1 and s["groups"]["inside"]["offloaded"] == 1
    assert list(s["groups"]) == ["inside"]
    z.sum().backward()
    assert torch.equal(x.grad, (x.exp() * x.exp().cos()).detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_R2_no_grad_and_inference_mode_do_nothing(impl, device, mode):
    off = off_for(impl, device, keep_last=0)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx, off.group("g"):
        x.exp().sin()
    s = off.stats()
    assert s["groups"]["g"]["saved"] == 0 and s["offloaded_bytes"] == 0 and s["host_bytes_in_use"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_R2_nested_groups_raise_and_name_both(impl):
    off = off_for(impl, "cpu")
    with off.group("outer"):
        with pytest.raises(RuntimeError, match="inside group 'outer'.*do not nest"):
            with off.group("inner"):
                pass
    with off.group("after"):  # still usable
        pass


@pytest.mark.parametrize("impl", IMPLS)
def test_R2_nesting_across_offloaders_raises(impl):
    a, b = off_for(impl, "cpu"), off_for(impl, "cpu")
    with a.group("a"):
        with pytest.raises(RuntimeError, match="do not nest"):
            with b.group("b"):
                pass
