"""fast's warm-up (``warmup="recompute"``, the default on CUDA): wrapped modules recompute while the host blocks of
later steps are pinned on a background thread; then groups offload as usual. Every step is bitwise equal to no
offloading (R1), R6 holds while recomputing, and once warm no host memory is allocated."""

import contextlib
import gc
import threading

import pytest
import torch

import actoffload as ao
from actoffload.hostmem import exact_host_allocator
from helpers import CUDA, DEVICES, assert_bitwise, deterministic, residual_step

D, H = 64, 256


def _warming(**settings):
    """A CPU fast offloader that warms up by recomputing (``settings`` override the rest)."""
    return ao.Offloader(**{"impl": "fast", "device": "cpu", "min_offload_bytes": 0, "keep_last": 0,
                           "warmup": "recompute", **settings})


@contextlib.contextmanager
def _recomputed_by(off, module):
    """``module`` wrapped by ``off`` for the block (as it is where ``off`` is ``None``), which
    must have recomputed it."""
    handle = ao.wrap(module, off) if off is not None else None
    yield
    if handle is not None:
        assert off.stats()["groups"]["0"].get("recomputed")
        handle.remove()


def _blocks(device="cpu", norm=False, d=D, h=H):
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(d, h), *([torch.nn.BatchNorm1d(h)] if norm else []), torch.nn.GELU(),
                            torch.nn.Linear(h, d))
        for _ in range(4)).to(device)


def _step(blocks, step, device="cpu", by_hand=None, rows=32):
    """One step's gradients; with ``by_hand`` (an offloader) each block is a group opened by hand."""
    return residual_step(blocks, step, rows, device, by_hand)


class _Gate:
    """A host allocator whose allocations off the main thread (the pool's reservations) wait
    until the gate opens."""

    def __init__(self):
        self.open = threading.Event()
        self.background = 0

    def __call__(self, nbytes, pinned):
        if threading.current_thread() is not threading.main_thread():
            self.open.wait(timeout=30)
            self.background += 1
        return exact_host_allocator(nbytes, pinned)


def test_warmup_recomputes_wrapped_modules_until_their_blocks_are_pinned_then_offloads():
    blocks = _blocks()
    expected = [_step(blocks, s) for s in range(4)]
    gate = _Gate()
    off = _warming(host_allocator=gate)
    with ao.wrap(blocks, off):
        assert_bitwise(_step(blocks, 0), expected[0])
        s = off.stats()
        assert s["warmup"]["warming_up"] and s["warmup"]["pinning_bytes"] > 0
        assert all(g.get("recomputed") for g in s["groups"].values())
        # only each block's input was saved (by checkpoint) and moved
        assert all(g["offloaded"] == 1 and g["offloaded_bytes"] == 32 * D * 4 for g in s["groups"].values())
        assert_bitwise(_step(blocks, 1), expected[1])  # still pinning: still recomputing
        assert off.stats()["warmup"]["steps"] == 2
        assert all(g.get("recomputed") for g in off.stats()["groups"].values())
        gate.open.set()
        off._pool.wait_reserved()
        allocations = off.stats()["host_allocations"]
        assert_bitwise(_step(blocks, 2), expected[2])
        s = off.stats()
        assert not s["warmup"]["warming_up"] and not any(g.get("recomputed") for g in s["groups"].values())
        # the blocks the first step reserved are exactly those offloading asks for
        assert s["host_allocations"] == allocations and gate.background > 0
    ref = ao.Offloader(impl="ref", device="cpu", min_offload_bytes=0, keep_last=0)
    with ao.wrap(blocks, ref):
        _step(blocks, 2)
    assert s["groups"] == ref.stats()["groups"]


@pytest.mark.parametrize("keep_last", [1, 4])
def test_warmup_ends_when_the_groups_it_recomputes_are_the_ones_kept_last(keep_last):
    """Groups that keep_last leaves on the device are never committed, so nothing is
    reserved for them: the warm-up ends at the next step."""
    blocks = _blocks()
    off = _warming(keep_last=keep_last)
    with ao.wrap(blocks[3] if keep_last == 1 else blocks, off):
        for s in range(6):
            _step(blocks, s)
            off._pool.wait_reserved()
    assert not off.stats()["warmup"]["warming_up"] and off.stats()["warmup"]["steps"] == 1


def test_warmup_reserves_what_offloading_holds_at_once_not_per_forward():
    """Forwards before the first backward (or ones that raised) expect blocks only while their
    groups live, and a storage two groups save is reserved once (R5): the pool ends about
    where offloading from the first step leaves it (plus the blocks the inputs moved in)."""
    pooled = {}
    for warmup in ("offload", "recompute"):
        blocks = _blocks()
        off = _warming(warmup=warmup)
        with ao.wrap(blocks, off):
            for s in range(5):  # forwards whose graphs die unused
                x = torch.randn(32, D, requires_grad=True)
                h = x * 1
                for b in blocks:
                    h = h + b(h)
                del h, x
            for s in range(4):
                _step(blocks, s)
                off._pool.wait_reserved()
        pooled[warmup] = off.stats()["host_bytes_pooled"]
    inputs = 4 * 32 * D * 4
    assert pooled["offload"] <= pooled["recompute"] <= pooled["offload"] + inputs


def test_warmup_micro_batches_and_retain_graph_across_the_switch_to_offloading_are_bitwise():
    """Two micro-batches' forwards, then their backwards (one twice, retain_graph), while
    recomputing and again once offloading: every gradient as without an offloader."""

    def step(blocks, seed):
        xs = [torch.randn(16, D, generator=torch.Generator().manual_seed(seed + k), requires_grad=True)
              for k in range(2)]
        losses = []
        for x in xs:
            h = x * 1
            for b in blocks:
                h = h + b(h)
            losses.append(h.square().sum())
        losses[1].backward(retain_graph=True)
        losses[0].backward()
        losses[1].backward()
        grads = [x.grad.clone() for x in xs] + [p.grad.clone() for p in blocks.parameters()]
        for p in blocks.parameters():
            p.grad = None
        return grads

    blocks = _blocks()
    expected = [step(blocks, 10 * s) for s in range(3)]
    off = _warming(keep_last=1)
    with ao.wrap(blocks, off):
        for s in range(3):
            assert_bitwise(step(blocks, 10 * s), expected[s])
            recomputed = any(g.get("recomputed") for g in off.stats()["groups"].values())
            assert recomputed == (s == 0)
            off._pool.wait_reserved()  # the next step begins with everything pinned


def test_warmup_leaves_groups_opened_by_hand_to_offload_from_the_first_step():
    blocks = _blocks()
    expected = _step(blocks, 0)
    off = _warming()
    assert_bitwise(_step(blocks, 0, by_hand=off), expected)
    s = off.stats()
    assert s["offloaded_bytes"] > 0 and not any(g.get("recomputed") for g in s["groups"].values())
    _step(blocks, 1, by_hand=off)
    assert not off.stats()["warmup"]["warming_up"]  # nothing was recomputed, nothing to wait for


def test_warmup_does_not_recompute_a_module_that_updates_running_statistics():
    blocks = _blocks(norm=True)
    off = _warming()
    with ao.wrap(blocks, off):
        _step(blocks, 0)
        assert blocks[0][1].num_batches_tracked.item() == 1  # recomputing would have made it 2
        assert not any(g.get("recomputed") for g in off.stats()["groups"].values())
    blocks.eval()  # running statistics are only read: recomputing is exact
    off = _warming()
    with ao.wrap(blocks, off):
        _step(blocks, 0)
        assert all(g.get("recomputed") for g in off.stats()["groups"].values())


def test_warmup_recomputing_still_detects_a_saved_tensor_written_in_place_R6():
    """Checkpoint drops what the forward saved and recomputes it; a write to the original
    after its save would go unnoticed, where autograd raises without an offloader."""

    class Exp(torch.nn.Module):
        def forward(self, x):
            return x.exp()  # exp saves its output

    for off in (None, _warming()):
        module = Exp()
        with _recomputed_by(off, module):
            x = torch.randn(8, D, requires_grad=True)
            y = module(x * 1)
            y.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation|modified by an in-place operation"):
                y.sum().backward()


def test_warmup_recomputing_detects_a_write_through_any_view_of_a_save_R6():
    """A view the forward saved and dropped is still written through its base, handed back as
    an output: autograd notices, and so must the recomputed module (a view shares its base's
    version counter); temporaries the forward dropped whole are nothing to check."""

    class ExpThenView(torch.nn.Module):
        def forward(self, x):
            return x.exp().view(-1)[1:].view(-1).sin()  # exp saves its output; sin saves a view of it

    class SavesAView(torch.nn.Module):
        def forward(self, x):
            e = x * 2  # saves nothing of its own output
            return e, e.view(-1).sin()  # sin saves a view of e, which is dropped; e is handed back

    for make in (ExpThenView, SavesAView):
        for off in (None, _warming()):
            module = make()
            with _recomputed_by(off, module):
                x = torch.randn(8, D, requires_grad=True)
                if make is SavesAView:
                    e, y = module(x * 1)
                    e[3:].mul_(2)  # through a view of the base of what sin saved
                    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified by an in-place"):
                        y.sum().backward()
                else:
                    module(x * 1).sum().backward()  # its temporaries are gone: nothing to write through


def test_warmup_recomputing_checks_a_tensor_saved_twice_R6():
    """A tensor saved twice: a write between the two saves raises as autograd raises (the
    first save's version is stale), and so does one after both."""

    class SavesTwice(torch.nn.Module):
        def __init__(self, write_between: bool):
            super().__init__()
            self.write_between = write_between

        def forward(self, x):
            e = x * 2
            a = e.sin()  # saves e
            if self.write_between:
                e.mul_(3)
            return a + e.cos(), e  # cos saves e again; e is handed back

    for write_between in (True, False):
        for off in (None, _warming()):
            module = SavesTwice(write_between)
            with _recomputed_by(off, module):
                y, e = module(torch.randn(8, D, requires_grad=True) * 1)
                if not write_between:
                    e.add_(1)
                with pytest.raises(RuntimeError, match="modified by an inplace operation|modified by an in-place"):
                    y.sum().backward()


def test_warmup_checks_R6_before_recomputing_not_after():
    """A forward that writes a buffer and saves it writes it again when recomputed: only a
    write between the forward and the recomputation is the user's (none here)."""

    class Staged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(8, D))
            self.w = torch.nn.Parameter(torch.randn(D))

        def forward(self, x):
            self.buf.copy_(x.detach())
            return (x * self.w * self.buf).exp()  # mul saves buf; exp's output is unpacked first

    grads = []
    for off in (None, _warming()):
        torch.manual_seed(0)
        m = Staged()
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with ao.wrap(m, off) if off is not None else contextlib.nullcontext():
            m(x * 1).sum().backward()
        grads.append([x.grad, m.w.grad])
    assert_bitwise(grads[1], grads[0])


def test_warmup_recomputes_a_module_that_saves_a_sparse_tensor():
    class SparseMM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(D, D)

        def forward(self, x):
            return torch.sparse.mm(torch.eye(x.shape[0]).to_sparse(), self.fc(x))  # saves the sparse matrix

    m = SparseMM()
    off = _warming()
    with ao.wrap(m, off):
        m(torch.randn(8, D, requires_grad=True) * 1).sum().backward()
    assert off.stats()["groups"]["0"].get("recomputed")


def test_warmup_recomputing_a_module_that_saves_a_nested_tensor_says_what_to_do():
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(D, D)

        def forward(self, x):
            nt = torch.nested.nested_tensor(list(x.detach().split([1, x.shape[0] - 1])))
            return x + torch.nested.to_padded_tensor(self.fc(nt), 0.0).sum() * 1e-3  # fc saves nt

    module = Nested()
    off = _warming()
    with ao.wrap(module, off), pytest.raises(RuntimeError, match="nested tensor.*warmup='offload'"):
        module(torch.randn(4, D, requires_grad=True) * 1)
    off = _warming(warmup="offload")
    with ao.wrap(module, off):
        module(torch.randn(4, D, requires_grad=True) * 1).sum().backward()


def test_warmup_that_cannot_reserve_host_memory_ends_and_the_commit_says_why_R10():
    blocks = _blocks()
    inputs = 4 * 32 * D * 4  # what the first step moves: each block's input
    off = _warming(host_budget=2 * inputs)
    with ao.wrap(blocks, off):
        _step(blocks, 0)
        off._pool.wait_reserved()
        s = off.stats()["warmup"]
        assert "host budget" in s["error"]
        with pytest.raises(ao.HostMemoryError, match="host budget"):
            _step(blocks, 1)  # offloading now, and short of host memory: the commit raises (R10)
        assert not off.stats()["warmup"]["warming_up"]


@pytest.mark.parametrize("device", DEVICES)
def test_warmup_by_default_recomputes_on_cuda_only(device):
    """Only CUDA pins host memory: there a fresh offloader recomputes while it pins; on the CPU,
    and with a memory budget (whose first steps profile by recomputing), it offloads at once."""
    off = ao.Offloader(impl="fast", device=device)
    expected = "recompute" if device == "cuda" else "offload"
    assert off.settings["warmup"] == expected and off.stats()["warmup"]["warming_up"] == (device == "cuda")
    assert ao.Offloader(impl="fast", device=device, warmup="recompute").stats()["warmup"]["warming_up"]
    assert not ao.Offloader(impl="fast", device=device, warmup="offload").stats()["warmup"]["warming_up"]
    assert ao.Offloader(impl="fast", device=device, memory_budget="1TiB").settings["warmup"] == "offload"


def test_warmup_setting_is_checked_before_any_work():
    with pytest.raises(ValueError, match="warmup"):
        ao.Offloader(impl="fast", device="cpu", warmup="later")
    with pytest.raises(ValueError, match="memory_budget"):
        ao.Offloader(impl="fast", device="cpu", warmup="recompute", memory_budget="1GiB")
    with pytest.raises(TypeError, match="fast"):
        ao.Offloader(impl="ref", device="cpu", warmup="recompute")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")
def test_warmup_on_cuda_is_bitwise_and_holds_no_more_device_memory_than_offloading():
    """The warm-up's steps recompute with inputs moved out: their peak is at most that of the
    steps that offload (prefetch and copies in flight hold more), and the gradients match."""
    with deterministic():
        blocks = _blocks("cuda", d=512, h=2048)
        expected = [_step(blocks, s, "cuda", rows=2048) for s in range(8)]
        off = ao.Offloader(impl="fast", device="cuda", min_offload_bytes=0, warmup="recompute")
        peaks, recomputed = [], []
        with ao.wrap(blocks, off):
            for s in range(8):
                if s == 3:
                    off._pool.wait_reserved()
                gc.collect()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                assert_bitwise(_step(blocks, s, "cuda", rows=2048), expected[s])
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
                recomputed.append(any(g.get("recomputed") for g in off.stats()["groups"].values()))
        assert recomputed[0] and not any(recomputed[4:])
        # (a first recomputation in backward may allocate cuBLAS's workspace on that thread)
        slack = 4 << 20
        assert max(p for p, r in zip(peaks, recomputed) if r) <= max(p for p, r in zip(peaks, recomputed) if not r) + slack
