"""GroupedMLP (the fused MoE expert block) and per-op offload selection (docs/semantics.md: Ops, R4, R7)."""

import contextlib
from unittest import mock

import pytest
import torch

import actoffload as ao
from actoffload import marks
from actoffload.ops import ACTIVATIONS, GroupedMLP, _GroupedMLPFunction, grouped_mlp_reference
from helpers import CUDA, DEVICES, IMPLS, assert_bitwise, off_for

SPLITS = [[3, 0, 5, 1], [0, 0, 9, 0], [2, 2, 2, 3]]


def _mlp(kind="swiglu", fp8=False, dtype=torch.float32, hidden=16, ffn=24, device="cpu"):
    torch.manual_seed(0)
    return GroupedMLP(4, hidden, ffn, activation=kind, fp8=fp8, dtype=dtype, device=device)


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("sizes", SPLITS)
def test_grouped_mlp_gradcheck_float64(kind, sizes):
    mlp = _mlp(kind, dtype=torch.float64, hidden=5, ffn=3)
    x = torch.randn(sum(sizes), 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w1, w2: mlp(x, sizes), (x, mlp.w1, mlp.w2))


def _fused_and_unfused(mlp, x, sizes, dtype=None):
    """Output and gradients (input, w1, w2) of the op and of the unfused reference, the
    reference run on copies cast to ``dtype`` (default: the op's own)."""
    def run(fn, x, w1, w2):
        x, w1, w2 = (t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x, w1, w2))
        y = fn(x, w1, w2)
        y.float().square().sum().backward()
        return [y.detach(), x.grad, w1.grad, w2.grad]

    fused = run(lambda x, w1, w2: _GroupedMLPFunction.apply(x, w1, w2, sizes, mlp.activation, mlp.fp8, frozenset()),
                x, mlp.w1, mlp.w2)
    unfused = run(lambda x, w1, w2: grouped_mlp_reference(x, sizes, w1, w2, mlp.activation, mlp.fp8), x, mlp.w1, mlp.w2)
    return fused, unfused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_mlp_matches_the_unfused_reference(device, kind, fp8):
    mlp = _mlp(kind, fp8, device=device)
    x = torch.randn(9, 16, device=device)
    fused, unfused = _fused_and_unfused(mlp, x, [3, 0, 5, 1])
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # same math, other summation order


@pytest.mark.skipif(not CUDA, reason="bf16 tolerances are for CUDA kernels; CI has no GPU")
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_mlp_bf16_on_cuda_is_as_accurate_as_the_unfused_reference(kind, fp8):
    # bf16 keeps 8 significant bits, so one rounding is off by up to 2**-9 relative; fused and
    # unfused round at different points (the op keeps whole-batch intermediates, the reference
    # per-expert ones), so they cannot agree bitwise. The justified check: measured against a
    # float64 run of the same weights, the fused op's error is no larger than the unfused
    # reference's (up to 1.5x plus one bf16 rounding of the largest value).
    mlp = _mlp(kind, fp8, dtype=torch.bfloat16, hidden=256, ffn=512, device="cuda")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    sizes = [120, 0, 100, 80]
    fused, unfused = _fused_and_unfused(mlp, x, sizes)
    _, exact = _fused_and_unfused(mlp, x, sizes, dtype=torch.float64)
    for name, f, u, e in zip(["output", "d input", "d w1", "d w2"], fused, unfused, exact):
        scale = e.abs().max().item()
        err_fused = (f.double() - e).abs().max().item()
        err_unfused = (u.double() - e).abs().max().item()
        assert err_fused <= 1.5 * err_unfused + scale * 2**-9, (name, err_fused, err_unfused, scale)


def _saved_bytes(mlp, n):
    hidden, fc1_out = mlp.w1.shape[1], mlp.w1.shape[2]
    ffn = mlp.w2.shape[1]
    es = mlp.w1.element_size()
    return {"expert_fc1": n * hidden * es, "moe_act": n * fc1_out * es, "expert_fc2": n * ffn * (1 if mlp.fp8 else es)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("roles", [set(), {"moe_act"}, {"expert_fc1"}, {"expert_fc2"}, {"moe_act", "expert_fc1"}])
@pytest.mark.parametrize("fp8", [False, True])
def test_selection_offloads_exactly_the_selected_activations(device, impl, roles, fp8):
    mlp = _mlp(fp8=fp8, device=device)
    model = torch.nn.ModuleDict({"experts": mlp})
    assert ao.select_modules(model, roles) == [("experts", r) for r in GroupedMLP.offload_roles if r in roles]
    sizes = [3, 0, 5, 1]
    x = torch.randn(9, 16, device=device, requires_grad=True)
    off = off_for(impl, device, keep_last=0, min_offload_bytes=64)  # offsets and the FP8 scale stay: small
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("roles", [set(), {"moe_act"}, {"expert_fc1", "expert_fc2"}])
@pytest.mark.parametrize("sizes", SPLITS)
def test_gradients_bitwise_equal_to_no_offload_for_each_selection(device, impl, roles, sizes):
    mlp = _mlp(device=device)
    ao.select_modules(mlp, roles)
    x = torch.randn(sum(sizes), 16, device=device, requires_grad=True)

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

    assert_bitwise(run(None), run(off_for(impl, device, keep_last=0)))


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
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['nope', 1\]; valid roles"):
        ao.select_modules(model, {"nope", 1})  # (sorting them by value raised TypeError)
    with pytest.raises(TypeError, match="a collection of roles, got the str 'moe_act': write {'moe_act'}"):
        ao.select_modules(model, "moe_act")  # was the roles 'm', 'o', 'e', ...: unknown
    with pytest.raises(TypeError, match=r"the model \(an nn.Module\) first, got int"):
        ao.select_modules(5, {"moe_act"})


def test_grouped_mlp_rejects_bad_splits_and_activations():
    mlp = _mlp()
    with pytest.raises(ValueError, match="4 counts >= 0 summing to the 9 tokens, got \\[3, 3\\]"):
        mlp(torch.randn(9, 16), [3, 3])
    with pytest.raises(ValueError, match="unknown activation 'relu'; valid ones are: swiglu, gelu, srelu"):
        GroupedMLP(2, 4, 4, activation="relu")


def _copying_hooks(device):
    """save_on_cpu on CUDA; on the CPU (where it moves nothing) hooks that copy the same way,
    into a new plain tensor: the tensor subclasses the op saves come back as plain tensors."""
    if device == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    def pack(t):
        copy = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
        copy.copy_(t)
        return copy

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_mlp_under_save_on_cpu_style_hooks_gives_the_same_gradients(device, fp8):
    mlp = _mlp(fp8=fp8, device=device)
    x = torch.randn(9, 16, device=device, requires_grad=True)

    def grads(hooks):
        for t in (x, mlp.w1, mlp.w2):
            t.grad = None
        with hooks:
            y = mlp(x * 1, [3, 0, 5, 1])
        y.square().sum().backward()
        return [x.grad.clone(), mlp.w1.grad.clone(), mlp.w2.grad.clone()]

    assert_bitwise(grads(contextlib.nullcontext()), grads(_copying_hooks(device)))


@pytest.mark.parametrize("device", DEVICES)
def test_R6_writing_the_tokens_in_place_after_the_forward_raises_as_autograd_would(device):
    """The op saves a GroupedTensor over its input's bytes, whose own version counter autograd
    checks; a residual written in place (h += moe(h)) would change the bytes backward reads
    without it noticing. The op checks the tokens' version itself, with or without an offloader."""
    torch.manual_seed(0)
    moe = GroupedMLP(2, 8, 16).to(device)
    h = torch.randn(6, 8, device=device, requires_grad=True) * 1
    h += moe(h, [2, 4])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()
    h = torch.randn(6, 8, device=device, requires_grad=True) * 1
    h = h + moe(h, [2, 4])  # out of place: fine
    h.sum().backward()
