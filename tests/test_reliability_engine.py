"""Reliability of the engine under adversarial inputs: deep graphs, storages freed and
refilled before backward, tiny tensors, many groups. Each is checked bitwise against the
same run without an offloader (R1), or the error PyTorch itself gives."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import actoffload as ao
from actoffload import graph
from helpers import IMPLS, off_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- deep graphs
def _node_objects() -> int:
    """Autograd nodes that have a Python object now (each is freed by recursion in torch 2.13)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.autograd.graph.Node))


def _chain(off, groups: int, muls: int, x: torch.Tensor) -> torch.Tensor:
    """``groups`` groups of ``muls`` multiplications by a scalar (no saves) and one sin (saves its
    input): backward enters each group at its last node, ``muls`` nodes from the group before."""
    h = x * 1
    for _ in range(groups):
        with off.group("g"):
            for _ in range(muls):
                h = h * 1.0001
            h = h.sin()
            h = h * 1.0001
    return h


@pytest.mark.parametrize("min_offload_bytes", [0, 1 << 20])
def test_prefetch_gives_at_most_a_few_graph_nodes_a_python_object_per_group(min_offload_bytes):
    """Prefetch finds the groups backward reaches next from one node per group, not by walking
    the graph (which gave every node a Python object, and freeing a deep graph then overflowed
    the C stack)."""
    gc.collect()
    before = _node_objects()
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=min_offload_bytes, prefetch=1, keep_last=1)
    x = torch.randn(4, requires_grad=True)
    y = _chain(off, 20, 10, x)
    y.sum().backward()
    made = _node_objects() - before
    moved = min_offload_bytes == 0
    assert made <= (graph.LINK_TRIES * 20 if moved else 0), made  # 20 groups of 12 nodes
    del y
    gc.collect()
    assert _node_objects() == before


def test_prefetch_still_follows_a_chain_of_linear_layers():
    """A group whose first saves are its input, made by the group before: prefetch goes there."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=1, prefetch=2)
    h = x
    for i, layer in enumerate(model):
        with off.group(str(i)):
            h = layer(h)
    got = torch.autograd.grad(h.square().sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert off.stats()["copies"]["prefetched_groups"] == 5  # groups 0..4 moved; 5 stayed (keep_last)


class _Layer(torch.nn.Module):
    """A pre-norm layer: norms and residual adds outside its two parts."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.attn = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


@pytest.mark.parametrize("warmup", ["offload", "recompute"])
def test_prefetch_follows_layers_wrapped_by_their_parts_across_the_norms_and_adds_between(warmup):
    """Between two parts lie ops of no group (a norm, a residual add): prefetch still finds the
    part before, a few nodes up, so a reload (a recomputed part's inputs too) runs ahead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Layer() for _ in range(4)])
    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=1, prefetch=2, warmup=warmup)
    with ao.wrap(model, off, parts=lambda layer: [layer.attn, layer.mlp]):
        got = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert off.stats()["copies"]["prefetched_groups"] == 7  # 8 parts: each reached from the one after


class _UpcastNormLayer(torch.nn.Module):
    """A layer wrapped whole that begins as transformers' decoder layers do: its norm casts its
    input up first (to float64 here, the input being float32), so its first saves are of tensors
    its own ops made."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(16))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, h):
        x = h.to(torch.float64)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h + self.mlp(self.weight * x.to(h.dtype))


def test_prefetch_follows_layers_whose_first_saves_their_own_ops_made():
    """The node of the layer before is found from the tensor the layer is called with, not from
    its first saves: prefetch reaches every layer moved, as it does a chain of linear layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_UpcastNormLayer() for _ in range(4)])
    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=1, prefetch=1)
    with ao.wrap(model, off):
        got = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert off.stats()["copies"]["prefetched_groups"] == 3  # layers 0..2 moved; 3 stayed (keep_last)


class _Marked(torch.autograd.Function):
    """Identity whose autograd node holds ``ctx.marker``: the marker lives as long as the node."""

    markers: list = []

    @staticmethod
    def forward(ctx, t):
        ctx.marker = _MarkedNode()
        _Marked.markers.append(weakref.ref(ctx.marker))
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class _MarkedNode:
    pass


class _Detaching(torch.nn.Module):
    """Reads the tensor it is called with detached (a probe, a target head): its graph does not
    reach the layer before."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h):
        return self.lin(h.detach()).relu()


@pytest.mark.parametrize("impl", ["ref", "fast"])
def test_a_graph_let_go_is_freed_while_a_later_group_that_reads_its_output_detached_lives(impl):
    """R8: the first layer's graph and its saves go when the caller lets go of its output, though
    the second layer, called with that output, still holds its own graph (prefetch's link to
    the layer before is only ever a node the group's own graph reaches)."""
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    model = torch.nn.ModuleList([first, _Detaching()])
    off = ao.Offloader(impl=impl, device="cpu", min_offload_bytes=0, keep_last=0, **({"prefetch": 1} if impl == "fast" else {}))
    _Marked.markers.clear()
    with ao.wrap(model, off):
        h = _Marked.apply(model[0](torch.randn(4, 16, requires_grad=True)))
        alone = off.stats()["host_bytes_in_use"]
        out = model[1](h)
        del h
        gc.collect()
        assert _Marked.markers[0]() is None
        assert 0 < off.stats()["host_bytes_in_use"] < alone + 1  # the second layer's saves only
        out.sum().backward()


class _RefusesIsLeaf(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` raises on reading ``is_leaf``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(getattr(func, "__self__", None), "__name__", "") == "is_leaf":
            raise NotImplementedError("is_leaf")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_wrapped_call_that_raises_before_its_forward_leaves_no_group_open():
    """R8: an exception as a wrapped module's group opens (here fast reading the tensor it is
    called with, for prefetch's link) closes the group: no saved-tensor hooks are left behind,
    and the next call runs."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
                                 for _ in range(3))
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0)
    with ao.wrap(blocks, off):
        h = blocks[0](torch.randn(4, 16, requires_grad=True))
        with pytest.raises(NotImplementedError, match="is_leaf"):
            blocks[1](h.as_subclass(_RefusesIsLeaf))
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        blocks[2](torch.randn(4, 16, requires_grad=True)).sum().backward()


_DEEP = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import actoffload as ao

    def chain(off, groups, muls, saves):
        x = torch.randn(4, requires_grad=True)
        h = x * 1
        for _ in range(groups):
            with off.group("g"):
                for _ in range(muls):
                    h = h * 1.0001
                for _ in range(saves):
                    h = h.sin()
        return h

    # fast with its defaults (nothing big enough to move): 5,000 groups of 20 nodes
    y = chain(ao.Offloader(impl="fast", device="cpu"), 5000, 19, 1)
    y.sum().backward()
    del y
    print("fast defaults freed", flush=True)
    # fast moving every save: 2,500 groups of 40 nodes
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, warmup="offload")
    y = chain(off, 2500, 39, 1)
    y.sum().backward()
    del y
    print("fast moving freed", flush=True)
    # ref: 60,000 saves in one group
    off = ao.Offloader(impl="ref", device="cpu", min_offload_bytes=0)
    y = chain(off, 1, 0, 60000)
    y.sum().backward()
    del y
    print("ref freed", flush=True)
    # fast moving every save of 5,000 wrapped modules whose first saves come a dozen ops after
    # the tensor they are called with (prefetch looks for a link from it and from their saves)
    class M(torch.nn.Module):
        def forward(self, h):
            for _ in range(12):
                h = h * 1.0001
            return h.sin().cos() * 1.0001
    mods = torch.nn.ModuleList(M() for _ in range(5000))
    ao.wrap(mods, ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, warmup="offload"))
    h = torch.randn(4, requires_grad=True) * 1
    for m in mods:
        h = m(h)
    h.sum().backward()
    del h
    print("wrapped freed", flush=True)
""")


def test_a_graph_of_100000_nodes_with_offloading_frees_like_plain_pytorch():
    """In a subprocess (a stack overflow is a segfault): fast's prefetch search used to give
    every node it walked a Python object, and torch frees such nodes by recursion, so freeing
    these graphs crashed (the first at 100,000 nodes; 40,000 did not) where plain PyTorch frees
    them. So did a chain of 3,500 wrapped modules while prefetch walked eight of each one's own
    nodes up from its first save (10,000 free now and 14,000 crash; before wrapped modules were
    linked through the tensor they are called with, 14,000 freed and 20,000 crashed)."""
    proc = subprocess.run([sys.executable, "-c", _DEEP.format(root=ROOT)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.split("\n")[:4] == ["fast defaults freed", "fast moving freed", "ref freed", "wrapped freed"]


# ---------------------------------------------------------------- storages freed and refilled
class _Pending:
    """An event that never completes by itself: every offload copy looks in flight, so fast
    uses sources in place in backward (as on CUDA when backward comes soon after a commit)."""

    def query(self):
        return False

    def synchronize(self):
        pass


def _freed_and_refilled(off, keep_last: int, free_after_commit: bool, shrink_to: int = 0):
    """Group a saves h (exp saves its output) and a view of it at a nonzero offset; the caller
    frees h's storage after the forward and refills it before backward. Returns the gradients
    of two backwards (the first keeps the graph), and what h's storage held meanwhile."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    with _group(off, "a"):
        h = (x @ w).exp()  # saves h
        tail = h[8:].sin()  # saves a view of h starting at byte 8 * 32 * 4
    keep = h.detach().clone()
    n = h.untyped_storage().nbytes()
    if not free_after_commit:
        h.untyped_storage().resize_(shrink_to)
    with _group(off, "b"):  # a commits here with keep_last=1 (at its own exit with keep_last=0)
        y = tail * 2
    if free_after_commit:
        h.untyped_storage().resize_(shrink_to)
    meanwhile = h.untyped_storage().nbytes()  # nothing grew it back
    h.untyped_storage().resize_(n)
    h.untyped_storage().copy_(keep.untyped_storage())  # refilled (no version bump)
    loss = (h * 3).sum() + y.sum()
    first = torch.autograd.grad(loss, [x, w], retain_graph=True)
    second = torch.autograd.grad(loss, [x, w])
    return [*first, *second], meanwhile


def _group(off, name):
    """``off``'s group ``name``, or nothing at all without an offloader (the reference run)."""
    return off.group(name) if off is not None else contextlib.nullcontext()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shrink_to", [0, 1000])
def test_a_storage_freed_before_the_commit_stays_with_autograd(impl, shrink_to):
    expected, _ = _freed_and_refilled(None, 1, free_after_commit=False, shrink_to=shrink_to)
    off = off_for(impl, "cpu", keep_last=1)
    got, meanwhile = _freed_and_refilled(off, 1, free_after_commit=False, shrink_to=shrink_to)
    assert meanwhile == shrink_to  # the commit neither read nor regrew it
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    a = off.stats()["groups"]["a"]
    assert a["kept"].get("freed") == 2 and a["offloaded_bytes"] == 0  # h and its view: one storage


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("in_flight", [False, True])
def test_a_storage_freed_after_the_commit_comes_back_from_the_host_copy(impl, in_flight, monkeypatch):
    """Freed once its bytes were copied out, refilled before backward: backward gets the bytes
    (from the host copy, or in place where the refilled storage holds them again), and nothing
    regrows the caller's storage meanwhile."""
    if in_flight:
        if impl != "fast":
            pytest.skip("ref's copies are synchronous")
        from actoffload.fast.streams import CopyStreams

        monkeypatch.setattr(CopyStreams, "record", lambda self, stream=None: _Pending())
    expected, _ = _freed_and_refilled(None, 0, free_after_commit=True)
    off = off_for(impl, "cpu", keep_last=0, **({"max_inflight": 4} if impl == "fast" else {}))
    got, meanwhile = _freed_and_refilled(off, 0, free_after_commit=True)
    assert meanwhile == 0
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert off.stats()["groups"]["a"]["offloaded_bytes"] > 0


class _MovesOut:
    """The spans fast moves out, by group, as each commit starts its copy (recorded first: a
    commit that then raises is recorded too)."""

    def __init__(self, monkeypatch):
        from actoffload.fast.offloader import FastOffloader

        self._by_group: list[tuple[str, list]] = []
        move_out = FastOffloader._move_out

        def recording(off, group, moved):
            self._by_group.append((group.name, list(moved)))
            move_out(off, group, moved)

        monkeypatch.setattr(FastOffloader, "_move_out", recording)

    def of(self, group: str | None = None) -> list:
        """The spans ``group`` moved out (every group's: ``None``)."""
        return [m for name, moved in self._by_group if group in (None, name) for m in moved]

    def clear(self) -> None:
        self._by_group.clear()


def _freed_while_in_flight(monkeypatch, refill: bool):
    """fast, every copy in flight (its event never fires by itself): group a saves h; the
    caller frees h's storage; group b's commit lets a's sources go (one group in flight at
    most), and finds h freed. The host copy is then overwritten with garbage, as a copy racing
    other work for the freed memory could have made it. Returns the gradient, or raises."""
    from actoffload.fast.streams import CopyStreams

    monkeypatch.setattr(CopyStreams, "record", lambda self, stream=None: _Pending())
    moves = _MovesOut(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    off = off_for("fast", "cpu", keep_last=0, max_inflight=1, pack_below=0)
    with off.group("a"):
        h = (x * 2).exp()  # saves h
        y = h.sin()  # saves h again
    keep = h.detach().clone()
    n = h.untyped_storage().nbytes()
    h.untyped_storage().resize_(0)
    with off.group("b"):
        z = y * y  # saves y twice
    with off.group("c"):  # b's commit is in flight: a's sources are let go here
        out = z.cos()
    spans = moves.of("a")
    assert spans and all(m.caller_freed for m in spans)
    for m in spans:
        m.host.fill_(255)  # what a racing copy could have read
    if refill:
        h.untyped_storage().resize_(n)
        h.untyped_storage().copy_(keep.untyped_storage())
    return torch.autograd.grad(out.sum(), x)[0]


def test_fast_a_source_freed_while_its_copy_is_in_flight_comes_from_the_refilled_storage(monkeypatch):
    """The caller frees a saved storage while fast's copy of it may still be reading it, and
    refills it before backward: backward takes the bytes from the storage, as autograd would,
    never from the host copy (which may hold bytes of other work)."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    expected = torch.autograd.grad(((x * 2).exp().sin() ** 2).cos().sum(), x)[0]
    got = _freed_while_in_flight(monkeypatch, refill=True)
    assert torch.equal(got, expected)


def test_fast_a_source_freed_while_its_copy_is_in_flight_and_not_refilled_raises(monkeypatch):
    """Not refilled, its bytes are nowhere to be trusted: backward raises, naming the group,
    rather than restoring bytes the copy may have read from other work."""
    with pytest.raises(RuntimeError, match=r"group 'a' was freed \(resize_\(0\)\) while its copy"):
        _freed_while_in_flight(monkeypatch, refill=False)


def test_fast_a_source_used_in_place_and_then_resized_reloads_from_the_host(monkeypatch):
    """fast uses a span still copying out in place; the caller frees its storage between two
    unpacks (a hook on h runs after sin's backward read h, before exp's): exp's comes back from
    the host copy, with the bytes as saved, and the storage is not grown back."""
    from actoffload.fast.streams import CopyStreams

    monkeypatch.setattr(CopyStreams, "record", lambda self, stream=None: _Pending())
    x = torch.randn(64, requires_grad=True)
    expected = torch.autograd.grad(((x * 2).exp().sin() * 1).sum(), x)[0]
    off = off_for("fast", "cpu", keep_last=0, max_inflight=4, pack_below=0)
    with off.group("a"):
        h = (x * 2).exp()  # saves h
        y = h.sin() * 1  # saves h again: one span, two unpacks

    def free_h(grad):
        h.untyped_storage().resize_(0)

    h.register_hook(free_h)
    got = torch.autograd.grad(y.sum(), x)[0]
    assert off.stats()["copies"]["reused_in_flight_groups"] == 1
    assert h.untyped_storage().nbytes() == 0  # never grown back
    assert torch.equal(got, expected)


class _CopiesWatched:
    """fast on the CPU made to behave as on a GPU whose copies lag: every copy's event stays
    pending, and each large source the offloader lets go is checked to be safe to reuse at
    once: its copy waited for by the compute stream, held back for the copy stream
    (``record_stream``), or held by backward in place. Else it is in ``unsafe``: its memory
    could go to other work before the copy read it."""

    def __init__(self, monkeypatch):
        from actoffload.fast.offloader import FastOffloader
        from actoffload.fast.streams import CopyStreams

        self.waited: set[int] = set()
        self.held: set[int] = set()  # data pointers handed to record_stream
        self.unsafe: list[int] = []
        monkeypatch.setattr(CopyStreams, "record", lambda streams, stream=None: _Pending())
        monkeypatch.setattr(CopyStreams, "wait", lambda streams, event, stream=None: self.waited.add(id(event)))
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, stream: self.held.add(t.untyped_storage().data_ptr()))
        release = FastOffloader._release_sources

        def checked(entry):
            rec, _stage, moved = entry
            before = [(m, m.storage) for m in moved]
            release(entry)
            for m, storage in before:
                if storage is not None and m.storage is None and m.dev is None and id(rec.done) not in self.waited \
                        and storage.data_ptr() not in self.held:
                    self.unsafe.append(m.nbytes)

        monkeypatch.setattr(FastOffloader, "_release_sources", staticmethod(checked))

    def offloader(self, **kw):
        off = off_for("fast", "cpu", keep_last=0, pack_below=0, **kw)
        off._streams.d2h = object()  # a copy stream to record uses on (record_stream is the fake above)
        return off


@pytest.mark.parametrize("max_inflight, g_moves_its_own", [(1, False), (2, True)])
def test_fast_a_group_using_a_shared_span_in_place_holds_back_the_other_spans_of_its_copy(
        monkeypatch, max_inflight, g_moves_its_own):
    """Group g's save is a storage f saved too (moved once, with f's copy); backward reaches g
    while that copy is in flight and uses the span in place, letting f's copy go: f's other
    sources, which f will reload, must stay held until the copy stream has read them."""
    watched = _CopiesWatched(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)

    def g_of(h2):
        return (h2.cos() * 3).exp() if g_moves_its_own else h2.cos()  # (cos saves h2: f's storage)

    expected = torch.autograd.grad((g_of((x * 2).exp().tanh()) * 1).sum(), x)[0]
    off = watched.offloader(max_inflight=max_inflight)
    with off.group("f"):
        h1 = (x * 2).exp()  # saves h1
        h2 = h1.tanh()  # saves h2
    with off.group("g"):
        z = g_of(h2)
    with off.group("h"):
        z = z * 1
    del h1, h2
    got = torch.autograd.grad(z.sum(), x)[0]
    assert off.stats()["copies"]["reused_in_flight_groups"] >= 1  # the path under test ran
    assert watched.unsafe == []
    assert torch.equal(got, expected)


def test_fast_a_source_freed_in_flight_and_reached_in_flight_raises(monkeypatch):
    """The caller frees a saved storage while its copy is in flight and never refills it;
    backward reaches the group before the copy was let go (four groups may stay in flight):
    the host copy may hold bytes of other work, so backward raises rather than restore it."""
    _CopiesWatched(monkeypatch)
    moves = _MovesOut(monkeypatch)
    x = torch.randn(16, 32, requires_grad=True)
    off = off_for("fast", "cpu", keep_last=0, max_inflight=4, pack_below=0)
    with off.group("a"):
        h = (x * 2).exp()
        y = h.sin()
    h.untyped_storage().resize_(0)  # while a's copy is in flight
    with off.group("b"):
        z = y * y
    assert not any(m.caller_freed for m in moves.of())  # not let go yet
    for m in moves.of("a"):
        m.host.fill_(255)  # what a copy racing other work for the memory could have read
    with pytest.raises(RuntimeError, match=r"group 'a' was freed \(resize_\(0\)\) while its copy"):
        torch.autograd.grad(z.cos().sum(), x)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("refilled", ["before_the_group", "between_its_nodes"])
def test_fast_a_source_freed_in_flight_and_refilled_in_backward_before_it_is_read(monkeypatch, prefetch, refilled):
    """The caller frees a saved storage while its copy is in flight and refills it in backward,
    in a hook that runs before the node that reads it (as FSDP unshards before a module's
    backward): the group was touched before (prefetched, or another of its saves unpacked),
    yet the span comes from the refilled storage, as autograd would take it, never from the
    untrusted host copy, and nothing raises."""
    _CopiesWatched(monkeypatch)
    moves = _MovesOut(monkeypatch)
    x = torch.randn(16, 32, requires_grad=True)

    def run(off):
        with _group(off, "a"):
            h = (x * 2).exp()  # saves h
            u = h.sin()  # saves h
            if refilled == "between_its_nodes":
                u = (u * 3).exp()  # saves its output: a's first unpack in backward, before h's
        keep, n = h.detach().clone(), h.untyped_storage().nbytes()
        h.untyped_storage().resize_(0)  # while a's copy is in flight

        def refill(*_):
            h.untyped_storage().resize_(n)
            h.untyped_storage().copy_(keep.untyped_storage())

        if refilled == "before_the_group":
            u.register_hook(refill)  # on a's output: before any of a's nodes (and after its prefetch)
        else:  # after the last exp's backward, before sin's reads h
            u.grad_fn.next_functions[0][0].register_hook(refill)
        with _group(off, "b"):
            z = (u * 2).sin()
        with _group(off, "c"):
            out = z.cos()
        for m in moves.of("a"):
            m.host.fill_(255)  # what a copy racing other work for the memory could have read
        return torch.autograd.grad(out.sum(), x)[0]

    expected = run(None)
    off = off_for("fast", "cpu", keep_last=0, max_inflight=4, pack_below=0, prefetch=prefetch)
    assert torch.equal(run(off), expected)


def test_fast_a_reload_backward_never_used_is_freed_after_its_copy(monkeypatch):
    """Backward stops short of a group it reloaded ahead (``autograd.grad`` to an activation
    past it): once the graph lets the group go, its reload buffers are freed, and their copies
    in may still be writing them: the compute stream first waits for each, so their memory
    goes to later work only after the copy."""
    watched = _CopiesWatched(monkeypatch)
    moves = _MovesOut(monkeypatch)
    x = torch.randn(64, 64, requires_grad=True)
    off = off_for("fast", "cpu", keep_last=0, max_inflight=1, pack_below=0, prefetch=1)
    with off.group("a"):
        mid = (x * 2).exp().tanh()  # a saves exp's and tanh's outputs
    with off.group("b"):
        y = mid.sin().exp()
    with off.group("c"):
        out = y.cos()
    torch.autograd.grad(out.sum(), mid)  # stops at mid: a's nodes never run
    a = moves.of("a")
    reloaded = [m.ready for m in a if m.dev is not None]
    assert reloaded, "a was reloaded ahead (the path under test)"
    del mid, y, out
    gc.collect()
    assert all(id(ready) in watched.waited for ready in reloaded)


def test_fast_an_observer_that_raises_on_a_copy_leaves_the_copy_in_the_offloaders_keeping(monkeypatch):
    """An observer's ``on_copy`` that raises hears of the copy only once its sources are held
    until it is done: the error reaches the caller, and the copy is still in flight with its
    sources, not let go with the failed graph while it runs."""
    from actoffload.fast.offloader import FastOffloader

    watched = _CopiesWatched(monkeypatch)
    monkeypatch.setattr(FastOffloader, "_timing_event", lambda self: object())  # as on CUDA, timed
    moves = _MovesOut(monkeypatch)

    class Raising(ao.Observer):
        def on_copy(self, direction, nbytes, start, end):
            raise RuntimeError("observer failed")

    class Listening(ao.Observer):
        heard: list = []

        def on_copy(self, direction, nbytes, start, end):
            self.heard.append(direction)

    x = torch.randn(64, 64, requires_grad=True)
    off = off_for("fast", "cpu", keep_last=0, max_inflight=1, pack_below=0)
    off.add_observer(Raising())
    listening = Listening()
    off.add_observer(listening)  # the other observers still hear of the copy
    with pytest.raises(RuntimeError, match="observer failed"):
        with off.group("a"):
            (x * 2).exp()
    gc.collect()  # the failed group's graph is gone
    (copy,) = {id(m.copied): m.copied for m in moves.of()}.values()
    held = any(entry[0] is copy for entry in off._inflight)
    assert held or id(copy.done) in watched.waited  # its sources still held, or let go after a wait
    assert watched.unsafe == [] and listening.heard == ["d2h"]


@pytest.mark.parametrize("owner_gone_first", [True, False])
def test_fast_a_shared_spans_reload_backward_never_used_is_freed_after_its_copy(monkeypatch, owner_gone_first):
    """Group b saves a storage group a saved (moved once, with a's copy); b's backward reloads
    it and stops before the node that reads it, maybe after a's graph is gone: once b goes,
    the reload is freed only after the compute stream waits for its copy in."""
    import weakref

    watched = _CopiesWatched(monkeypatch)
    moves = _MovesOut(monkeypatch)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    off = off_for("fast", "cpu", keep_last=0, max_inflight=0, pack_below=0, prefetch=1)
    with off.group("a"):
        h = (x * 2).exp()
    with off.group("b"):
        u = h.detach() * w  # saves h.detach(): a's span
        z = u.sin()
    with off.group("c"):
        out = z.cos()
    if owner_gone_first:
        h.sum().backward()  # a's graph: reached, used, let go
    del h
    gc.collect()
    (span,) = moves.of("a")
    torch.autograd.grad(out.sum(), u)  # the mul that reads the span never runs
    assert span.dev is not None, "reloaded and not used (the path under test)"
    ready, reload = span.ready, weakref.ref(span.dev)
    moves.clear()
    del span, u, z, out
    gc.collect()
    assert reload() is None and id(ready) in watched.waited


def test_fast_a_span_refilled_in_backward_stays_the_callers_once_its_copy_is_let_go(monkeypatch):
    """A storage freed while its copy is in flight, found so when backward first touches its
    group (a prefetch), refilled by a hook at the very same address before the group is
    reached, its copy finished meanwhile: letting the copy go then must not take the span
    from the caller's storage (it would raise as never refilled)."""
    from actoffload.fast.streams import CopyStreams

    _CopiesWatched(monkeypatch)
    finished = [False]

    class Event:
        def query(self):
            return finished[0]

        def synchronize(self):
            pass

    monkeypatch.setattr(CopyStreams, "record", lambda streams, stream=None: Event())
    moves = _MovesOut(monkeypatch)
    x = torch.randn(64, 64, requires_grad=True)

    def run(off):
        with _group(off, "a"):
            h = (x * 2).exp()
            u = h.sin()
        keep, n = h.detach().clone(), h.untyped_storage().nbytes()
        h.untyped_storage().resize_(0)  # while a's copy is in flight

        def refill(*_):
            h.untyped_storage().resize_(n)
            h.untyped_storage().copy_(keep.untyped_storage())
            for m in moves.of("a"):  # at the very same address, as the CUDA allocator often gives
                m.data_ptr_at_copy = m.storage.data_ptr()
            finished[0] = True  # and the copy out finished meanwhile

        u.register_hook(refill)  # after b's backward prefetched a, before a is reached
        with _group(off, "b"):
            z = u.sin() * 2
        with _group(off, "c"):
            out = z.cos()
        return torch.autograd.grad(out.sum(), x)[0]

    expected = run(None)
    finished[0] = False
    off = off_for("fast", "cpu", keep_last=0, max_inflight=4, pack_below=0, prefetch=1)
    assert torch.equal(run(off), expected)


def test_fast_a_view_used_in_place_comes_back_at_its_offset_in_a_second_backward(monkeypatch):
    """A span at a nonzero offset of its storage, used in place (its copy out still in flight),
    remembered as the reload for later uses: a second backward (retain_graph) must read it at
    its offset (it read the storage's first bytes)."""
    from actoffload.fast.streams import CopyStreams

    monkeypatch.setattr(CopyStreams, "record", lambda self, stream=None: _Pending())

    def run(off):
        torch.manual_seed(0)
        x = torch.randn(8, 64, requires_grad=True)
        with _group(off, "a"):
            base = x * 2
            y = base[4:].sin()  # sin saves a view at byte 4 * 64 * 4 of base, which lives on
        with _group(off, "b"):
            z = y * 1
        loss = z.sum()
        return [torch.autograd.grad(loss, x, retain_graph=True)[0], torch.autograd.grad(loss, x)[0], base]

    expected = run(None)
    off = off_for("fast", "cpu", keep_last=1, max_inflight=2)
    got = run(off)
    assert off.stats()["copies"]["reused_in_flight_groups"] == 1
    assert all(torch.equal(a, b) for a, b in zip(got[:2], expected[:2]))


# ---------------------------------------------------------------- many groups
def _many_groups(off, n: int, saves: bool) -> torch.Tensor:
    x = torch.randn(32, requires_grad=True)
    h = x * 1
    for i in range(n):
        with off.group(str(i)):
            h = h.sin() if saves else h * 1.0001  # sin saves h; a product with a number saves nothing
    return h


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["empty", "tiny"])
def test_many_groups_hold_a_bounded_amount_of_python_state_per_group(impl, case):
    """1,000 groups in one forward, empty or saving 128 bytes each (too few to move): no host
    memory, and per group at most a few objects the garbage collector tracks and a bounded
    number of bytes while the graph lives (before: 14 objects and 1.8 KiB for a tiny group,
    now 7 and 1.1-1.2 KiB; an empty group holds nothing once closed)."""
    import tracemalloc

    n = 1000
    off = off_for(impl, "cpu", min_offload_bytes=1 << 20)
    _many_groups(off, n, case == "tiny").sum().backward()  # a first step: whatever is made once
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        y = _many_groups(off, n, case == "tiny")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tracked = len(gc.get_objects()) - objects
    s = off.stats()
    # (a group that saved nothing is not listed: backward never unpacks one, so nothing would
    # tell the offloader that its step ended)
    assert s["host_bytes_in_use"] == 0 and s["offloaded_bytes"] == 0 and len(s["groups"]) == (n if case == "tiny" else 0)
    if impl == "fast":
        assert s["host_allocations"] == 0
    most_objects, most_bytes = (0, 64) if case == "empty" else (8, 1400)
    assert tracked <= most_objects * n + 10, tracked / n  # (+ the input and output of the chain)
    assert held <= most_bytes * n, held / n
    y.sum().backward()
    del y, s
    gc.collect()
    # what stays: the stats() entry of each group that saved something
    assert len(gc.get_objects()) - objects <= (n if case == "tiny" else 0) + 10


@pytest.mark.parametrize("impl", IMPLS)
def test_ten_thousand_groups_with_one_name_are_numbered_in_linear_time(impl):
    """Names repeat as name#2, name#3, ...: each is found from the last number given."""
    off = off_for(impl, "cpu", min_offload_bytes=1 << 20)
    x = torch.randn(4, requires_grad=True)
    h = x * 1
    for _ in range(10_000):
        with off.group("g"):
            h = h.sin()  # (saves h: a group that saved nothing is not listed)
    names = list(off.stats()["groups"])
    assert names[:3] == ["g", "g#2", "g#3"] and names[-1] == "g#10000" and len(names) == 10_000
    h.sum().backward()
