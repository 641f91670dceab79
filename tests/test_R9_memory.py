"""R9: after forward only what was kept stays resident; host memory is bounded and steady."""

import gc

import pytest
import torch

from actoffload.tools.saved_tracker import SavedTracker
from helpers import CUDA, IMPLS, maybe_group, mlp_stack, off_for, run_groups, train_steps


def _resident_saved_bytes(off, run):
    """Run a forward while recording every storage the offloader is handed; bytes still alive after."""
    with SavedTracker(off) as tracker:
        out = run()
    return out, tracker.resident_bytes()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keep_last", [0, 1])
def test_R9_resident_bytes_are_no_offload_minus_offloaded(impl, keep_last):
    model = mlp_stack(4, 64, "cpu")
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    x = torch.randn(32, 64, requires_grad=True)

    def forward(off):
        return run_groups(model, x.clone(), off)  # clone: the input is an activation too

    base_off = off_for(impl, "cpu", keep_last=keep_last, min_offload_bytes=1 << 40)  # moves nothing
    out, resident_none = _resident_saved_bytes(base_off, lambda: forward(base_off))
    del out
    off = off_for(impl, "cpu", keep_last=keep_last)
    out, resident = _resident_saved_bytes(off, lambda: forward(off))
    param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert len(params) == len(list(model.parameters()))
    offloaded = off.stats()["offloaded_bytes"]
    assert offloaded > 0
    expected = resident_none - offloaded
    assert abs(resident - expected) <= 0.01 * (resident_none - param_bytes) + 0, (resident, expected)
    out.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R9_host_memory_bounded_and_steady_across_steps(impl):
    model = mlp_stack(4, 64, "cpu")
    off = off_for(impl, "cpu", keep_last=1)
    peaks = [s["host_bytes_in_use"] + s["host_bytes_pooled"] for s in train_steps(off, model, 5, "cpu")]
    assert max(peaks[1:]) <= peaks[0]


TINY = {
    "one 4-byte tensor": lambda x: [(x[:1] * 2).exp()],
    "1000 one-float tensors": lambda x: [(x[:1] * (i + 1)).exp() for i in range(1000)],
    "one 1000-float tensor": lambda x: [(x * 2).exp()],
    "odd sizes": lambda x: [(x[:1] * 2).exp(), (x[:3] * 2).exp().half().exp(), (x[:5] * 2).double().exp(),
                            (x[:7] * 2).exp().to(torch.bfloat16).exp()],
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("case", "groups"), [(case, 1) for case in TINY] + [(case, 50) for case in TINY if "1000 one" not in case])
def test_R9_host_memory_bound_holds_for_tiny_tensors(impl, case, groups):
    """min_offload_bytes=0 moves tensors of a few bytes: host memory in use stays within 1.05x of
    what moved (fast's pool had a 64-byte minimum block and packed at 16-byte offsets: 16x for a
    4-byte tensor, 4x for 1000 one-float tensors), and the gradients are bitwise."""
    make = TINY[case]

    def run(off):
        torch.manual_seed(0)
        x = torch.randn(1000, requires_grad=True)
        h = x * 1
        outs = []
        for i in range(groups):
            with maybe_group(off, str(i)):
                outs += make(h)
                h = h * 1.5
        if off is not None:
            s = off.stats()
            assert s["offloaded_bytes"] > 0
            assert s["host_bytes_in_use"] <= 1.05 * s["offloaded_bytes"], (s["host_bytes_in_use"], s["offloaded_bytes"])
        sum(o.float().sum() for o in outs).backward()
        return x.grad

    expected = run(None)
    off = off_for(impl, "cpu", keep_last=0)
    assert torch.equal(run(off), expected)
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keep_last", [0, 1])
def test_R9_gpu_resident_bytes_match_within_one_percent(impl, keep_last):
    model = mlp_stack(6, 1024, "cuda")
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)

    def resident(off):
        torch.cuda.synchronize()
        gc.collect()
        before = torch.cuda.memory_allocated()
        y = run_groups(model, x.clone(), off)
        torch.cuda.synchronize()
        gc.collect()
        if off is not None:
            off.synchronize()
        return y, torch.cuda.memory_allocated() - before

    y, none = resident(None)
    del y
    off = off_for(impl, "cuda", keep_last=keep_last)
    y, got = resident(off)
    expected = none - off.stats()["offloaded_bytes"]
    assert abs(got - expected) <= 0.01 * none, (got, expected, none)
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keep_last", [0, 2])
def test_R5_R9_a_storage_saved_in_two_groups_moves_once(impl, keep_last):
    torch.manual_seed(0)
    lin0, lin1 = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    expected = _grads_of_two_groups(lin0, lin1, x, None)
    off = off_for(impl, "cpu", keep_last=keep_last)
    got = _grads_of_two_groups(lin0, lin1, x, off, extra_group=keep_last > 0)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert off.stats()["host_bytes_in_use"] == 0


def _grads_of_two_groups(lin0, lin1, x, off, extra_group=False):
    """relu at the end of group a saves its output h; the linear opening group b saves h as
    its input: one storage, two groups. Checks R9 right after forward when offloading."""
    from helpers import maybe_group

    with maybe_group(off, "a"):
        h = torch.relu(lin0(x * 1))  # x * 1 and h are saved here
    with maybe_group(off, "b"):
        y = lin1(h)  # and h again here
    if extra_group:  # keep_last=2: a and b commit only once two groups opened after each
        for name in ("c", "d", "e"):
            with maybe_group(off, name):
                y = y * 1
    if off is not None:
        s = off.stats()
        moved = 2 * 64 * 256 * 4  # x * 1 and h, once each
        assert s["groups"]["a"]["offloaded_bytes"] + s["groups"]["b"]["offloaded_bytes"] == moved
        assert s["groups"]["b"]["offloaded_bytes"] == 0 and s["groups"]["b"]["kept"]["alias"] == 1
        assert s["host_bytes_in_use"] <= 1.05 * moved
    for p in (*lin0.parameters(), *lin1.parameters(), x):
        p.grad = None
    y.sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in (*lin0.parameters(), *lin1.parameters())]


@pytest.mark.parametrize("impl", IMPLS)
def test_R5_R6_a_storage_written_between_two_groups_saves_is_moved_again(impl):
    """Group a moved h; h is written in place; group b saves the new h: b must not get a's copy.
    (a's backward then raises R6, as PyTorch would: h changed after a saved it.)"""
    off = off_for(impl, "cpu", keep_last=0)
    x = torch.randn(32, 64, requires_grad=True)
    with off.group("a"):
        h = (x * 2).exp()  # exp saves its output h
    with torch.no_grad():
        h.add_(1)
    with off.group("b"):
        y = h.sin()  # sin saves its input h (new values)
    s = off.stats()
    assert s["groups"]["b"]["offloaded"] == 1 and "alias" not in s["groups"]["b"]["kept"]
    (g,) = torch.autograd.grad(y.sum(), h, retain_graph=True)
    assert torch.equal(g, h.detach().cos())  # b's saved h is the written one
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.sum().backward()
