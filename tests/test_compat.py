"""Each private PyTorch API actoffload uses (actoffload/compat.py), checked on its own: a torch
release that changes one fails here, by name."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from actoffload import compat
from helpers import CUDA


def test_storage_key_is_shared_by_views_and_differs_between_storages():
    a = torch.randn(8, 8)
    assert compat.storage_key(a) == compat.storage_key(a.t()[2:]) == compat.storage_key(a.detach())
    assert compat.storage_key(a) != compat.storage_key(a.clone())


def test_storage_weakref_gives_the_storage_back_while_it_lives():
    a = torch.randn(16)
    ref = compat.storage_weakref(a)
    storage = compat.storage_from_weakref(ref)
    assert storage is not None and storage.data_ptr() == a.data_ptr()
    del a, storage
    gc.collect()
    assert ref.expired() and compat.storage_from_weakref(ref) is None


def test_version_guard_follows_in_place_writes_without_holding_memory():
    a = torch.randn(1024)
    guard = compat.version_guard(a[2:])
    ref = compat.storage_weakref(a)
    assert guard.numel() == 0
    a.add_(1)
    assert guard._version == a._version == 1
    del a
    gc.collect()
    assert ref.expired()


def test_version_guard_of_a_wrapper_subclass_drops_its_inner_tensors():
    from torch.testing._internal.two_tensor import TwoTensor

    inner = torch.randn(8)
    t = TwoTensor(inner, inner.clone())
    ref = compat.storage_weakref(inner)
    guard = compat.version_guard(t)
    t.add_(1)
    assert guard._version == t._version == 1
    del t, inner
    gc.collect()
    assert ref.expired()


def test_zero_tensor_and_neg_view():
    z = torch._efficientzerotensor(3)
    assert compat.is_zero_tensor(z) and not compat.is_zero_tensor(torch.zeros(3))
    n = compat.neg_view(torch.tensor([1.0, -2.0]))
    assert n.is_neg() and torch.equal(n.resolve_neg(), torch.tensor([-1.0, 2.0]))


def test_sequence_numbers_increase_as_nodes_are_created():
    x = torch.randn(3, requires_grad=True)
    before = compat.sequence_nr()
    y = x * 2
    assert y.grad_fn._sequence_nr() >= before and compat.sequence_nr() > before


def test_backward_introspection_current_node_will_execute_and_end_callback():
    seen = {}
    x = torch.randn(3, requires_grad=True)
    other = (torch.randn(3, requires_grad=True) * 3)  # a graph this backward does not run

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen["in_backward"] = compat.in_backward()
            seen["node"] = compat.current_node()
            seen["mine"] = compat.will_execute(mine.grad_fn)
            seen["other"] = compat.will_execute(other.grad_fn)
            compat.at_backward_end(lambda: seen.setdefault("ended", True))
            return g

    mine = x * 2
    y = Probe.apply(mine)
    assert not compat.in_backward() and compat.current_node() is None
    y.sum().backward()
    assert seen["in_backward"] and type(seen["node"]).__name__.startswith("Probe")
    assert seen["mine"] and not seen["other"] and seen["ended"]


def test_current_saved_tensors_hooks_and_mutation_flag():
    assert compat.current_saved_tensors_hooks() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert compat.current_saved_tensors_hooks() == (pack, unpack)
    assert not compat.mutation_on_saved_allowed()
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        assert compat.mutation_on_saved_allowed()
        assert compat.current_saved_tensors_hooks() is not None


def test_not_traced_functions_are_skipped_by_dynamo():
    calls = []

    @compat.not_traced
    def side_effect(x):
        calls.append(threading.get_ident())
        return x

    torch.compile(lambda x: side_effect(x) * 2, backend="eager")(torch.ones(2))
    assert len(calls) == 1


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")
def test_pin_exactly_and_capture_query_on_cuda():
    host = torch.empty(4096, dtype=torch.uint8)
    compat.pin_exactly(host)
    assert host.is_pinned()
    assert not compat.stream_is_capturing(torch.device("cuda"))


def test_capture_query_on_cpu_is_false():
    assert not compat.stream_is_capturing(torch.device("cpu"))


def test_storage_id_and_node_sequence_nr():
    a = torch.randn(4)
    assert compat.storage_id(a.untyped_storage()) == compat.storage_key(a[1:])
    x = torch.randn(3, requires_grad=True)
    first, second = x * 2, x * 3
    assert compat.node_sequence_nr(second.grad_fn) > compat.node_sequence_nr(first.grad_fn)


def test_host_cache_emptier_is_found_in_every_supported_torch():
    assert compat.host_cache_emptier() is not None  # a release that renames it fails here
    assert compat.empty_host_cache() == torch.cuda.is_available()


def test_hooks_own_saves_knows_checkpoint_and_mutation_hooks_only():
    seen = []

    def fn(x):
        seen.append(compat.hooks_own_saves(compat.current_saved_tensors_hooks()))
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert seen[0] is True  # the forward, under checkpoint's hooks (the recomputation may differ)
    assert compat.hooks_own_saves(None) is False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert compat.hooks_own_saves(compat.current_saved_tensors_hooks()) is False
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        assert compat.hooks_own_saves(compat.current_saved_tensors_hooks()) is True


def test_reparametrized_swaps_parameters_and_buffers_in_and_back():
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    own = dict(m.named_parameters()) | dict(m.named_buffers())
    other = {name: t.detach().clone() + 1 for name, t in own.items()}
    other["0.weight"].requires_grad_()
    with compat.reparametrized(m, other):
        assert all(t is other[name] for name, t in m.named_parameters(remove_duplicate=False))
        assert m[1].running_mean is other["1.running_mean"]
        m[0](torch.ones(1, 3)).sum().backward()
    assert other["0.weight"].grad is not None and m[0].weight.grad is None  # the grads went to the tensors given
    assert all(t is own[name] for name, t in m.named_parameters()) and m[1].running_mean is own["1.running_mean"]


def test_own_tensors_are_the_modules_own_parameters_and_buffers():
    m = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    m.register_parameter("w", torch.nn.Parameter(torch.ones(2)))
    m.register_buffer("b", None)
    params, buffers = compat.own_tensors(m)
    assert params == {"w": m.w} and params["w"] is m.w and buffers == {"b": None}
    params, buffers = compat.own_tensors(m[0])
    assert params["weight"] is m[0].weight and buffers["running_mean"] is m[0].running_mean
    assert set(params) == {n for n, _ in m[0].named_parameters(recurse=False)}
    assert set(buffers) == {n for n, _ in m[0].named_buffers(recurse=False)}
    params["weight"] = None
    assert m[0].weight is not None  # a copy
    then = compat.own_tensors(m[0])
    assert compat.holds_own_tensors(m[0], then)
    m[0].weight = torch.nn.Parameter(m[0].weight.detach().clone())  # same name, another object
    assert not compat.holds_own_tensors(m[0], then)
    assert not compat.holds_own_tensors(m, (then[0], {}))


def test_without_dispatch_modes_hides_ops_from_an_active_mode_and_keeps_it():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Seeing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    t = torch.randn(4)
    with Seeing():
        with compat.without_dispatch_modes():
            guard = compat.version_guard(t)
        assert seen == []
        t.add_(1)
    assert seen == [torch.ops.aten.add_.Tensor] and guard._version == t._version


def test_a_step_imports_no_dynamo_and_not_traced_made_before_dynamo_still_keeps_compile_out():
    """Dynamo's Python side takes seconds to import: a step without ``torch.compile`` leaves it
    unimported; a function made ``not_traced`` before it was imported is still skipped once it is."""
    script = textwrap.dedent("""
        import sys, torch, actoffload as ao
        from actoffload import compat
        calls = []

        @compat.not_traced
        def side_effect(x):
            calls.append(1)
            return x

        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        ao.wrap(m, ao.Offloader(device="cpu"))  # (on CUDA a first step recomputes: torch's checkpoint imports Dynamo)
        m(torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert not [k for k in sys.modules if k.startswith("torch._dynamo")], "dynamo imported"
        out = torch.compile(lambda x: side_effect(x) * 2, backend="eager")(torch.ones(2))
        assert calls == [1] and out.tolist() == [2.0, 2.0]
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_in_function_transform_is_true_only_inside_a_torch_func_transform():
    seen = []

    def f(x):
        seen.append(compat.in_function_transform())
        return x.sin().sum()

    torch.func.grad(f)(torch.ones(3))
    torch.func.vmap(f)(torch.ones(2, 3))
    f(torch.ones(3))
    assert seen == [True, True, False]
