"""R8: backward once, twice or never; several forwards in flight; exceptions leave nothing behind."""

import gc

import pytest
import torch
import torch.utils.checkpoint

import actoffload as ao
from helpers import DEVICES, IMPLS, assert_bitwise, grads_of, mlp_stack, off_for, reference_grads, run_groups, zero_grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R8_retain_graph_backward_twice(impl, device):
    model = mlp_stack(3, 32, device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    expected = [2 * g for g in reference_grads(model, x)]
    off = off_for(impl, device, keep_last=1)
    y = run_groups(model, x, off).sum()
    y.backward(retain_graph=True)
    assert off.stats()["host_bytes_in_use"] > 0  # kept for the second backward
    y.backward()
    assert_bitwise(grads_of(model, x), expected)
    del y
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R8_no_backward_frees_host_memory_with_the_graph(impl, device):
    model = mlp_stack(3, 32, device)
    off = off_for(impl, device, keep_last=0)
    y = run_groups(model, torch.randn(16, 32, device=device, requires_grad=True), off)
    assert off.stats()["host_bytes_in_use"] > 0
    del y
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_R8_several_forwards_in_flight_backward_in_any_order(impl, device, order):
    model = mlp_stack(3, 32, device)
    xs = [torch.randn(8, 32, device=device, requires_grad=True) for _ in range(3)]
    expected = []
    for x in xs:
        zero_grads(model)
        run_groups(model, x).square().sum().backward()
        expected.append(grads_of(model, x))
        x.grad = None
    off = off_for(impl, device, keep_last=1)
    outs = [run_groups(model, x, off).square().sum() for x in xs]
    for i in order:
        zero_grads(model)
        outs[i].backward()
        assert_bitwise(grads_of(model, xs[i]), expected[i])
    del outs
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("use_wrap", [False, True])
def test_R8_exception_inside_a_group_leaves_the_offloader_usable(impl, device, use_wrap):
    model = mlp_stack(3, 32, device)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    expected = reference_grads(model, x)

    off = off_for(impl, device, keep_last=1)

    class Boom(Exception):
        pass

    def failing(h):
        raise Boom()

    def forward_that_fails():  # its locals, and so the partial graph, die with it
        if use_wrap:
            handle = ao.wrap([model[0], model[1]], off)
            hook = model[1].register_forward_pre_hook(lambda m, a: failing(a))
            try:
                model[1](model[0](x))
            finally:
                hook.remove()
                handle.remove()
        else:
            h = run_groups([model[0]], x, off)
            with off.group("1"):
                failing(model[1](h))

    try:  # not pytest.raises: its ExceptionInfo keeps the traceback, and so the graph, alive
        forward_that_fails()
    except Boom:
        pass
    else:
        pytest.fail("the forward did not raise")
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0
    assert off.stats()["groups"] == {} or use_wrap  # (with wrap, the exception came before group '1' opened)
    y = run_groups(model, x, off)  # usable afterwards, nothing nested left open
    # the cut-short forward's groups went with its graph: each group counts once, under its own
    # name (not "0#2"), and what they moved is what host memory holds
    stats = off.stats()
    assert list(stats["groups"]) == ["0", "1", "2"]
    assert stats["offloaded_bytes"] == stats["host_bytes_in_use"] > 0
    y.sum().backward()
    assert_bitwise(grads_of(model, x), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_a_group_an_exception_cut_short_gives_its_number_up(impl):
    """A micro-batch's forward that raises inside its second group, retried while the first
    micro-batch waits for its backward: the retry's groups take the numbers the failed ones had
    ("g1#2", not "g1#3"), as the stats window promises for a group let go before backward."""
    weights = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]
    off = off_for(impl, "cpu")

    def forward(x, fail_in=None):
        h = x
        for i, w in enumerate(weights):
            with off.group(f"g{i}"):
                h = torch.tanh(h @ w)
                if i == fail_in:
                    raise ValueError("bad batch")
        return h.sum()

    x = torch.randn(4, 16)
    first = forward(x)
    try:
        forward(2 * x, fail_in=1)
    except ValueError:
        pass
    gc.collect()
    second = forward(2 * x)
    assert list(off.stats()["groups"]) == ["g0", "g1", "g2", "g0#2", "g1#2", "g2#2"]
    (first + second).backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keep_last", [0, 1, 3])
def test_R8_graph_freed_without_backward_releases_resident_tensors(impl, device, keep_last):
    from torch.multiprocessing.reductions import StorageWeakRef

    model = mlp_stack(3, 32, device)
    off = off_for(impl, device, keep_last=keep_last)
    refs = []
    h = torch.randn(16, 32, device=device, requires_grad=True)
    for i, layer in enumerate(model):
        with off.group(str(i)):
            h = layer(h)  # the outputs saved by GELU stay resident in kept groups
            refs.append(StorageWeakRef(h.untyped_storage()))
    del h
    gc.collect()
    assert all(r.expired() for r in refs)  # no reference cycle through the graph
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keep_last", [0, 1], ids=["committed", "resident"])
def test_R8_saved_buffers_are_freed_node_by_node_in_backward(impl, keep_last):
    """A saved tensor is released when autograd releases it, not when its whole group is done."""
    from torch.multiprocessing.reductions import StorageWeakRef

    off = off_for(impl, "cpu", keep_last=keep_last, min_offload_bytes=1 << 30)  # all kept
    x = torch.randn(64, 64, requires_grad=True)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):  # runs after c's node, before a's
            gc.collect()
            seen.append(c_ref.expired())
            return g

    with off.group("g"):
        a = (x * 1).exp()  # saves a: its node runs last in backward
        c = Probe.apply(a).exp()  # saves c: its node runs first
        c_ref = StorageWeakRef(c.untyped_storage())
        loss = c.sum()
        del c, a
    loss.backward()
    assert seen == [True]  # c went as soon as its node had run, while the group still lived


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_a_backward_that_raised_leaves_nothing_once_pytorch_lets_go(impl):
    """R6 raises in a checkpointed block whose output sums two branches: the branch already
    queued stays with PyTorch (holding the checkpoint's saved input, offloaded here) until the
    next backward on this thread; then not a host byte may stay in use."""
    off = off_for(impl, "cpu", keep_last=0)
    w = torch.randn(32, requires_grad=True)

    def block(x):
        c = x.exp() * w  # one branch
        with torch.no_grad():
            x.add_(0)  # after checkpoint saved x: backward raises (R6)
        return c + x.sin()  # the other branch

    h = torch.randn(8, 32, requires_grad=True)
    with off.group("g"):
        y = torch.utils.checkpoint.checkpoint(block, h * 1, use_reentrant=False)
    assert off.stats()["host_bytes_in_use"] > 0
    try:  # not pytest.raises: its ExceptionInfo keeps the traceback alive
        y.sum().backward()
    except RuntimeError as e:
        assert "modified by an in-place operation" in str(e)
    else:
        pytest.fail("backward did not raise")
    del y
    torch.ones((), requires_grad=True).backward()  # PyTorch drops what the failed pass left queued
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0
