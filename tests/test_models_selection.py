"""Per-role offload selection on the GPT models: MoE experts and attention/norm roles."""

import pytest
import torch

import actoffload as ao
from actoffload.tools.models import GPT, GPTConfig
from helpers import DEVICES, IMPLS, assert_bitwise, deterministic, grads_of, off_for, zero_grads

B, T, D = 2, 8, 16


def _model(device="cpu", **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=40, seq_len=T, d_model=D, n_heads=2, n_layers=2, embedding=False, **kw)
    return GPT(cfg).to(device)


def _grads(model, x, off):
    zero_grads(model, x)
    handle = ao.wrap(model.blocks, off) if off is not None else None
    model(x * 1).square().mean().backward()
    if handle:
        handle.remove()
    return grads_of(model, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("roles", [set(), {"moe_act"}, {"expert_fc1", "moe_act"}, {"qkv", "expert_fc2"}])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_gpt_gradients_bitwise_equal_for_each_selection(device, impl, roles, fp8):
    model = _model(device, n_experts=8, top_k=2, expert_fp8=fp8)  # 32 slots over 8 experts: uneven splits
    ao.select_modules(model, roles)
    x = torch.randn(B, T, D, device=device, requires_grad=True)
    with deterministic():  # the token gather's backward accumulates with atomics on CUDA otherwise
        assert_bitwise(_grads(model, x, None), _grads(model, x, off_for(impl, device, keep_last=0)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("role", ["expert_fc1", "moe_act", "expert_fc2"])
@pytest.mark.parametrize("fp8", [False, True])
def test_marked_policy_with_a_selection_offloads_exactly_that_role(device, impl, role, fp8):
    model = _model(device, n_experts=4, top_k=2, expert_fp8=fp8)
    ao.select_modules(model, {role})
    off = off_for(impl, device, keep_last=0, policy="marked", min_offload_bytes=64)
    with ao.wrap(model.blocks, off):
        y = model(torch.randn(B, T, D, device=device) * 1)
    slots, ffn = B * T * 2, 4 * D
    width = {"expert_fc1": D, "moe_act": 2 * ffn, "expert_fc2": ffn}[role]
    per_element = 1 if (fp8 and role == "expert_fc2") else 4  # FP8 data; the scale stays (small)
    for g in off.stats()["groups"].values():
        assert g["offloaded"] == 1 and g["offloaded_bytes"] == slots * width * per_element
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_roles_select_what_those_ops_save(device, impl, attention):
    model = _model(device, attention=attention)
    assert ao.select_modules(model, {"qkv", "attn_norm"}) == [
        ("blocks.0.attn.project", "attn_norm"), ("blocks.0.attn.project", "qkv"),
        ("blocks.1.attn.project", "attn_norm"), ("blocks.1.attn.project", "qkv")]
    off = off_for(impl, device, keep_last=0, policy="marked")
    with ao.wrap(model.blocks, off):
        y = model(torch.randn(B, T, D, device=device) * 1)
    for g in off.stats()["groups"].values():
        # the block input (saved by ln1) and ln1's output (saved by the qkv projection)
        assert g["offloaded"] == 2 and g["offloaded_bytes"] == 2 * B * T * D * 4
        assert g["kept"].get("not_marked", 0) > 0  # core attention, projection, ln2 input
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_under_policy_all_a_selection_narrows_only_the_module_that_has_the_role(device, impl):
    """The Q/K/V projection and the attention are two modules: selecting ``qkv`` vetoes the
    projection's other save (the norm's input) and leaves the attention's all candidates."""
    model = _model(device, attention="eager")
    ao.select_modules(model, {"qkv"})
    off = off_for(impl, device, keep_last=0, min_offload_bytes=64)
    with ao.wrap(model.blocks, off):
        y = model(torch.randn(B, T, D, device=device) * 1)
    heads = 2
    for g in off.stats()["groups"].values():
        assert g["kept"].get("vetoed", 0) == 1  # the norm's input
        assert g["offloaded_bytes_by_role"] == {"qkv": B * T * D * 4}
        assert g["offloaded_bytes"] >= B * T * D * 4 + B * heads * T * T * 4  # and the attention's saves
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_stats_report_offloaded_bytes_by_role(device, impl):
    model = _model(device, n_experts=4, top_k=2)
    ao.select_modules(model, {"moe_act", "expert_fc1"})
    off = off_for(impl, device, keep_last=0, min_offload_bytes=64)  # the 40-byte offsets stay
    with ao.wrap(model.blocks, off):
        y = model(torch.randn(B, T, D, device=device) * 1)
    slots, ffn = B * T * 2, 4 * D
    for g in off.stats()["groups"].values():
        assert g["offloaded_bytes_by_role"] == {"moe_act": slots * 2 * ffn * 4, "expert_fc1": slots * D * 4}
    y.sum().backward()
