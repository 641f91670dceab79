"""GroupedMLP (the fused MoE expert block) and per-op offload selection (SPEC: Ops, R4, R7)."""

from unittest import mock

import pytest
import torch

import actoffload as ao
from actoffload import marks
from actoffload.ops import ACTIVATIONS, GroupedMLP, grouped_mlp_reference
from helpers import IMPLS, assert_bitwise, off_for

SPLITS = [[3, 0, 5, 1], [0, 0, 9, 0], [2, 2, 2, 3]]


def _mlp(kind="swiglu", fp8=False, dtype=torch.float32, hidden=16, ffn=24):
    torch.manual_seed(0)
    return GroupedMLP(4, hidden, ffn, activation=kind, fp8=fp8, dtype=dtype)


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("sizes", SPLITS)
def test_grouped_mlp_gradcheck_float64(kind, sizes):
    mlp = _mlp(kind, dtype=torch.float64, hidden=5, ffn=3)
    x = torch.randn(sum(sizes), 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w1, w2: mlp(x, sizes), (x, mlp.w1, mlp.w2))


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_mlp_matches_the_unfused_reference(kind, fp8):
    mlp = _mlp(kind, fp8)
    sizes = [3, 0, 5, 1]
    x = torch.randn(9, 16, requires_grad=True)
    y = mlp(x, sizes)
    y.square().sum().backward()
    got = [y.detach(), x.grad, mlp.w1.grad, mlp.w2.grad]
    x2 = x.detach().requires_grad_(True)
    w1, w2 = mlp.w1.detach().requires_grad_(True), mlp.w2.detach().requires_grad_(True)
    y2 = grouped_mlp_reference(x2, sizes, w1, w2, kind, fp8)
    y2.square().sum().backward()
    for a, b in zip(got, [y2.detach(), x2.grad, w1.grad, w2.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # same math, other summation order


def _saved_bytes(mlp, n):
    hidden, fc1_out = mlp.w1.shape[1], mlp.w1.shape[2]
    ffn = mlp.w2.shape[1]
    es = mlp.w1.element_size()
    return {"expert_fc1": n * hidden * es, "moe_act": n * fc1_out * es, "expert_fc2": n * ffn * (1 if mlp.fp8 else es)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("roles", [set(), {"moe_act"}, {"expert_fc1"}, {"expert_fc2"}, {"moe_act", "expert_fc1"}])
@pytest.mark.parametrize("fp8", [False, True])
def test_selection_offloads_exactly_the_selected_activations(impl, roles, fp8):
    mlp = _mlp(fp8=fp8)
    model = torch.nn.ModuleDict({"experts": mlp})
    assert ao.select_modules(model, roles) == [("experts", r) for r in GroupedMLP.offload_roles if r in roles]
    sizes = [3, 0, 5, 1]
    x = torch.randn(9, 16, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0, min_offload_bytes=64)  # offsets and the FP8 scale stay: small
    with off.group("moe"):
        y = mlp(x * 1, sizes)
    expected = _saved_bytes(mlp, 9)
    wanted = roles or set(expected)
    g = off.stats()["groups"]["moe"]
    assert g["offloaded_bytes"] == sum(expected[r] for r in wanted)
    assert g["offloaded"] == len(wanted)
    # each unselected role's tensor is two buffers, all vetoed: grouped data + offsets, FP8 data + scale
    assert g["kept"].get("vetoed", 0) == (0 if not roles else 2 * (3 - len(roles)))
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("roles", [set(), {"moe_act"}, {"expert_fc1", "expert_fc2"}])
@pytest.mark.parametrize("sizes", SPLITS)
def test_gradients_bitwise_equal_to_no_offload_for_each_selection(impl, roles, sizes):
    mlp = _mlp()
    ao.select_modules(mlp, roles)
    x = torch.randn(sum(sizes), 16, requires_grad=True)

    def run(off):
        for t in (x, mlp.w1, mlp.w2):
            t.grad = None
        if off is None:
            y = mlp(x * 1, sizes)
        else:
            with off.group("moe"):
                y = mlp(x * 1, sizes)
        y.square().sum().backward()
        return [y.detach(), x.grad.clone(), mlp.w1.grad.clone(), mlp.w2.grad.clone()]

    assert_bitwise(run(None), run(off_for(impl, "cpu", keep_last=0)))


def test_no_marking_work_without_an_open_group():
    mlp = _mlp()
    ao.select_modules(mlp, {"moe_act"})
    with mock.patch.object(marks, "_mark", side_effect=AssertionError("marked outside a group")):
        mlp(torch.randn(9, 16), [3, 0, 5, 1]).sum()


def test_select_modules_replaces_the_selection_and_names_bad_roles():
    model = torch.nn.ModuleDict({"a": _mlp(), "b": _mlp()})
    assert ao.select_modules(model, {"moe_act"}) == [("a", "moe_act"), ("b", "moe_act")]
    assert ao.select_modules(model, {"expert_fc2"}) == [("a", "expert_fc2"), ("b", "expert_fc2")]
    assert model["a"].offload_selected == {"expert_fc2"}
    assert ao.select_modules(model, set()) == [] and model["b"].offload_selected == set()
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['moe'\]; valid roles are: attn_norm, qkv"):
        ao.select_modules(model, {"moe"})


def test_grouped_mlp_rejects_bad_splits_and_activations():
    mlp = _mlp()
    with pytest.raises(ValueError, match="4 counts >= 0 summing to the 9 tokens, got \\[3, 3\\]"):
        mlp(torch.randn(9, 16), [3, 3])
    with pytest.raises(ValueError, match="unknown activation 'relu'; valid ones are: swiglu, gelu, srelu"):
        GroupedMLP(2, 4, 4, activation="relu")
