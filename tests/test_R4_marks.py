"""R4: marks apply to the storage, veto wins, decisions are made at commit, no leak across reuse."""

import gc

import pytest
import torch

import actoffload as ao
from actoffload import marks
from helpers import DEVICES, IMPLS, off_for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("order", ["veto_first", "opt_in_first"])
def test_R4_veto_wins_whatever_the_order(impl, device, order):
    off = off_for(impl, device, keep_last=0, policy="marked")
    x = torch.randn(1024, device=device, requires_grad=True)
    with off.group("g"):
        y = x.exp()
        calls = [ao.mark_not_offload, ao.mark_activation_offload]
        for mark in calls if order == "veto_first" else calls[::-1]:
            mark(y)
    assert off.stats()["groups"]["g"]["kept"] == {"vetoed": 1}
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["view", "detach", "base"])
def test_R4_mark_on_any_alias_covers_the_saved_tensor(impl, device, which):
    off = off_for(impl, device, keep_last=0)
    x = torch.randn(32, 32, device=device, requires_grad=True)
    with off.group("g"):
        y = x.exp()  # y saved
        alias = {"view": y[3:], "detach": y.detach(), "base": y}[which]
        ao.mark_not_offload(alias)
        z = y.sum()
    assert off.stats()["groups"]["g"]["kept"] == {"vetoed": 1}
    z.backward()
    assert torch.equal(x.grad, x.detach().exp())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R4_mark_after_save_before_commit_applies(impl, device):
    off = off_for(impl, device, keep_last=1)
    x = torch.randn(1024, device=device, requires_grad=True)
    with off.group("a"):
        y = x.exp()
    ao.mark_not_offload(y)  # after a's exit, before a commits (b opens)
    with off.group("b"):
        z = y.sin()
    assert off.stats()["groups"]["a"]["kept"] == {"vetoed": 1}
    z.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R4_mark_after_commit_does_not_apply(impl):
    off = off_for(impl, "cpu", keep_last=0)
    x = torch.randn(1024, requires_grad=True)
    with off.group("a"):
        y = x.exp()
    ao.mark_not_offload(y)  # a already committed
    assert off.stats()["groups"]["a"]["offloaded"] == 1
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


@pytest.mark.parametrize("impl", IMPLS)
def test_R4_mark_does_not_leak_to_a_tensor_reusing_the_address(impl):
    off = off_for(impl, "cpu", keep_last=0)
    old = torch.empty(4096, dtype=torch.uint8)
    ptr = old.data_ptr()
    ao.mark_not_offload(old)
    del old
    gc.collect()
    x = None
    for _ in range(200):  # the allocator usually hands the freed block to a same-size tensor
        candidate = torch.randn(1024)
        assert marks.flags_of(candidate.untyped_storage()._cdata) == 0
        if candidate.data_ptr() == ptr:
            x = candidate
            break
    x = candidate if x is None else x
    w = torch.ones(1024, requires_grad=True)
    with off.group("g"):
        y = x * w  # saves x (to compute w's gradient), the tensor at the reused address
    assert off.stats()["groups"]["g"] == {"saved": 1, "offloaded": 1, "offloaded_bytes": 4096, "kept": {}}
    y.sum().backward()
    assert torch.equal(w.grad, x)


def test_R4_marks_live_as_long_as_the_storage():
    before = marks.live_mark_count()
    t = torch.randn(10)
    ao.mark_not_offload(t[2:])
    assert marks.live_mark_count() == before + 1
    v = t.view(2, 5)
    del t
    assert marks.live_mark_count() == before + 1  # a view keeps the storage
    del v
    gc.collect()
    assert marks.live_mark_count() == before


def test_R4_marking_none_is_a_no_op_and_non_tensors_raise():
    ao.mark_not_offload(None)
    ao.mark_activation_offload(None, None)
    with pytest.raises(TypeError, match="mark_not_offload takes tensors.*list"):
        ao.mark_not_offload([torch.ones(1)])
    with pytest.raises(TypeError, match="mark_activation_offload takes tensors.*int"):
        ao.mark_activation_offload(3)


@pytest.mark.parametrize("make", [lambda: torch.randn(4, 4).to_sparse(), lambda: torch.randn(4, 4).to_sparse_csr()],
                         ids=["sparse_coo", "sparse_csr"])
def test_R4_marking_a_tensor_without_a_storage_of_its_own_does_nothing(make):
    """Such a tensor stays resident anyway (R3): a mark has nothing to apply to, and is no error."""
    t = make()
    before = marks.live_mark_count()
    ao.mark_not_offload(t)
    ao.mark_activation_offload(t)
    assert marks.live_mark_count() == before


@pytest.mark.parametrize("impl", IMPLS)
def test_R4_marking_a_multibuffer_tensor_marks_its_buffers(impl):
    q = ao.quantize(torch.randn(64, 64))
    ao.mark_not_offload(q)
    assert marks.flags_of(q._data.untyped_storage()._cdata) & marks.VETO
    assert marks.flags_of(q._scale_inv.untyped_storage()._cdata) & marks.VETO
