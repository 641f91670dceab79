"""R6: a saved tensor modified in place after the save makes backward raise, as without an offloader."""

import pytest
import torch

import actoffload as ao
from helpers import DEVICES, IMPLS, off_for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("moved", [True, False], ids=["offloaded", "kept"])
@pytest.mark.parametrize("via", ["tensor", "view"])
def test_R6_inplace_after_save_raises(impl, device, moved, via):
    off = off_for(impl, device, keep_last=0, min_offload_bytes=0 if moved else 1 << 30)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with off.group("g"):
        y = x.exp()  # saves its output y
    assert off.stats()["groups"]["g"]["offloaded"] == int(moved)
    target = y if via == "tensor" else y[5:9]
    with torch.no_grad():
        target.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R6_inplace_between_save_and_commit_raises(impl):
    off = off_for(impl, "cpu", keep_last=1)
    x = torch.randn(64, 64, requires_grad=True)
    with off.group("a"):
        y = x.exp()
    with torch.no_grad():
        y.add_(1)  # a not committed yet: the copy would take the modified data
    with off.group("b"):
        pass
    assert off.stats()["groups"]["a"]["offloaded"] == 1
    with pytest.raises(RuntimeError, match="version 0 at save, 1 now"):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R6_same_error_class_as_without_offloader(impl):
    def run(off):
        x = torch.randn(16, 16, requires_grad=True)
        if off is None:
            y = x.exp()
        else:
            with off.group("g"):
                y = x.exp()
        with torch.no_grad():
            y.zero_()
        y.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(None)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        run(off_for(impl, "cpu", keep_last=0))


@pytest.mark.parametrize("impl", IMPLS)
def test_R6_inplace_before_save_is_fine(impl):
    off = off_for(impl, "cpu", keep_last=0)
    x = torch.randn(64, requires_grad=True)
    with off.group("g"):
        y = x * 1
        y.add_(1)  # before the save below
        z = y.exp()
    z.sum().backward()
    assert torch.equal(x.grad, (x.detach() + 1).exp())


class _SavesItsOwn(torch.nn.Module):
    """Saves a tensor of its own making (``a``, twice by the product), kept for a test to write."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.made = None

    def forward(self, h):
        self.made = a = self.linear(h)
        return (a * a).sum(-1, keepdim=True) * h


def test_R6_a_budget_that_keeps_the_first_group_whole_still_raises_for_a_write_after_the_save():
    """A plan keeping everything leaves the first group its hooks (to see the workload), which hand
    autograd its own tensors back: autograd checks no version of those, so the offloader does."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_SavesItsOwn() for _ in range(3))
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    ao.wrap(blocks, off)
    for step in range(4):
        h = torch.randn(4, 16, requires_grad=True)
        for block in blocks:
            h = block(h)
        if step < 3:
            h.sum().backward()
    assert [g["action"] for g in off.stats()["plan"]["groups"]] == ["keep"] * 3
    blocks[0].made.mul_(2)
    with pytest.raises(RuntimeError, match=r"offload group '0'.*modified by an in-place operation"):
        h.sum().backward()
