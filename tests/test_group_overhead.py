"""What a group costs: the work a step of many small groups does per group, counted (calls,
objects), never timed. benchmarks/bench_many_groups.py times it against no offloader."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
import torch._dynamo.eval_frame

import actoffload as ao
from actoffload import compat, policy
from actoffload.plans import Plan
from actoffload.warmup import WarmUp
from helpers import IMPLS

GROUPS = 200


def _offloader(impl: str, **settings) -> ao.Offloader:
    if impl == "fast":
        settings.setdefault("warmup", "offload")
    return ao.Offloader(impl=impl, device="cpu", **settings)


def _forward(off: ao.Offloader, x: torch.Tensor, saves: bool, groups: int = GROUPS) -> torch.Tensor:
    """A chain of ``groups`` groups, each saving one tiny tensor (``saves``) or none."""
    h = x * 1
    for i in range(groups):
        with off.group(str(i)):
            h = h.sin() if saves else h * 1.0001
    return h


def _live_objects() -> Counter:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("saves,most", [(False, 1.2), (True, 5.5)], ids=["empty", "tiny"])
def test_a_group_keeps_few_objects_alive_while_its_graph_lives(impl, saves, most):
    """Objects the garbage collector tracks, alive per group while the forward's graph lives: an
    empty group keeps only its stats() entry; a tiny one its record, its handle and saved buffer,
    the alias autograd's handle holds and that tensor's storage, and no weak reference or list.
    Each object a step keeps per group makes Python's collector run more often, and every full
    collection walks them all. (Empty groups: no backward pass reaches them, so each step's
    entries join the last one's in stats(); a step still adds one per group.)"""
    groups = 1000
    off = _offloader(impl)
    x = torch.randn(32, requires_grad=True)
    for _ in range(2):  # the first step allocates what later ones reuse
        _forward(off, x, saves, groups).sum().backward()
    before = _live_objects()
    y = _forward(off, x, saves, groups)
    grew = _live_objects() - before
    per_group = sum(grew.values()) / groups
    assert per_group <= most, f"{per_group:.2f} objects per group: {grew.most_common(8)}"
    del y


def _count_set_eval_frame(monkeypatch) -> Counter:
    """Counts calls of Dynamo's set_eval_frame (torch.compiler.disable's wrapper makes two a call)."""
    calls: Counter = Counter()
    set_eval_frame = torch._dynamo.eval_frame.set_eval_frame

    def counting(callback):
        calls["set_eval_frame"] += 1
        return set_eval_frame(callback)

    monkeypatch.setattr(torch._dynamo.eval_frame, "set_eval_frame", counting)
    return calls


@pytest.mark.parametrize("impl", IMPLS)
def test_eager_groups_go_around_torch_compiler_disable(impl, monkeypatch):
    """Outside torch.compile, a group's boundaries and its hooks call the offloader directly:
    torch.compiler.disable's wrapper (which sets Dynamo's frame callback twice a call) runs for
    none of them. tests/test_compile.py checks that compiled code still never traces in."""
    calls = _count_set_eval_frame(monkeypatch)
    off = _offloader(impl)
    _forward(off, torch.randn(32, requires_grad=True), saves=True).sum().backward()
    assert calls["set_eval_frame"] == 0


def test_not_traced_goes_through_the_disabling_wrapper_while_dynamo_may_see_the_call(monkeypatch):
    seen = []
    fn = compat.not_traced(lambda x: seen.append(torch._C._dynamo.eval_frame.get_eval_frame_callback()) or x)
    assert fn(3) == 3 and seen == [None]
    calls = _count_set_eval_frame(monkeypatch)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # as while Dynamo compiles
    assert fn(4) == 4 and seen == [None, None]  # run with Dynamo's callback off, as before
    assert calls["set_eval_frame"] >= 2


@pytest.mark.parametrize("impl", IMPLS)
def test_groups_push_their_hooks_without_a_context_object_each(impl, monkeypatch):
    made = Counter()
    init = torch.autograd.graph.saved_tensors_hooks.__init__

    def counting(self, *args, **kwargs):
        made["hooks"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph.saved_tensors_hooks, "__init__", counting)
    off = _offloader(impl)
    _forward(off, torch.randn(32, requires_grad=True), saves=True).sum().backward()
    assert made["hooks"] == 0


def test_push_and_pop_of_saved_tensor_hooks():
    def pack(t):
        return t

    def unpack(t):
        return t

    compat.push_saved_tensors_hooks(pack, unpack)
    try:
        assert compat.current_saved_tensors_hooks() == (pack, unpack)
    finally:
        compat.pop_saved_tensors_hooks()
    assert compat.current_saved_tensors_hooks() is None


def test_a_plan_is_asked_only_where_it_acts_now():
    """An offloader asks its plan only at the points the plan acts at, read again at each step:
    a warm-up that is over (or never began) is asked nothing per group."""

    class Counting(Plan):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def opening(self, name, recomputable, parts):
            self.calls["opening"] += 1
            return super().opening(name, recomputable, parts)

    assert Plan().acts_at() == frozenset()
    assert Counting().acts_at() == frozenset({"opening"})
    assert WarmUp(active=False).acts_at() == frozenset()
    assert "opening" in WarmUp(active=True).acts_at()

    plan = Counting()
    off = ao.Offloader(impl="ref", device="cpu", plan=plan)
    _forward(off, torch.randn(32, requires_grad=True), saves=True).sum().backward()
    assert plan.calls["opening"] == GROUPS

    warm = _offloader("fast", warmup="recompute")
    assert "opening" in warm._asks
    warm.plan.warming = False  # as when the host blocks it waits for are pinned
    _forward(warm, torch.randn(32, requires_grad=True), saves=True).sum().backward()
    assert warm._asks == frozenset()  # read again when the step began


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 5),
    lambda: torch.randn(4, 5)[1:3],
    lambda: torch.randn(4, 5).t(),
    lambda: torch.randn(4, 1, 5).as_strided((4, 1, 5), (5, 77, 1)),  # contiguous, odd stride on a size-1 dim
    lambda: torch.randn(6, 6)[::2, 1:],
    lambda: torch.randn(4, 5)[2:2],
    lambda: torch.randn(8).as_strided((0, 3), (1, 1), 5),
    lambda: torch.randn(3, 4).to(memory_format=torch.contiguous_format)[:, 1],
], ids=["contiguous", "rows", "transposed", "size_1_stride", "strided", "empty", "empty_strided", "column"])
def test_a_saved_fact_covers_the_bytes_the_tensor_can_touch(make):
    t = make()
    fact = policy.fact_of(t, torch.device("cpu"), False)
    assert (fact.start, fact.end) == policy.byte_extent(t)
    assert fact.storage_bytes == t.untyped_storage().nbytes()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pattern", ["regional", "whole_model"])
def test_torch_compile_compiles_no_frame_of_the_offloader(impl, pattern):
    """While compiled code runs, Dynamo's callback sees every Python frame called: the calls that
    dispatch around torch.compiler.disable are skipped, and send every call they see then
    through it, so Dynamo compiles none of the offloader's frames (a wrapper that only asked
    torch.compiler.is_compiling() had its hook frames compiled, once per saved tensor's shape)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
                                 for _ in range(3))
    off = _offloader(impl, keep_last=1, min_offload_bytes=0)
    if pattern == "regional":
        compiled = [torch.compile(b, backend="eager") for b in blocks]

        def forward(x):
            for i, b in enumerate(compiled):
                with off.group(str(i)):
                    x = x + b(x)
            return x
    else:
        handle = ao.wrap(blocks, off)

        def step(x):
            for b in blocks:
                x = x + b(x)
            return x

        forward = torch.compile(step, backend="eager")
    try:
        for n in (4, 6, 8):  # new shapes: a frame compiled per shape would show
            x = torch.randn(n, 16, requires_grad=True)
            forward(x * 1).sum().backward()
        assert off.stats()["offloaded_bytes"] > 0
        # (the offloader's own frames: actoffload.tools holds models that other tests compile)
        compiled_here = [f"{f.__module__}.{f.__qualname__}" for f in gc.get_objects()
                         if type(f).__name__ == "function" and (f.__module__ or "").startswith("actoffload")
                         and not f.__module__.startswith("actoffload.tools")
                         and torch._C._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)]
        assert compiled_here == []
    finally:
        if pattern == "whole_model":
            handle.remove()
        torch._dynamo.reset()
