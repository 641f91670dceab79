"""torch.compile with offload groups: the supported patterns (docs/semantics.md, "Compiled code").

Each pattern runs several steps and is compared bit for bit with the same compiled model
without an offloader; a counting backend (inductor underneath) shows that compilation
really happened, and no step after the first recompiles.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import actoffload as ao
from helpers import IMPLS, off_for

D = 32


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                torch.nn.Linear(4 * D, D))
            for _ in range(3)
        )

    def forward(self, x):
        x = x * 1  # the first block sees an activation
        for b in self.blocks:
            x = x + b(x)
        return x


def _steps(model, forward, first, n):
    """Gradients of steps ``first .. first + n - 1`` (inputs differ per step, shapes do not)."""
    out = []
    for step in range(first, first + n):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        forward(x).square().sum().backward()
        out.append([x.grad] + [p.grad.clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    return out


def _run(pattern, off):
    """Three steps of ``Model`` compiled by ``pattern``; the later two may not recompile.
    ``"parts"``: each block's two linear layers compiled, and wrapped as its parts."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    model = Model()
    parts = (lambda b: [b[1], b[3]]) if pattern == "parts" else None
    handle = ao.wrap(model.blocks, off, parts=parts) if off is not None else None
    if pattern == "parts":
        for b in model.blocks:
            for part in parts(b):
                part.compile(backend=counter)
        forward = model
    elif pattern == "regional":
        blocks = [torch.compile(b, backend=counter) for b in model.blocks]

        def forward(x):
            x = x * 1
            for b in blocks:
                x = x + b(x)
            return x
    else:
        forward = torch.compile(model, backend=counter)
    grads = _steps(model, forward, 0, 1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        grads += _steps(model, forward, 1, 2)
    if handle is not None:
        handle.remove()
    return grads, counter


def _offloader_traced():
    """Graph breaks inside the offloader: a group boundary must be a clean break instead."""
    return [k for k in counters["graph_break"] if "actoffload" in k or "RLock" in k]


def _assert_bitwise(a, b):
    for step_a, step_b in zip(a, b):
        for u, v in zip(step_a, step_b):
            assert torch.equal(u, v), f"max |diff| {(u - v).abs().max()}"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pattern", ["regional", "whole_model"])
def test_compile_wrapped_blocks_are_compiled_and_bitwise_equal_to_no_offloading(impl, pattern):
    expected, plain = _run(pattern, None)
    off = off_for(impl, "cpu", keep_last=1)
    counters.clear()
    got, counted = _run(pattern, off)
    _assert_bitwise(got, expected)
    assert counted.frame_count >= 1 and counted.op_count >= 4  # the blocks' ops were compiled
    assert off.stats()["offloaded_bytes"] > 0
    assert _offloader_traced() == []  # group boundaries are clean breaks; Dynamo never traced the offloader


def test_compile_of_the_parts_of_blocks_wrapped_with_them_is_bitwise_and_never_traces_the_offloader():
    expected, _ = _run("parts", None)
    off = off_for("fast", "cpu", keep_last=1)
    counters.clear()
    got, counted = _run("parts", off)
    _assert_bitwise(got, expected)
    assert counted.frame_count >= 1 and counted.op_count >= 2 and off.stats()["offloaded_bytes"] > 0
    assert _offloader_traced() == []


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_with_group_inside_a_compiled_function_runs_it_eagerly_and_exactly(impl):
    """A ``with off.group`` block inside compiled code: Dynamo cannot resume inside it, so it
    runs the enclosing function eagerly (documented; wrap the modules instead). Exact, and
    never traced into the offloader."""
    model = Model()
    expected = _steps(model, model, 0, 2)
    off = off_for(impl, "cpu", keep_last=1)

    def forward(x):
        x = x * 1
        for i, b in enumerate(model.blocks):
            with off.group(str(i)):
                x = x + b(x)
        return x

    torch._dynamo.reset()
    counters.clear()
    got = _steps(model, torch.compile(forward), 0, 2)
    _assert_bitwise(got, expected)
    assert off.stats()["offloaded_bytes"] > 0
    assert not [k for k in counters["graph_break"] if "RLock" in k or "set_()" in k]


def test_compile_blocks_compiled_before_wrapping_stay_compiled_under_a_budget_and_elsewhere():
    """Blocks compiled before they are wrapped (``torch.compile(block)``: Dynamo's module) are
    recomputed plainly under a budget, never under a dispatch mode: a budget's profiling meters
    a recomputed forward's ops with one (and a selective recomputation picks what to keep with
    one), and Dynamo, meeting one, runs the compiled code eagerly and never compiles it again,
    for every module compiled alike in the process (docs/semantics.md). Unmetered, no plan
    recomputes them selectively."""
    def compiled(counter):
        model = Model()
        model.blocks = torch.nn.ModuleList(torch.compile(b, backend=counter) for b in model.blocks)
        return model

    plain_counter = CompileCounterWithBackend("inductor")
    plain = compiled(plain_counter)
    expected = _steps(plain, plain, 0, 3)
    counter = CompileCounterWithBackend("inductor")
    model = compiled(counter)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget="1GB", min_offload_bytes=0)
    handle = ao.wrap(model.blocks, off)
    got = _steps(model, model, 0, 1)
    assert all(g["recomputed"] for g in off.stats()["groups"].values())  # profiling: recomputed, plainly
    got += _steps(model, model, 1, 2)
    handle.remove()
    _assert_bitwise(got, expected)
    assert counter.frame_count >= 1  # its blocks ran compiled
    assert off.stats()["plan"]["state"] == "settled"
    assert [g.costly for g in off.plan.controller.profile.groups] == [None] * 3  # not metered: never selective
    later_counter = CompileCounterWithBackend("inductor")
    later = compiled(later_counter)
    _steps(later, later, 0, 1)
    assert later_counter.frame_count >= 1  # a model compiled alike afterwards still compiles


def test_compiled_submodules_of_recomputed_groups_never_make_dynamo_compile_the_offloaders_hooks():
    """A submodule compiled inside a group a budget recomputes saves with Dynamo's callback set:
    the hooks that see those saves for the recomputation (the profiling's, the guard's) were
    compiled, guarded on storage keys, until Dynamo reached its recompile limit. Dynamo captures
    no more calls than without an offloader."""
    def steps(off):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                           torch.nn.Linear(64, 32)) for _ in range(3)])
        for b in blocks:
            b[0].compile(backend="eager")
        if off is not None:
            ao.wrap(list(blocks), off)
        for step in range(3):
            blocks(torch.randn(64, 32, requires_grad=True)).square().mean().backward()
        return dict(counters["stats"])

    plain = steps(None)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=64 << 10)
    assert steps(off) == plain
    assert "recompute" in {g["action"] for g in off.stats()["plan"]["groups"]}


@pytest.mark.parametrize("budget", [None, "1GB"])
@pytest.mark.parametrize("impl", IMPLS)
def test_jit_trace_of_a_wrapped_model_records_it_as_without_an_offloader(impl, budget):
    """``torch.jit.trace`` opens no group: a group's hooks and copies would enter the graph it
    records (fast's pool sized a traced byte count and failed; ref's copies made two traces
    differ). The trace gives what the plain model gives, and training goes on bitwise."""
    if budget is not None and impl != "fast":
        pytest.skip("a memory budget is fast's")
    model = Model()
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(7))
    plain = model(x)
    expected = _steps(model, model, 0, 1)
    model = Model()  # (seeded: the same weights)
    settings = {"memory_budget": budget} if budget else {}
    with ao.wrap(model.blocks, ao.Offloader(impl=impl, device="cpu", min_offload_bytes=0, **settings)):
        traced = torch.jit.trace(model, x)
        assert torch.equal(traced(x), plain)
        _assert_bitwise(_steps(model, model, 0, 1), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_an_evaluation_on_another_thread_runs_the_compiled_model_as_without_an_offloader(impl):
    """``torch.compile(model)`` of wrapped blocks, trained on one thread, evaluated under no_grad
    on another (R8: a forward that saves nothing opens no group there): the same outputs as
    evaluating on the training thread, and training goes on."""
    import threading

    model = Model()
    with ao.wrap(model.blocks, off_for(impl, "cpu", min_offload_bytes=0)):
        compiled = torch.compile(model, backend=CompileCounterWithBackend("inductor"))
        _steps(model, compiled, 0, 1)
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            here = compiled(x)
        there = {}

        def evaluate():
            with torch.no_grad():
                there["y"] = compiled(x)

        t = threading.Thread(target=evaluate)
        t.start()
        t.join()
        assert torch.equal(there["y"], here)
        _steps(model, compiled, 1, 1)
