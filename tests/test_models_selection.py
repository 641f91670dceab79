"""Per-role offload selection on the GPT models: MoE experts and attention/norm roles."""

import pytest
import torch

import actoffload as ao
from actoffload.tools.models import GPT, GPTConfig, block_parts
from helpers import DEVICES, IMPLS, assert_bitwise, deterministic, grads_of, off_for, zero_grads

B, T, D = 2, 8, 16


def _model(device="cpu", **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(**{"vocab_size": 40, "seq_len": T, "d_model": D, "n_heads": 2, "n_layers": 2, "embedding": False, **kw})
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
    projection's other saves (the norm's input, named, and its statistics, which no role names)
    and leaves the attention's all candidates."""
    model = _model(device, attention="eager")
    ao.select_modules(model, {"qkv"})
    off = off_for(impl, device, keep_last=0, min_offload_bytes=64)
    with ao.wrap(model.blocks, off):
        y = model(torch.randn(B, T, D, device=device) * 1)
    heads = 2
    for g in off.stats()["groups"].values():
        assert g["kept"].get("vetoed", 0) == 3  # the norm's input, mean and reciprocal deviation
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


@pytest.mark.parametrize("impl", IMPLS)
def test_selecting_the_projection_input_under_sdpa_offloads_it_though_the_attention_output_is_its_storage(impl):
    """SDPA's output laid out [B, T, H, D] makes the projection's input a view of it: the storage
    named by the selected role (``attn_proj``) is opted in though the unselected ``core_attn``
    names it too. It was vetoed, and the selection moved nothing."""
    model = _model(attention="sdpa", n_layers=1)
    ao.select_modules(model, {"attn_proj"})
    off = off_for(impl, "cpu", keep_last=0, policy="marked", min_offload_bytes=0)
    with ao.wrap(model.blocks, off, parts=block_parts):
        y = model(torch.randn(B, T, D) * 1)
    g = off.stats()["groups"]["0.1"]  # the attention's part
    assert g["offloaded_bytes_by_role"] == {"attn_proj": B * T * D * 4} == {"attn_proj": g["offloaded_bytes"]}
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_selecting_the_eager_attention_offloads_queries_keys_values_and_probabilities_as_the_matmuls_save_them(impl):
    model = _model(attention="eager", n_layers=1)
    ao.select_modules(model, {"core_attn"})
    off = off_for(impl, "cpu", keep_last=0, policy="marked", min_offload_bytes=0)
    with ao.wrap(model.blocks, off, parts=block_parts):
        y = model(torch.randn(B, T, D) * 1)
    g = off.stats()["groups"]["0.1"]
    heads = 2
    assert g["offloaded_bytes_by_role"] == {"core_attn": 3 * B * T * D * 4 + B * heads * T * T * 4}
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("moe", [False, True])
def test_under_policy_all_selecting_the_mlp_norm_vetoes_every_other_save_of_the_mlp(impl, moe):
    """The MLP names only what its norm saves: its other saves (the norm's statistics, fc1's and
    the activation's inputs, the router's) are vetoed all the same. An MoE's experts are a module
    with roles of their own, none selected: their saves stay candidates."""
    model = _model(n_layers=1, **({"n_experts": 4, "top_k": 2} if moe else {}))
    ao.select_modules(model, {"mlp_norm"})
    off = off_for(impl, "cpu", keep_last=0, min_offload_bytes=0)
    x = torch.randn(B, T, D, requires_grad=True)
    with ao.wrap(model.blocks, off, parts=block_parts):
        y = model(x * 1)
    g = off.stats()["groups"]["0.2"]  # the MLP's part
    assert g["offloaded_bytes_by_role"] == {"mlp_norm": B * T * D * 4}
    experts = 0
    if moe:  # the tokens sorted by expert, the activation's and fc2's inputs, each with its offsets
        w1, w2 = model.blocks[0].mlp.experts.w1, model.blocks[0].mlp.experts.w2
        experts = B * T * 2 * (D + w1.shape[-1] + w2.shape[-2]) * 4 + 3 * (w1.shape[0] + 1) * 8
    assert g["offloaded_bytes"] == B * T * D * 4 + experts
    y.sum().backward()
    ao.select_modules(model, set())
    off_all = off_for(impl, "cpu", keep_last=0, min_offload_bytes=0)
    with ao.wrap(model.blocks, off_all, parts=block_parts):
        model(x * 1).sum().backward()
    assert off_all.stats()["groups"]["0.2"]["offloaded_bytes"] > g["offloaded_bytes"]  # a selection narrows


def test_a_selected_storage_inside_an_unselected_multi_buffer_tensor_stays_opted_in():
    """A veto reaches an unselected tensor's buffers one by one: where one of them is a storage a
    selected role names, that storage stays opted in (a veto would win over the opt-in, R4)."""
    from actoffload import marks
    from actoffload.roles import mark_selection

    x = torch.randn(6, 4)
    grouped = ao.GroupedTensor(x.detach(), [2, 4])  # its data: x's storage; its offsets: a storage of its own
    mark_selection({"qkv"}, {"qkv": x, "attn_norm": grouped})
    assert marks.flags_of(x.untyped_storage()._cdata) == marks.OPT_IN
    assert marks.flags_of(grouped._offsets.untyped_storage()._cdata) & marks.VETO
