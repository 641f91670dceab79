"""fast on a real GPU: no host synchronization, and no race even when copies are slow."""

import gc

import pytest
import torch

import actoffload as ao
from helpers import CUDA, assert_bitwise, grads_of, maybe_group, mlp_stack, reference_grads, run_groups, zero_grads

pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")

SLEEP_CYCLES = 50_000_000  # ~25 ms at H100 clocks: far longer than the compute between copies


def test_fast_training_step_has_no_host_synchronization():
    model = mlp_stack(4, 512, "cuda")
    off = ao.Offloader(impl="fast", device="cuda", min_offload_bytes=0, keep_last=1)
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    for _ in range(2):  # warm-up: pool blocks, Triton compilation, allocator
        run_groups(model, x, off).square().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            run_groups(model, x, off).square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert off.stats()["host_allocations"] > 0


@pytest.mark.parametrize("where", ["d2h", "h2d"])
@pytest.mark.parametrize("pack_below", [0, 1 << 30], ids=["direct", "packed"])
def test_fast_slow_copy_streams_do_not_change_results(where, pack_below, monkeypatch):
    """A copy stream that lags far behind compute: a source freed or a reload used too
    early would be overwritten by later compute and show up as wrong gradients."""
    model = mlp_stack(6, 256, "cuda")
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    expected = reference_grads(model, x, loss=lambda y: y.square().sum())
    off = ao.Offloader(impl="fast", device="cuda", min_offload_bytes=0, keep_last=1, pack_below=pack_below)
    streams = off._streams
    stream = streams.d2h if where == "d2h" else streams.h2d
    original = streams.on_d2h if where == "d2h" else streams.on_h2d

    def slow(*after):
        for e in after:
            streams.wait(e, stream)
        stream.wait_stream(stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return original(*after)

    monkeypatch.setattr(streams, "on_d2h" if where == "d2h" else "on_h2d", slow)
    for _ in range(2):
        y = run_groups(model, x, off).square().sum()
        # churn the allocator: memory freed too early would be reused and overwritten here
        junk = [torch.randn(512, 512, device="cuda") for _ in range(20)]
        y.backward()
        del junk, y
        assert_bitwise(grads_of(model, x), expected)
        zero_grads(model, x)


@pytest.mark.parametrize("max_inflight, g_moves_its_own", [(1, False), (2, True)])
def test_fast_a_shared_span_used_in_place_leaves_its_copys_other_sources_intact(monkeypatch, max_inflight,
                                                                               g_moves_its_own):
    """Group g saves a storage f saved too (it moves once, with f's copy); backward reaches g
    while f's copy lags on the bus, uses that span in place and lets f's copy go. f's other
    sources must not be reused before the copy read them: a gradient hook between g's and f's
    backward fills fresh memory of their size, which overwrites them if they were."""
    x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    junk = []

    def loss(off):
        with maybe_group(off, "f"):
            h1 = (x * 2).exp()  # saves h1
            h2 = h1.tanh()  # saves h2
        h2.register_hook(lambda grad: junk.extend(torch.full_like(grad, 7.0) for _ in range(8)))
        with maybe_group(off, "g"):
            z = (h2.cos() * 3).exp() if g_moves_its_own else h2.cos()  # cos saves h2: f's storage
        with maybe_group(off, "h"):
            z = z * 1
        return z.sum()

    expected = torch.autograd.grad(loss(None), x)[0]
    junk.clear()
    # (no prefetch: a reload of f made ahead would take the freed blocks first, and harmlessly)
    off = ao.Offloader(impl="fast", device="cuda", warmup="offload", min_offload_bytes=0, keep_last=0,
                       max_inflight=max_inflight, pack_below=0, prefetch=0)
    streams = off._streams
    original = streams.on_d2h

    def slow(*after):
        with torch.cuda.stream(streams.d2h):
            torch.cuda._sleep(SLEEP_CYCLES)
        return original(*after)

    monkeypatch.setattr(streams, "on_d2h", slow)
    got = torch.autograd.grad(loss(off), x)[0]
    assert off.stats()["copies"]["reused_in_flight_groups"] >= 1  # the path under test ran
    assert torch.equal(got, expected)


def test_fast_memory_is_released_when_the_graph_is_freed():
    model = mlp_stack(4, 1024, "cuda")
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    off = ao.Offloader(impl="fast", device="cuda", keep_last=1)
    gc.collect()  # earlier tests' garbage must not be freed inside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = run_groups(model, x, off)
    off.synchronize()
    del y
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert off.stats()["host_bytes_in_use"] == 0


def test_fast_reserves_about_what_it_allocates_while_copies_lag():
    """Copies out far slower than compute (a busy bus): the memory of each source is reused as
    soon as its copy has read it, in the compute stream's order, so what the allocator reserves
    stays within a couple of groups of what is allocated, far under no offloading's. (Sources
    freed with a copy-stream use recorded were reused only once the host saw that stream pass
    them: with the host ahead of the device, every source of the forward stayed reserved.)"""
    model = mlp_stack(8, 2048, "cuda")
    x = torch.randn(8192, 2048, device="cuda", requires_grad=True)
    group_bytes = 8192 * (2048 + 2 * 2 * 2048) * 4  # a layer saves its input, the GELU's input and output

    def peaks(off):
        for _ in range(3):  # warm-up: pool blocks, kernels, the allocator's cache
            run_groups(model, x, off).square().sum().backward()
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run_groups(model, x, off).square().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    _, none_reserved = peaks(None)
    off = ao.Offloader(impl="fast", device="cuda", warmup="offload", keep_last=1)
    allocated, reserved = peaks(off)
    zero_grads(model, x)
    assert reserved <= allocated + 2 * group_bytes, (allocated, reserved, none_reserved)
    assert reserved < none_reserved - 3 * group_bytes, (allocated, reserved, none_reserved)


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(2048, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(4)]


def _step(m: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One step on a copy of ``x``: its gradients (zeroed after)."""
    x = x.clone().requires_grad_(True)
    m(x).square().sum().backward()
    got = grads_of(m, x)
    zero_grads(m, x)
    return got


def _skipping(model: torch.nn.Module, expected: torch.nn.Module, inputs: list[torch.Tensor],
              off: ao.Offloader) -> list[dict]:
    """Three times a batch skipped after its forward (``del loss``), then a step, bitwise equal
    to no offloading: the plan after each step."""
    plans = []
    for i in range(3):
        loss = model(inputs[i].clone().requires_grad_(True)).square().sum()
        del loss  # skipped
        assert_bitwise(_step(model, inputs[i]), _step(expected, inputs[i]))
        plans.append(off.stats()["plan"])
    return plans


@pytest.mark.parametrize("share", [2.0, 8.0])  # of one layer's saves over the parameters: groups moved; everything kept
def test_fast_budget_a_skipped_batch_leaves_the_settled_plan_as_it_was(share):
    """A batch skipped after its forward (``del loss``) on a settled memory budget: the next
    forward begins a step of its own on the plan it had (R8), never profiling again or
    re-planning, every step within the budget and bitwise equal to no offloading."""
    torch.manual_seed(0)
    model, expected = mlp_stack(6, 1024, "cuda"), mlp_stack(6, 1024, "cuda")
    layer = 2048 * (1024 + 2 * 2 * 2048) * 4
    budget = int(torch.cuda.memory_allocated() + share * layer) + 3 * sum(p.numel() * 4 for p in model.parameters())
    off = ao.Offloader(impl="fast", device="cuda", memory_budget=budget)
    inputs = _inputs()
    with ao.wrap(model, off):
        for i in range(30):
            _step(model, inputs[i % 4])
            if off.stats()["plan"]["settled"]:
                break
        settled = off.stats()["plan"]
        assert settled["settled"], settled["state"]
        for plan in _skipping(model, expected, inputs, off):
            assert plan["state"] == "settled" and plan["groups"] == settled["groups"], plan["state"]
            assert plan["measured_reserved_peak_bytes"] <= budget, (plan["measured_reserved_peak_bytes"], budget)


def test_fast_budget_a_host_budget_short_of_profiling_raises_nothing_and_holds():
    """R10 under a memory budget, on a GPU with the pinned pool's blocks counted as room: steps
    taking turns at one and two forwards before a backward, under a host budget of about one
    layer's saves, which neither workload's profiling steps (every layer moved out whole) fit:
    what does not fit stays, no HostMemoryError, pinned memory within the host budget, bitwise."""
    torch.manual_seed(0)
    model, expected = mlp_stack(6, 1024, "cuda"), mlp_stack(6, 1024, "cuda")
    layer = 2048 * (1024 + 2 * 2 * 2048) * 4
    params = sum(p.numel() * 4 for p in model.parameters())
    budget = int(torch.cuda.memory_allocated() + 2 * 6 * layer) + 3 * params  # each forward's every layer
    host = layer
    off = ao.Offloader(impl="fast", device="cuda", memory_budget=budget, host_budget=host, min_offload_bytes=0)
    inputs, held = _inputs(), []
    with ao.wrap(model, off):
        for i in range(16):
            forwards = 1 + i % 2
            got = []
            for m in (model, expected):
                xs = [inputs[(i + k) % 4].clone().requires_grad_(True) for k in range(forwards)]
                loss = sum(m(x).square().sum() for x in xs)
                if m is model:
                    stats = off.stats()
                    held.append(stats["host_bytes_in_use"] + stats["host_bytes_pooled"])
                loss.backward()
                got.append([x.grad for x in xs] + [p.grad.clone() for p in m.parameters()])
                zero_grads(m)
            assert_bitwise(got[0], got[1])
    assert 0 < max(held) <= host, (held, host)


def test_fast_budget_a_skipped_batch_lets_its_copies_in_flight_go_before_the_next_step():
    """A plan moving bytes with copies in flight (``max_inflight=2``): a batch skipped after its
    forward leaves its last groups' copies in flight, their sources held until reaped. They go
    before the next step begins (R8), so that what it begins with is its own: the budget neither
    re-plans nor profiles again."""
    from actoffload.budget.actions import Action, GroupDecision

    torch.manual_seed(0)
    model, expected = mlp_stack(6, 1024, "cuda"), mlp_stack(6, 1024, "cuda")
    off = ao.Offloader(impl="fast", device="cuda", memory_budget=torch.cuda.get_device_properties(0).total_memory // 2)
    inputs = _inputs()
    with ao.wrap(model, off):
        for i in range(3):  # profiled
            _step(model, inputs[i])
        controller = off.plan.controller
        controller.force([GroupDecision(Action.OFFLOAD)] * len(controller.profile.groups), max_inflight=2, prefetch=1)
        for i in range(3):
            _step(model, inputs[i])
        forced = off.stats()["plan"]
        assert [g["action"] for g in forced["groups"]] == ["offload"] * 6 and forced["max_inflight"] == 2
        for plan in _skipping(model, expected, inputs, off):
            assert plan["state"] not in ("profiling", "re-planning") and plan["groups"] == forced["groups"], plan["state"]
