"""Selective recomputation under a memory budget (``recompute_selective``): a recomputed group
keeps its costly ops' outputs (matmuls, attention) and runs only its other ops again; gradients
stay bitwise (R1); profiling measures what the action keeps and skips; the model and the search
cost it and choose it."""

import functools
from dataclasses import replace

import pytest
import torch
import torch.utils.checkpoint as cp
from torch.utils._python_dispatch import TorchDispatchMode

import actoffload as ao
from actoffload import selective
from actoffload.budget import costmodel, predict, search
from actoffload.budget.actions import Action, GroupDecision
from actoffload.budget.controller import PROFILE_STEPS
from actoffload.budget.costmodel import GroupProfile, Profile
from helpers import assert_bitwise, deterministic
from test_budget import D, H, _blocks, _forced, _step

ROWS = 64
# what a selective recomputation of a block keeps: its first Linear's output (fp32). Its second's is
# read only by the block's caller: the recomputation stops before it (the block's last save is its input)
COSTLY = ROWS * H * 4


class _Ops(TorchDispatchMode):
    """The ATen ops run while entered."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def _profiled():
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    blocks = _blocks()
    handle = ao.wrap(blocks, off)
    for step in range(PROFILE_STEPS + 1):
        _step(blocks, step)
    return off, blocks, handle


def test_R1_selective_recomputation_reruns_only_the_cheap_ops_and_is_bitwise():
    expected = [_step(_blocks(), step) for step in range(PROFILE_STEPS + 3)]
    off, blocks, handle = _profiled()
    _forced(off, ["recompute_selective", "keep", "recompute_selective", "recompute"])
    got = [_step(blocks, PROFILE_STEPS + 1)]
    with _Ops() as seen:
        got.append(_step(blocks, PROFILE_STEPS + 2))
    handle.remove()
    for a, b in zip(got, expected[PROFILE_STEPS + 1:]):
        assert_bitwise(a, b)
    # the forward runs 8 Linear layers (addmm); backward's gradients use mm: an addmm in backward is
    # a recomputed Linear, and only the block recomputed in full runs one (its first: checkpoint stops
    # once the last saved tensor is back)
    assert seen.ops.count(torch.ops.aten.addmm) == 8 + 1
    assert seen.ops.count(torch.ops.aten.gelu) == 4 + 3  # GELU runs again in every recomputed block
    plan = off.stats()["plan"]["groups"]
    assert [g["action"] for g in plan] == ["recompute_selective", "keep", "recompute_selective", "recompute"]
    assert plan[0]["resident_bytes"] == ROWS * D * 4 + COSTLY  # its input and the first Linear's output


def test_R1_selective_recomputation_moving_what_it_keeps_is_bitwise_and_moves_its_costly_outputs():
    expected = [_step(_blocks(), step) for step in range(PROFILE_STEPS + 3)]
    off, blocks, handle = _profiled()
    actions = ["recompute_selective_offload", "recompute_selective", "keep", "recompute_selective_offload"]
    _forced(off, actions)
    got = [_step(blocks, PROFILE_STEPS + 1)]
    with _Ops() as seen:
        got.append(_step(blocks, PROFILE_STEPS + 2))
        groups = off.stats()["groups"]
    handle.remove()
    for a, b in zip(got, expected[PROFILE_STEPS + 1:]):
        assert_bitwise(a, b)
    assert seen.ops.count(torch.ops.aten.addmm) == 8  # no Linear ran again: their outputs came back
    # its inputs and its two Linear outputs are its saves, and all of them moved (fraction 1)
    assert groups["0"]["offloaded_bytes"] == groups["3"]["offloaded_bytes"] == ROWS * D * 4 + COSTLY
    assert groups["1"]["offloaded_bytes"] == 0
    plan = off.stats()["plan"]["groups"]
    assert [g["action"] for g in plan] == actions
    assert plan[0]["resident_bytes"] == 0 and plan[0]["offloaded_bytes"] == ROWS * D * 4 + COSTLY


def test_selective_profiling_measures_the_costly_outputs_and_their_share_of_the_recomputation():
    off, _, handle = _profiled()
    handle.remove()
    for g in off.plan.controller.profile.groups:
        assert g.costly == (COSTLY,) and g.costly_calls == 1  # the first Linear's output: the one recomputing reaches
        assert 0.0 < g.costly_share <= 1.0


class _WritesItsMatmul(torch.nn.Module):
    """``gelu(x @ w)``, returning ``x @ w`` too; ``within``: its forward then writes ``x @ w`` in
    place (through an alias autograd does not follow)."""

    def __init__(self, within):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, H) / D**0.5)
        self.within = within

    def forward(self, x):
        y = x @ self.w  # 3-d: mm, then _unsafe_view, whose output has a version counter of its own
        z = torch.nn.functional.gelu(y)  # saves y
        if self.within:  # and y is gone when the forward ends: no one can write it after
            y.detach().mul_(0)
            return z, z
        return z, y


@pytest.mark.parametrize("rows", [(ROWS,), (2, ROWS // 2)], ids=["2-d: mm's own output", "3-d: an alias of mm's"])
@pytest.mark.parametrize("within", [True, False], ids=["within its forward", "after its forward"])
def test_R1_selective_contexts_run_an_op_again_whose_kept_output_was_written_in_place(within, rows):
    """Plain checkpointing recomputes ``x @ w``, so gelu's backward sees what the forward made, not
    the zeros; a selective recomputation must not hand back the written output instead. A write
    within the forward is seen as it runs; one after it, by the output's version."""
    torch.manual_seed(0)
    m = _WritesItsMatmul(within)
    x = torch.randn(*rows, D, requires_grad=True)
    grads = []
    for context_fn in (cp.noop_context_fn, selective.contexts):
        z, y = cp.checkpoint(m, x, use_reentrant=False, context_fn=context_fn)
        if not within:
            y.detach().mul_(0)
        z.sum().backward()
        grads.append([x.grad, m.w.grad])
        x.grad, m.w.grad = None, None
    assert_bitwise(grads[1], grads[0])


def test_R1_selective_contexts_recompute_every_op_in_a_second_backward():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
    x = torch.randn(ROWS, D, requires_grad=True)
    m(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    loss = cp.checkpoint(m, x, use_reentrant=False, context_fn=selective.contexts).square().sum()
    loss.backward(retain_graph=True)
    first, x.grad = x.grad.clone(), None
    with _Ops() as seen:
        loss.backward()
    assert_bitwise([first, x.grad], [expected, expected])
    assert torch.ops.aten.addmm in seen.ops  # the kept outputs were taken: the second runs the op


def test_only_the_costly_outputs_the_recomputation_reaches_are_kept():
    """A block's recomputation stops once its last save is back: its second Linear never runs
    again, so its output is not kept (it would be held until backward for nothing)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
    x = torch.randn(ROWS, D, requires_grad=True)
    meter = selective.OpMeter()
    y = cp.checkpoint(block, x, use_reentrant=False, context_fn=lambda: (meter.forward(), meter.recomputation()))
    y.sum().backward()
    assert (meter.reached, meter.costly) == (1, [ROWS * H * 4])
    expected = x.grad.clone()
    x.grad = None
    modes = selective.contexts(calls=meter.reached)
    y = cp.checkpoint(block, x, use_reentrant=False, context_fn=lambda: modes)
    assert len(modes[0].cache.kept) == 1  # the first Linear's: held until backward
    with _Ops() as seen:
        y.sum().backward()
    assert torch.ops.aten.addmm not in seen.ops and torch.equal(x.grad, expected)


def test_the_op_meter_counts_a_freed_and_reused_address_as_another_output():
    a = torch.randn(32, 32)
    meter = selective.OpMeter()
    with meter.forward():
        for _ in range(3):
            y = a @ a  # each output freed before the next is made: it may reuse the address
            del y
    assert meter.costly == [32 * 32 * 4] * 3


def _group(costly=None, share=None, host_s=None, inputs=100):
    return GroupProfile("0", spans=(1000,), kept=0, inputs=inputs, forward_s=1.0, backward_s=2.0, recompute_s=0.8,
                        host_s=host_s, costly=costly, costly_share=share)


def test_the_model_charges_a_selective_recomputation_its_cheap_share_and_keeps_its_costly_bytes():
    g = _group(costly=(300, 100), share=0.75)
    d = GroupDecision(Action.RECOMPUTE_SELECTIVE)
    assert costmodel.resident(d, g) == 100 + 400
    assert costmodel.recompute_seconds(d, g) == pytest.approx(0.8 * 0.25)
    assert costmodel.recompute_seconds(GroupDecision(Action.RECOMPUTE), g) == 0.8
    # at the host's pace the host issues every op again: all of it
    paced = _group(costly=(300, 100), share=0.75, host_s=1.5)
    assert costmodel.recompute_seconds(d, paced) == costmodel.recompute_time(paced) == 1.5


def test_a_selective_recomputation_is_charged_the_hosts_time_where_dispatching_in_python_outruns_the_device():
    d = GroupDecision(Action.RECOMPUTE_SELECTIVE)
    fast_host = _group(costly=(300, 100), share=0.75, host_s=0.2)  # forward 1.0 s on the device, 0.2 on the host
    slow = replace(fast_host, dispatch_host_s=(1.5, 0.6))
    # the device is slower than dispatching: nothing more than its cheap share (0.8 * 0.25)
    assert costmodel.recompute_seconds(d, replace(fast_host, dispatch_host_s=(0.5, 0.1))) == pytest.approx(0.2)
    # dispatching outruns it: the recomputation at the host's pace, and the forward's wait for the host
    assert costmodel.recompute_seconds(d, slow) == pytest.approx(0.6 + (1.5 - 1.0))


def test_a_selective_recomputation_moves_its_largest_kept_outputs_first():
    g = _group(costly=(300, 100), share=0.5)  # and its inputs: 100
    half = GroupDecision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, 0.5)
    assert costmodel.moved(half, g) == 300 - 0 and costmodel.resident(half, g) == 200  # the largest alone
    whole = GroupDecision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0)
    assert costmodel.moved(whole, g) == 500 and costmodel.resident(whole, g) == 0
    assert costmodel.recompute_seconds(whole, g) == pytest.approx(0.8 * 0.5)


def test_profile_of_takes_the_costly_figures_and_merged_keeps_the_metered_steps():
    def measured(costly, costly_s, host_s):
        m = costmodel.MeasuredGroup(recomputed=True, forward_s=1.0, backward_s=3.0, recompute_s=0.5, moved=100,
                                    spans=(1000,), kept=0, inputs=100, forward_peak=0, backward_peak=0,
                                    recompute_peak=0, host_s=host_s, recompute_host_s=host_s / 2,
                                    costly=costly, costly_s=costly_s)
        return costmodel.profile_of(costmodel.MeasuredStep(0, (m,), 0.0, 0, 1e9, 1e9))

    # metered: every op went through a dispatch mode, whose host times stand for a selective one's
    metered, plain = measured((300, 100), 0.4, 0.9), measured(None, None, 0.3)
    g = metered.groups[0]
    assert (g.costly, g.costly_share, g.dispatch_host_s) == ((300, 100), pytest.approx(0.8), (0.9, 0.45))
    assert plain.groups[0].dispatch_host_s is None
    for a, b in ((metered, plain), (plain, metered)):
        g = costmodel.merged(a, b).groups[0]
        assert (g.costly, g.costly_share, g.dispatch_host_s) == ((300, 100), pytest.approx(0.8), (0.9, 0.45))


def test_a_metered_recomputation_is_charged_no_more_host_time_than_its_forward():
    # the last group, recomputed first in backward, waited for the device's queue: not dispatch
    m = costmodel.MeasuredGroup(recomputed=True, forward_s=0.040, backward_s=0.1, recompute_s=0.035, moved=0,
                                spans=(1000,), kept=0, inputs=100, forward_peak=0, backward_peak=0,
                                recompute_peak=0, host_s=0.006, recompute_host_s=0.113,
                                costly=(600,), costly_s=0.028)
    g = costmodel.profile_of(costmodel.MeasuredStep(0, (m,), 0.0, 0, 1e9, 1e9)).groups[0]
    assert g.dispatch_host_s == (0.006, 0.006)
    # so the device's cheap share, not the wait, is what selective recomputation costs
    d = GroupDecision(Action.RECOMPUTE_SELECTIVE)
    assert costmodel.recompute_seconds(d, g) == pytest.approx(0.035 * (1 - 0.8))


def test_a_prediction_scales_the_costly_bytes_like_every_byte_figure():
    p = Profile((_group(costly=(300, 100), share=0.5),), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    g = predict.predicted(p, 100, 200, base=0).groups[0]
    assert (g.costly, g.costly_share) == ((1200, 400), 0.5)  # twice the tokens: bounded by 4x


def test_a_group_may_move_to_a_selective_recomputation_once_its_costly_ops_were_measured():
    keep = (GroupDecision(Action.KEEP),)
    # not measured; measured; measured, but they and the inputs come to more than it saves (1000)
    for costly, offered in ((None, False), ((300, 100), True), ((700, 300), False)):
        p = Profile((_group(costly=costly, share=0.5),), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
        moves = [m[0].action for m in search.moves(p, keep, 0)]
        assert (Action.RECOMPUTE_SELECTIVE in moves) is offered
        selective_now = (GroupDecision(Action.RECOMPUTE_SELECTIVE),)
        if offered:  # and on from it to moving what it keeps, or recomputing in full
            assert {m[0].action for m in search.moves(p, selective_now, 0)} == {
                Action.RECOMPUTE_SELECTIVE_OFFLOAD, Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD}


def test_the_search_recomputes_selectively_where_the_cheap_ops_hold_the_bytes():
    """Four groups whose cheap ops hold most of what they save and take little of their time,
    on a slow bus: between keeping everything and checkpointing, recomputing some selectively
    is the fastest plan that fits; without the costly figures it cannot be chosen."""
    def profile(costly):
        g = GroupProfile("g", spans=(1000,), kept=0, inputs=50, forward_s=1.0, backward_s=2.0, recompute_s=1.0,
                         costly=costly, costly_share=0.9 if costly is not None else None)
        return Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=1.0, h2d_bps=1.0)

    budget = 2 * 1000 + 2 * 300 + 1000  # two kept, two selective, and a backward's activations
    plan = search.choose(profile((150, 100)), budget)
    actions = [d.action for d in plan.groups]
    assert Action.RECOMPUTE_SELECTIVE in actions
    assert plan.step_s < search.choose(profile(None), budget).step_s
    assert Action.RECOMPUTE_SELECTIVE not in [d.action for d in search.choose(profile(None), budget).groups]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the costly ops timed with CUDA events")
def test_R1_selective_recomputation_on_cuda_is_bitwise_moved_or_not_and_profiled_with_events():
    def blocks():
        torch.manual_seed(0)
        return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
                                   for _ in range(4)).cuda()

    def step(model, k):
        x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(k)).cuda().requires_grad_()
        h = x * 1
        for b in model:
            h = h + b(h)
        h.square().sum().backward()
        out = [x.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    with deterministic():
        expected = [step(blocks(), k) for k in range(PROFILE_STEPS + 2)]
        off = ao.Offloader(impl="fast", memory_budget=1 << 40, min_offload_bytes=0)
        model = blocks()
        with ao.wrap(model, off):
            got = [step(model, k) for k in range(PROFILE_STEPS + 1)]
            for g in off.plan.controller.profile.groups:
                assert g.costly_bytes == COSTLY and 0.0 < g.costly_share <= 1.0
            # moved ones with copies in flight and reloads ahead, as fast runs them
            off.plan.controller.force([GroupDecision(Action(a)) for a in (
                "recompute_selective", "recompute_selective_offload", "recompute_selective_offload", "keep")],
                max_inflight=1, prefetch=1)
            got.append(step(model, PROFILE_STEPS + 1))
            assert off.stats()["groups"]["1"]["offloaded_bytes"] == ROWS * D * 4 + COSTLY
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


def _hf_model(kind, use_cache=False):
    transformers = pytest.importorskip("transformers", reason="transformers' models (pip install -e '.[integrations]')")
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=128,
                 max_position_embeddings=64, use_cache=use_cache, attn_implementation="eager")
    if kind == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=2, **shape)
        model = transformers.LlamaForCausalLM(config)
        return model, model.model.layers
    config = transformers.GPTNeoXConfig(**shape)  # parallel residual, fused qkv, GELU
    model = transformers.GPTNeoXForCausalLM(config)
    return model, model.gpt_neox.layers


def _hf_step(model, k):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(k))
    model(input_ids=ids, labels=ids).loss.backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_R1_a_transformers_layer_wrapped_whole_is_recomputed_selectively_bitwise(kind):
    """A decoder layer as users have it, wrapped whole (no parts): profiling meters its costly ops,
    and recomputing it selectively, moving what it keeps or not, gives the same gradients."""
    model, _ = _hf_model(kind)
    expected = [_hf_step(model, k) for k in range(PROFILE_STEPS + 2)]
    model, layers = _hf_model(kind)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(layers, off):
        got = [_hf_step(model, k) for k in range(PROFILE_STEPS + 1)]
        groups = off.plan.controller.profile.groups
        assert len(groups) == 3 and all(g.costly and 0.0 < g.costly_share <= 1.0 for g in groups)
        _forced(off, ["recompute_selective", "recompute_selective_offload", "recompute_selective_offload"])
        got.append(_hf_step(model, PROFILE_STEPS + 1))
        moved = off.stats()["groups"]
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    assert moved["0"]["offloaded_bytes"] == 0
    assert moved["1"]["offloaded_bytes"] == groups[1].costly_bytes + groups[1].inputs


def test_R1_a_transformers_sdpa_layer_keeping_its_attentions_outputs_runs_its_matmuls_again_not_its_attention():
    """``recompute_attention`` (and ``_offload``) on transformers' SDPA Llama wrapped whole: profiling
    meters the fused attention among the costly ops; in backward the matmuls run again and the
    attention does not; what moves is its input and its attention's outputs; bitwise (R1)."""
    def model():
        m, layers = _hf_model("llama")
        m.config._attn_implementation = "sdpa"  # (the same weights: the attention is told at each call)
        return m, layers

    reference, _ = model()
    expected = [_hf_step(reference, k) for k in range(PROFILE_STEPS + 3)]
    m, layers = model()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(layers, off):
        got = [_hf_step(m, k) for k in range(PROFILE_STEPS + 1)]
        groups = off.plan.controller.profile.groups
        for g in groups:  # its attention's outputs: a share of what the costly ops keep and of their time
            assert g.attention and g.attention_calls == 1 and 0 < g.attention_bytes < g.costly_bytes
            assert 0.0 < g.attention_share < g.costly_share
        actions = ["recompute_attention", "recompute_attention_offload", "recompute"]
        _forced(off, actions)
        got.append(_hf_step(m, PROFILE_STEPS + 1))
        with _Ops() as seen:
            got.append(_hf_step(m, PROFILE_STEPS + 2))
        moved = off.stats()["groups"]
        plan = off.stats()["plan"]["groups"]
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    attention = [op for op in set(seen.ops) if op in selective.ATTENTION_OPS]
    assert attention and sum(seen.ops.count(op) for op in attention) == 3 + 1  # again only in the plain recompute
    assert seen.ops.count(torch.ops.aten.mm) > 3 * 7  # every layer's 7 projections, and again in backward
    assert [g["action"] for g in plan] == actions
    assert moved["0"]["offloaded_bytes"] == 0 and plan[0]["resident_bytes"] == groups[0].inputs + groups[0].attention_bytes
    assert moved["1"]["offloaded_bytes"] == groups[1].attention_bytes + groups[1].inputs


def test_the_model_charges_keeping_the_attention_its_share_and_moves_what_it_keeps():
    g = replace(_group(costly=(300, 100), share=0.75), attention=(100,), attention_share=0.5)
    d = GroupDecision(Action.RECOMPUTE_ATTENTION)
    assert costmodel.resident(d, g) == 100 + 100 and costmodel.moved(d, g) == 0  # its inputs and the attention's outputs
    assert costmodel.recompute_seconds(d, g) == pytest.approx(0.8 * 0.5)
    whole = GroupDecision(Action.RECOMPUTE_ATTENTION_OFFLOAD, 1.0)
    assert costmodel.moved(whole, g) == 200 and costmodel.resident(whole, g) == 0
    assert costmodel.recompute_seconds(whole, g) == pytest.approx(0.8 * 0.5)
    # not measured: not offered, and charged as a full recomputation were it run
    plain = _group(costly=(300, 100), share=0.75)
    assert costmodel.recompute_seconds(d, plain) == 0.8
    # offered to the improvement group by group where measured (not as moves of the paths: planning time)
    assert {Action.RECOMPUTE_ATTENTION, Action.RECOMPUTE_ATTENTION_OFFLOAD} <= {d.action for d in search._alternatives(g)}
    assert not {d.action for d in search._alternatives(plain)} & {Action.RECOMPUTE_ATTENTION,
                                                                Action.RECOMPUTE_ATTENTION_OFFLOAD}
    p = Profile((g,), base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    assert {m[0].action for m in search.moves(p, (GroupDecision(Action.RECOMPUTE),), 0)} == {Action.RECOMPUTE_OFFLOAD}


def test_the_search_keeps_the_attentions_outputs_moved_out_at_checkpointings_memory_where_attention_costs_most():
    """Four long-sequence layers: the attention is half a recomputation's time and its outputs are
    as small as the layer's input; at checkpointing's peak the fastest plan keeps the attention's
    outputs, moved out with the inputs, and beats checkpointing; without them measured it cannot."""
    def profile(attention):
        g = GroupProfile("g", spans=(1000,), kept=0, inputs=50, forward_s=1.0, backward_s=2.0, recompute_s=1.0,
                         costly=(400, 50), costly_share=0.9, attention=attention,
                         attention_share=0.5 if attention is not None else None)
        # a bus that hides 200 bytes behind a forward: a layer's inputs and attention outputs, not its saves
        return Profile((g,) * 4, base=0, outside_s=0.0, d2h_bps=200.0, h2d_bps=200.0)

    every = (GroupDecision(Action.RECOMPUTE),) * 3 + (GroupDecision(Action.KEEP),)
    budget, checkpointing_s = costmodel.simulate(profile(None), every, 0, 0)  # checkpointing's peak
    plan = search.choose(profile((50,)), budget)
    assert plan.step_s < 0.95 * checkpointing_s
    assert {d.action for d in plan.groups[:-1]} == {Action.RECOMPUTE_ATTENTION_OFFLOAD}
    without = search.choose(profile(None), budget)
    assert Action.RECOMPUTE_ATTENTION_OFFLOAD not in {d.action for d in without.groups}
    assert plan.step_s < without.step_s


def test_a_prediction_scales_the_attentions_bytes_like_every_byte_figure():
    p = Profile((replace(_group(costly=(300, 100), share=0.5), attention=(100,), attention_share=0.25),),
                base=0, outside_s=0.0, d2h_bps=1e9, h2d_bps=1e9)
    g = predict.predicted(p, 100, 200, base=0).groups[0]
    assert (g.attention, g.attention_share) == ((400,), 0.25)


@pytest.mark.filterwarnings("ignore:actoffload.*key-value cache")
def test_a_layer_handed_a_key_value_cache_is_never_recomputed_and_the_budget_still_trains_bitwise():
    """transformers makes a cache whenever ``use_cache`` is on (its default), in training too, and
    each layer appends to it: recomputed, a layer would append again and attend over twice the keys
    (a shape error in backward). Such a call is not recomputable; the plan keeps or moves instead."""
    model, _ = _hf_model("llama", use_cache=True)
    expected = [_hf_step(model, k) for k in range(PROFILE_STEPS + 2)]
    model, layers = _hf_model("llama", use_cache=True)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(layers, off):
        got = [_hf_step(model, k) for k in range(PROFILE_STEPS + 2)]
        assert all(g.inputs is None for g in off.plan.controller.profile.groups)  # profiled moving, not recomputing
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


def test_a_budget_says_once_that_a_layer_handed_a_key_value_cache_is_never_recomputed():
    """A user who sets a budget on a transformers model left at ``use_cache=True`` (its default)
    is told, once, why no layer is recomputed and what to set; not without a budget, nor with
    ``use_cache=False``, nor for a forward under ``no_grad`` (generation)."""
    import warnings as w

    def caught(use_cache, budget, grad=True):
        model, layers = _hf_model("llama", use_cache=use_cache)
        off = ao.Offloader(impl="fast", device="cpu", memory_budget=budget, min_offload_bytes=0)
        with ao.wrap(layers, off), w.catch_warnings(record=True) as seen:
            w.simplefilter("always")
            for k in range(3):
                with torch.set_grad_enabled(grad):
                    loss = model(input_ids=torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16))).loss
                if grad:
                    loss.backward()
        return [str(x.message) for x in seen if "key-value cache" in str(x.message)]

    told = caught(use_cache=True, budget=1 << 40)
    assert len(told) == 1 and "use_cache=False" in told[0] and "use_cache = False" in told[0], told
    assert caught(use_cache=True, budget=None) == []
    assert caught(use_cache=False, budget=1 << 40) == []
    assert caught(use_cache=True, budget=1 << 40, grad=False) == []


def test_R1_an_out_variant_of_a_costly_op_runs_again_in_the_recomputation():
    """``torch.mm(a, b, out=buf)`` writes ``buf``: handing back a kept output instead would leave
    the recomputation's ``buf`` unwritten. Only an op's functional form is costly."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    c, k = torch.randn(8, 16), torch.randn(16, 16)

    def f(x):
        buf = torch.empty(8, 16)
        torch.mm(c, k, out=buf)
        return torch.tanh(x @ w) * buf

    grads = []
    for context_fn in (cp.noop_context_fn, selective.contexts):
        cp.checkpoint(f, x, use_reentrant=False, context_fn=context_fn).sum().backward()
        grads.append([x.grad, w.grad])
        x.grad = w.grad = None
    assert_bitwise(grads[1], grads[0])
    assert selective.is_costly(torch.ops.aten.mm.default) and not selective.is_costly(torch.ops.aten.mm.out)


def test_a_fused_attention_that_draws_random_numbers_is_not_kept():
    """On CUDA, fused attention with ``dropout_p > 0`` draws random numbers: skipped in the
    recomputation, it would shift those of every random op after it (R1)."""
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.empty(1, 1, 4, 8)
    assert selective.keeps(op, (q, q, q, None, True), {})
    assert not selective.keeps(op, (q, q, q, None, True, 0.1), {})
    assert not selective.keeps(op, (q, q, q, None, True), {"dropout_p": 0.1})
    policy = torch.utils.checkpoint.CheckpointPolicy  # torch's selective checkpointing, as the benchmarks run it
    assert selective.sac_policy(None, op, q, q, q, None, True, 0.1) is policy.PREFER_RECOMPUTE


def test_R1_keeping_only_the_attentions_outputs_recomputes_the_matmuls_not_the_attention():
    """``attention_policy`` (torch's selective checkpointing, as the benchmarks run it): in backward
    the layer's matmuls run again and its fused attention does not; bitwise (R1)."""
    torch.manual_seed(0)
    qkv, out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def layer(x):
        q, k, v = qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out(a.transpose(1, 2).reshape(2, 16, 32))

    x = torch.randn(2, 16, 32, requires_grad=True)
    context = functools.partial(cp.create_selective_checkpoint_contexts, selective.attention_policy)
    grads, runs = [], []
    for context_fn in (cp.noop_context_fn, context):
        with _Ops() as seen:
            cp.checkpoint(layer, x, use_reentrant=False, context_fn=context_fn).sum().backward()
        grads.append([x.grad, qkv.weight.grad, out.weight.grad])
        x.grad = qkv.weight.grad = out.weight.grad = None
        runs.append({op: seen.ops.count(op) for op in set(seen.ops)})
    assert_bitwise(grads[1], grads[0])
    attention = [op for op in runs[0] if op in selective.ATTENTION_OPS]
    assert attention and all(runs[0][op] == 2 and runs[1][op] == 1 for op in attention)  # forward, then not again
    # the matmuls: both in the forward, the first again (the recomputation stops before the last)
    assert runs[1][torch.ops.aten.addmm] == runs[0][torch.ops.aten.addmm] == 3
    policy = torch.utils.checkpoint.CheckpointPolicy
    assert selective.attention_policy(None, torch.ops.aten.mm.default) is policy.PREFER_RECOMPUTE


class _WritesItsMatmulInPlace(torch.nn.Module):
    """``fc2(gelu(x @ w1.T + b1))`` with the bias added in place to the matmul's output."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(H, D) / D**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(H))
        self.fc2 = torch.nn.Linear(H, D)

    def forward(self, x):
        y = x @ self.w1.t()
        y += self.b1  # mm saves no output: autograd allows it
        return self.fc2(torch.nn.functional.gelu(y))


def test_an_output_written_in_its_forward_is_not_counted_and_the_plan_settles():
    """A selective recomputation keeps no output its forward wrote in place (it runs that op again):
    profiling counts none either, so what the group saves matches the profile and the plan settles
    (it had re-profiled at every other step)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_WritesItsMatmulInPlace() for _ in range(4))
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            _step(blocks, step)
        assert all(g.costly == () for g in off.plan.controller.profile.groups)
        _forced(off, ["recompute_selective"] * 4)
        states = []
        for step in range(PROFILE_STEPS + 1, PROFILE_STEPS + 6):
            _step(blocks, step)
            states.append(off.stats()["plan"]["state"])
    assert "profiling" not in states and "re-planning" not in states, states


def test_a_recomputation_that_runs_no_costly_op_keeps_none():
    torch.manual_seed(0)
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(ROWS, D, requires_grad=True)

    def f(x):
        return torch.tanh(x) @ w  # backward needs tanh(x) and w: the recomputation stops before the matmul

    meter = selective.OpMeter()
    cp.checkpoint(f, x, use_reentrant=False, context_fn=lambda: (meter.forward(), meter.recomputation())).sum().backward()
    assert (meter.reached, meter.costly) == (0, [])
    modes = selective.contexts(calls=meter.reached)
    cp.checkpoint(f, x, use_reentrant=False, context_fn=lambda: modes).sum().backward()
    assert modes[0].cache.kept == {}


def _moving_what_is_kept(off, blocks):
    """The plan's rows after a step forced to move what two selective recomputations keep and
    one recomputation's inputs, each checked against what the engine moved."""
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            _step(blocks, step)
        _forced(off, ["recompute_selective_offload", "recompute_offload", "recompute_selective_offload", "keep"])
        _step(blocks, PROFILE_STEPS + 1)
        engine = off.stats()["groups"]
    plan = off.stats()["plan"]["groups"]
    for i in (0, 1, 2):
        assert plan[i]["offloaded_bytes"] == engine[str(i)]["offloaded_bytes"], (i, plan[i], engine[str(i)])
    return plan


@pytest.mark.parametrize("min_offload_bytes", [0, 1 << 20])
def test_what_the_model_moves_is_what_the_engine_moves_under_min_offload_bytes(min_offload_bytes):
    """Inputs and kept outputs under ``min_offload_bytes`` stay, as the engine's policy keeps them
    (the profiling step moved every input, small ones too): the plan's figures say so."""
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=min_offload_bytes)
    plan = _moving_what_is_kept(off, _blocks())
    moves = min_offload_bytes == 0  # the tiny blocks' inputs and outputs are all under 1 MiB
    assert plan[0]["offloaded_bytes"] == (ROWS * D * 4 + COSTLY if moves else 0)
    assert plan[1]["resident_bytes"] == (0 if moves else ROWS * D * 4)


def test_an_ops_tensors_are_found_and_mapped_in_every_container_it_may_use():
    """The walk over an op's arguments and outputs (tuples, lists and dicts here, anything else
    through pytree) finds every tensor, in order, and maps only tensors."""
    from collections import namedtuple

    from actoffload.selective import _mapped, _tensors

    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    Pair = namedtuple("Pair", "x y")
    args = (a, [b, (1, None)], {"k": c, "p": 0.5}, torch.float32, Pair(a, 3))
    assert [t.shape for t in _tensors(args)] == [a.shape, b.shape, c.shape, a.shape]
    assert _tensors(a) == [a] and _tensors(3) == [] and _tensors(Pair(b, c)) == [b, c]
    doubled = _mapped(lambda t: t * 2, (a, 1, None, [b]))
    assert type(doubled) is tuple and doubled[1:3] == (1, None) and torch.equal(doubled[3][0], b * 2)
    pair = _mapped(lambda t: t + 1, Pair(a, 3))
    assert type(pair) is Pair and torch.equal(pair.x, a + 1) and pair.y == 3


@pytest.mark.parametrize("save_policy, mark, moves_inputs, moves_kept", [
    pytest.param("all", ao.mark_not_offload, True, False, id="vetoed-output"),
    pytest.param("marked", None, False, False, id="marked-nothing"),
    pytest.param("marked", ao.mark_activation_offload, False, True, id="marked-output"),
])
def test_what_the_model_moves_is_what_the_policy_and_the_marks_let_move(save_policy, mark, moves_inputs, moves_kept):
    """R3 and R4 hold under a budget: a kept output marked not to move (marked by the caller after
    the op that made it, as a forward hook does), or inputs and outputs not opted in under
    ``policy="marked"``, stay on the device, and the plan's figures count them there: a plan that
    counted them moved would hold more than its modelled peak."""
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0, policy=save_policy)
    blocks = _blocks()
    if mark is not None:
        for b in blocks:
            b[0].register_forward_hook(lambda module, args, out: mark(out))
    plan = _moving_what_is_kept(off, blocks)
    inputs = ROWS * D * 4
    assert plan[0]["offloaded_bytes"] == (inputs if moves_inputs else 0) + (COSTLY if moves_kept else 0)
    assert plan[0]["resident_bytes"] == (0 if moves_inputs else inputs) + (0 if moves_kept else COSTLY)
    assert plan[1]["resident_bytes"] == (0 if moves_inputs else inputs)
