"""fast with a memory_budget: profile, plan, run the plan; every action bitwise equal to no
offloading (CPU: memory is the bytes the groups save; the measured peak is CUDA's)."""

import contextlib
import gc

import pytest
import torch

import actoffload as ao
from actoffload import compat
from actoffload.budget import costmodel
from actoffload.budget.controller import PROFILE_STEPS, State
from actoffload.budget.probe import Probe
from actoffload.budget.workloads import RECENT
from helpers import assert_bitwise, residual_step

D, H = 256, 1024


def _blocks():
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D)) for _ in range(4))


def _steps(blocks, off, steps=PROFILE_STEPS + 2, rows=64):
    """Gradients of each step; ``off`` wraps the blocks (a plan may recompute them)."""
    handle = ao.wrap(blocks, off) if off is not None else None
    out, plans = [], []
    for step in range(steps):
        out.append(_step(blocks, step, rows))
        if off is not None:
            plans.append(off.stats()["plan"])
    if handle is not None:
        handle.remove()
    return out, plans


def _step(blocks, step, rows=64):
    return residual_step(blocks, step, rows)


GROUP_BYTES = 64 * (D + H) * 4 + 64 * H * 4  # fc1's input, GELU's input, fc2's input (fp32)


@pytest.mark.parametrize("budget", [8 * GROUP_BYTES, 3 * GROUP_BYTES, 2 * GROUP_BYTES, GROUP_BYTES + 4096])
def test_budget_plans_fit_and_gradients_are_bitwise(budget):
    expected, _ = _steps(_blocks(), None)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=budget, min_offload_bytes=0)
    got, plans = _steps(_blocks(), off)
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    states = [p["state"] for p in plans]
    assert states == ["profiling"] * PROFILE_STEPS + ["settled"] * 2  # profiled, then planned (on the CPU nothing is left to measure)
    assert all(p["predicted_peak_bytes"] <= budget for p in plans[PROFILE_STEPS:])
    actions = [g["action"] for g in plans[-1]["groups"]]
    if budget >= 8 * GROUP_BYTES:
        assert actions == ["keep"] * 4  # everything fits: nothing moves
        # and only the first group keeps its hooks (a new workload shows in its bytes)
        assert list(off.stats()["groups"]) == ["0"]
    else:
        assert actions != ["keep"] * 4
    assert set(plans[-1]) >= {"memory_budget", "groups", "max_inflight", "prefetch", "predicted_peak_bytes",
                              "predicted_step_s", "measured_peak_bytes", "measured_step_s"}


def _cut_short(blocks, bad_at):
    """A model's forward handed a bad input at block ``bad_at`` (what it computed goes with its frame)."""
    h = torch.randn(64, D) * 1
    for i, b in enumerate(blocks):
        h = h + b(h if i != bad_at else h[:, :10])


@pytest.mark.parametrize("bad_at", [2, 3])  # a group the plan moves; the last, which it keeps without hooks
def test_budget_a_forward_an_exception_cut_short_leaves_the_next_one_its_plan(bad_at):
    """A forward cut short by an exception (a bad batch skipped, a retry: R8): the next forward
    is the step's again, from its first group, on the plan it had (not the plan's later groups,
    one position per group the cut-short forward opened), and the step after it too; gradients
    bitwise. So in a group the plan keeps without hooks."""
    blocks, expected = _blocks(), _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            assert_bitwise(_step(blocks, step), _step(expected, step))
        settled, listed = off.stats()["plan"], list(off.stats()["groups"])
        assert settled["state"] == "settled" and len(settled["groups"]) == 4
        # (which groups move and how depends on the host's times; the last is kept, without hooks)
        assert [g["action"] == "keep" for g in settled["groups"]][2:] == [False, True]
        for failures in range(1, 3):  # once, then twice in a row
            for _ in range(failures):
                with pytest.raises(RuntimeError, match="cannot be multiplied"):
                    _cut_short(blocks, bad_at)
            for step in range(2):
                assert_bitwise(_step(blocks, step), _step(expected, step))
                plan = off.stats()["plan"]
                assert plan["state"] == "settled" and plan["groups"] == settled["groups"]
                assert list(off.stats()["groups"]) == listed == ["0", "1", "2"]  # the kept last group has no hooks


@pytest.mark.parametrize("bad_at", [0, 2])
def test_budget_a_batch_that_raises_every_other_step_leaves_the_plan_settled(bad_at):
    """Bad batches skipped every other step, more often than the workload's recent steps (RECENT)
    can outvote: the groups a cut-short forward opened are not counted as its workload's (counted,
    half the recent steps opening fewer groups made the workload expect that many, and each
    good step began a new workload, profiling for good); gradients bitwise."""
    blocks, expected = _blocks(), _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            assert_bitwise(_step(blocks, step), _step(expected, step))
        settled = off.stats()["plan"]
        assert settled["state"] == "settled"
        kept = []
        for step in range(2 * RECENT):
            with pytest.raises(RuntimeError, match="cannot be multiplied"):
                _cut_short(blocks, bad_at)
            assert_bitwise(_step(blocks, step), _step(expected, step))
            plan = off.stats()["plan"]
            assert plan["state"] == "settled" and plan["groups"] == settled["groups"], step
            assert plan["workload"]["groups"] == 4
            kept.append(plan["workload"]["kept"])
        # (a bad batch raising in the first group shows that group its own signature: a workload
        # of its own, kept beside the good batches' one)
        assert kept == [1 if bad_at else 2] * len(kept)


@pytest.mark.parametrize("budget", [3 * GROUP_BYTES, 8 * GROUP_BYTES])  # groups moved; everything kept
@pytest.mark.parametrize("let_go", ["skipped", "evaluated", "skipped, then evaluated under no_grad"])
def test_budget_a_forward_let_go_without_a_backward_pass_leaves_the_next_one_its_plan(budget, let_go):
    """A batch skipped after its forward (``del loss``), or an evaluation with gradients on (in
    ``eval()``, its loss read and dropped): the next forward begins a step of its own (R8), on
    the plan it had, where it would otherwise run as a second forward of that step, see twice
    its groups and re-plan; gradients bitwise. Where that next forward is an evaluation under
    ``no_grad`` (no step's), the training forward after it says the step's workload."""
    blocks, expected = _blocks(), _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=budget, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            assert_bitwise(_step(blocks, step), _step(expected, step))
        settled = off.stats()["plan"]
        assert settled["state"] == "settled" and len(settled["groups"]) == 4
        for _ in range(2):
            if let_go == "evaluated":
                blocks.eval()
            h = torch.randn(64, D, requires_grad=True) * 1
            for b in blocks:
                h = h + b(h)
            loss = h.square().mean()
            if let_go == "evaluated":
                loss.item()
                blocks.train()
            del h, loss
            if let_go.endswith("no_grad"):
                with torch.no_grad():
                    h = torch.randn(64, D)
                    for b in blocks:
                        h = h + b(h)
            for step in range(2):
                assert_bitwise(_step(blocks, step), _step(expected, step))
                plan = off.stats()["plan"]
                assert plan["state"] == "settled" and plan["groups"] == settled["groups"], plan["state"]


@pytest.mark.parametrize("budget", [3 * GROUP_BYTES, 8 * GROUP_BYTES])
def test_budget_a_micro_batch_skipped_in_accumulation_leaves_the_plan_settled(budget):
    """Gradient accumulation, a backward per micro-batch, the third of four skipped after its
    forward at every optimizer step: each skipped forward is a step cut short (R8), and the plan
    stays settled (it re-planned at every optimizer step, each skipped forward run as a second
    forward of the next micro-batch's step); gradients bitwise."""
    blocks, expected = _blocks(), _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=budget, min_offload_bytes=0)

    def optimizer_step(bs, seed, skips):
        for m in range(4):
            h = torch.randn(64, D, generator=torch.Generator().manual_seed(10 * seed + m)) * 1
            for b in bs:
                h = h + b(h)
            loss = h.square().sum()
            if m == 2:
                if skips:
                    del loss  # skipped
                continue
            loss.backward()
        grads = [p.grad.clone() for p in bs.parameters()]
        for p in bs.parameters():
            p.grad = None
        return grads

    with ao.wrap(blocks, off):
        for seed in range(4):
            assert_bitwise(optimizer_step(blocks, seed, True), optimizer_step(expected, seed, False))
            assert off.stats()["plan"]["state"] == "settled", (seed, off.stats()["plan"]["state"])


@pytest.mark.parametrize("budget", [3 * GROUP_BYTES, 1 << 40])  # the first group moved; everything kept
def test_budget_a_forward_let_go_frees_what_its_groups_saved(budget):
    """What a forward let go without a backward pass saved is freed with its graph (R8), an
    op's output a group keeps whole included: held as itself, it closed a cycle through the
    autograd node saving it, which Python's collector cannot see, and the forward lived on."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Softmax(-1), torch.nn.Linear(D, D))
                                 for _ in range(4))
    outputs = []  # each softmax's output's storage (its node saves the output), weakly
    for b in blocks:
        b[1].register_forward_hook(lambda m, args, out: outputs.append(compat.storage_weakref(out)))
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=budget, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 2):
            _step(blocks, step)
        assert off.stats()["plan"]["state"] == "settled"
        outputs.clear()
        h = torch.randn(64, D, requires_grad=True) * 1
        for b in blocks:
            h = h + b(h)
        assert len(outputs) == 4 and not outputs[-1].expired()  # (the last group keeps it)
        del h
        assert [r.expired() for r in outputs] == [True] * 4


@pytest.mark.parametrize("cut_at", range(PROFILE_STEPS))
def test_budget_a_profiling_step_cut_short_is_measured_again(cut_at):
    """A profiling step whose forward an exception cut short measured part of a step: dropped
    (as a step whose backward raised), and its workload profiled on whole steps."""
    blocks, expected, states = _blocks(), _blocks(), []
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 2):
            if step == cut_at:
                with pytest.raises(RuntimeError, match="cannot be multiplied"):
                    _cut_short(blocks, 2)
            assert_bitwise(_step(blocks, step), _step(expected, step))
            states.append(off.stats()["plan"]["state"])
    assert states == ["profiling"] * PROFILE_STEPS + ["settled"] * 2
    assert len(off.plan.controller.profile.groups) == 4 and off.stats()["plan"]["workload"]["kept"] == 1


@pytest.mark.parametrize("shared", [False, True])  # (True: one block at every position, so every group is named "0")
def test_budget_an_exception_a_forward_catches_itself_goes_on_with_its_step(shared):
    """A fallback inside the model's forward (a group raises, the forward catches the exception
    and goes on, its first module called again): the same step, each group at its own position
    of the plan, which settles and stays within the budget, every group listed; bitwise."""
    def model():
        bs = _blocks()
        return torch.nn.ModuleList([bs[0]] * 4) if shared else bs

    blocks, expected = model(), model()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)

    def step(bs, seed, by_hand=None):
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        h = x * 1
        for i, b in enumerate(bs):
            if i == 2:
                try:
                    with by_hand.group("fallback") if by_hand is not None else contextlib.nullcontext():
                        torch.nn.functional.gelu(h).square().sum()
                        raise RuntimeError("not supported here: fall back")
                except RuntimeError:
                    h = h + bs[0](h)  # the first module again
            h = h + b(h)
        h.square().sum().backward()
        out = [x.grad] + [p.grad.clone() for p in bs.parameters()]
        for p in bs.parameters():
            p.grad = None
        return out

    with ao.wrap(blocks, off):
        plans = []
        for s in range(PROFILE_STEPS + 3):
            assert_bitwise(step(blocks, s, off), step(expected, s))
            plans.append(off.stats()["plan"])
        listed = off.stats()["groups"]
    assert [p["state"] for p in plans] == ["profiling"] * PROFILE_STEPS + ["settled"] * 3
    assert len(plans[-1]["groups"]) == 6  # one step: the four blocks, the fallback, the first block again
    assert all(p["groups"] == plans[-1]["groups"] and p["predicted_peak_bytes"] <= 3 * GROUP_BYTES
               for p in plans[PROFILE_STEPS:])
    moved = [name for name, g in listed.items() if g["offloaded_bytes"]]
    assert sum(g["offloaded_bytes"] for g in listed.values()) == off.stats()["offloaded_bytes"] > 0
    assert moved[0] == "0"  # listed from the first group on, those before the caught exception too


def test_budget_an_evaluation_forwards_exception_is_no_steps():
    """An exception in an evaluation forward (``no_grad``) between steps cuts no training step
    short: the profiling step before it stands, and the plan settles as without it."""
    blocks, expected, states = _blocks(), _blocks(), []
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 2):
            assert_bitwise(_step(blocks, step), _step(expected, step))
            states.append(off.stats()["plan"]["state"])
            if step == 0:
                with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be multiplied"):
                    _cut_short(blocks, 2)
    assert states == ["profiling"] * PROFILE_STEPS + ["settled"] * 2


def test_budget_a_host_budget_its_profiling_steps_exceed_keeps_what_does_not_fit():
    """R10 under a memory budget: profiling steps move every recomputed module's inputs and every
    other group whole, as far as host_budget has room; what does not fit stays on the device, and
    no HostMemoryError is raised, in the first step or later. The profile counts what stayed as
    movable still (a plan may move it where others move less); the plans keep within both budgets,
    gradients bitwise."""
    expected, _ = _steps(_blocks(), None, steps=PROFILE_STEPS + 3)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=2 * GROUP_BYTES, min_offload_bytes=0,
                       host_budget=4096)
    got, plans = _steps(_blocks(), off, steps=PROFILE_STEPS + 3)
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    c = off.plan.controller
    assert plans[-1]["state"] == "settled" and sum(g["offloaded_bytes"] for g in plans[-1]["groups"]) == 0
    assert sum(sum(g.spans) for g in c.profile.groups) > 0  # profiled as movable, though none moved


def test_budget_plans_within_the_host_budget():
    """A plan holds no more host memory than host_budget allows: one that moved more would raise
    HostMemoryError at every commit (the profiling steps' inputs fit; the plan after them would
    move a group's whole saves). Recomputing without moving fits both budgets."""
    expected, _ = _steps(_blocks(), None, steps=PROFILE_STEPS + 4)
    host = GROUP_BYTES  # the inputs of every block fit, a block's saves besides do not
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=2 * GROUP_BYTES, min_offload_bytes=0,
                       host_budget=host)
    got, plans = _steps(_blocks(), off, steps=PROFILE_STEPS + 4)  # raised HostMemoryError from the third step
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    moved = sum(g["offloaded_bytes"] for g in plans[-1]["groups"])
    assert 0 < moved <= host / 1.05 and plans[-1]["predicted_peak_bytes"] <= 2 * GROUP_BYTES
    # (the bound that spares the check where no plan comes near the host budget holds every plan)
    c = off.plan.controller
    assert max(costmodel.host_bytes(c.profile, p.groups) for p in c.plans) <= costmodel.most_host_bytes(c.profile)


def _forwards(blocks, seed, n):
    """The loss of ``n`` forwards over ``blocks`` before one backward (each its own input)."""
    loss = 0
    for k in range(n):
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(seed * 10 + k)).requires_grad_(True)
        h = x * 1
        for b in blocks:
            h = h + b(h)
        loss = loss + h.square().sum()
    return loss


@pytest.mark.parametrize("room, host", [("estimated", 2 * GROUP_BYTES), ("overestimated", 2 * GROUP_BYTES),
                                        ("estimated", 400_000)])
def test_budget_steps_past_their_plan_keep_within_the_host_budget(room, host, monkeypatch):
    """R10 with a memory budget: a step that opens more groups than its plan (here a second
    forward before the backward, every other step; R8: several forwards in flight) moves, in
    the groups past the plan, only what the host budget has room for, and the rest stays;
    where that room was overestimated (a pool's free blocks of other sizes), the group stays
    whole. So do the profiling steps of the two-forward steps' own workload, where the host
    budget (400,000 bytes: one forward's inputs, not two's) cannot hold all they move. Either
    way no HostMemoryError, host memory within its budget, and gradients bitwise equal to no
    offloading."""
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=2 * GROUP_BYTES, min_offload_bytes=0,
                       host_budget=host)
    if room == "overestimated":
        monkeypatch.setattr(off, "host_room", lambda: host)
    blocks, expected = _blocks(), _blocks()
    held = []
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 12):
            n = 1 + step % 2
            loss = _forwards(blocks, step, n)
            stats = off.stats()
            held.append(stats["host_bytes_in_use"] + stats["host_bytes_pooled"])
            loss.backward()
            _forwards(expected, step, n).backward()
            for a, b in zip(blocks.parameters(), expected.parameters()):
                assert_bitwise(a.grad, b.grad)
                a.grad = b.grad = None
    assert 0 < max(held) <= host


def test_budget_host_cap_reaches_every_workload_and_spares_plans_that_ran():
    """Each signature's controller gets the host cap; a plan that ran a step to its end had its host
    memory (the profiled plan, however close to the cap its bytes came)."""
    from actoffload.budget.workloads import Signature, Workloads

    w = Workloads(1 << 40, torch.device("cpu"))
    w.host_cap = 1234
    first = w.begin(Signature(((4, 64),), None))
    second = w.begin(Signature(((4, 32),), None))
    assert first is not second and first.host_cap == second.host_cap == 1234
    w.host_cap = 99
    assert first.host_cap == second.host_cap == 99

    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    _steps(_blocks(), off)
    c = off.plan.controller
    profiled = c.plans[-1]
    assert costmodel.host_bytes(c.profile, profiled.groups) > 0
    c._peaks[profiled.key] = c._peaks.get(profiled.key, 0)  # (it ran: its measured peak is known)
    c.host_cap = 0
    kept = c._within_host(c.plans)
    assert profiled in kept
    assert all(costmodel.host_bytes(c.profile, p.groups) == 0 for p in kept if p.key not in c._peaks)


def test_budget_recompute_runs_under_checkpoint_and_is_bitwise(monkeypatch):
    # a very slow bus makes recomputing the cheaper way to free memory
    monkeypatch.setattr(Probe, "bandwidth", lambda self: (1e6, 1e6))
    expected, _ = _steps(_blocks(), None)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=2 * GROUP_BYTES, min_offload_bytes=0)
    got, plans = _steps(_blocks(), off)
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    actions = [g["action"] for g in plans[-1]["groups"]]
    assert any(a.startswith("recompute") for a in actions), actions
    s = off.stats()["groups"]["0"]
    if actions[0] == "recompute":  # only its input (checkpoint's) is saved, and kept
        assert s["offloaded_bytes"] == 0 and s["saved"] <= 3


def test_budget_a_recomputed_group_lets_go_of_its_inputs_once_its_backward_is_done(monkeypatch):
    """As with checkpointing by hand: a recomputed module's input (kept by the plan) is freed
    when backward is past that module, not at the end of the backward pass; the model of the
    plan's peak counts it so (R9). With the collector off, a reference cycle shows."""
    from torch.multiprocessing.reductions import StorageWeakRef

    blocks = _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    _steps(blocks, off, steps=PROFILE_STEPS)
    _forced(off, ["recompute"] * len(blocks))
    handle = ao.wrap(blocks, off)
    gc.collect()
    gc.disable()
    try:
        inputs, alive = [], []
        h = torch.randn(64, D, requires_grad=True) * 1
        for i, b in enumerate(blocks):
            inputs.append(StorageWeakRef(h.untyped_storage()))
            h.register_hook(lambda grad, i=i: alive.append((i, [not r.expired() for r in inputs])))
            h = b(h)
        h.square().sum().backward()
    finally:
        gc.enable()
        handle.remove()
    assert [a["action"] for a in off.stats()["plan"]["groups"]] == ["recompute"] * 4
    # when the gradient of block i's input is made, that input and those after it are gone
    assert alive == [(i, [j < i for j in range(4)]) for i in (3, 2, 1, 0)]


class _Doubled(torch.nn.Module):
    """``gelu(fc(2 x))``: its recomputation saves ``2 x``, never ``x`` itself (as attention saves
    copies of its strided queries and keys); ``seen`` records, in backward between ``gelu``'s
    and ``fc``'s (which still holds what it saved), whether ``x``'s storage (``watch``) is
    still alive."""

    def __init__(self, seen):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.seen, self.watch = seen, None

    def forward(self, x):
        module = self

        class Look(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y):
                return y.view_as(y)

            @staticmethod
            def backward(ctx, grad):
                module.seen.append(not module.watch.expired())
                return grad

        return torch.nn.functional.gelu(Look.apply(self.fc(x * 2)))


@pytest.mark.parametrize("retain_graph", [False, True])
def test_budget_a_recomputed_group_lets_go_of_kept_inputs_once_recomputed(monkeypatch, retain_graph):
    """A recomputed group's kept inputs are freed once its recomputation is done where that
    does not save them again, as reloaded ones are (the plan's model was measured on those);
    a graph kept for another backward keeps them, and recomputes again bitwise."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen = []
    blocks = torch.nn.ModuleList(_Doubled(seen) for _ in range(2))
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)

    def step():
        for p in blocks.parameters():
            p.grad = None
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        h = x * 1
        for b in blocks:
            b.watch = StorageWeakRef(h.untyped_storage())
            h = b(h)
        loss = h.square().sum()
        loss.backward(retain_graph=retain_graph)
        if retain_graph:
            first = [p.grad.clone() for p in blocks.parameters()]
            for p in blocks.parameters():
                p.grad = None
            loss.backward()
            assert_bitwise([p.grad for p in blocks.parameters()], first)
        return [p.grad.clone() for p in blocks.parameters()]

    expected = step()
    with ao.wrap(blocks, off):
        for _ in range(PROFILE_STEPS):
            step()
        _forced(off, ["recompute", "recompute"], monkeypatch)
        seen.clear()
        assert_bitwise(step(), expected)
    assert [a["action"] for a in off.stats()["plan"]["groups"]] == ["recompute"] * 2
    # block 1's input is block 0's output, held by nothing else; block 0's is x * 1, the same
    # (the second backward keeps nothing: it lets go as the first would have)
    assert seen == ([True, True, False, False] if retain_graph else [False, False])


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.parametrize("leaf", [True, False])
def test_budget_two_backward_passes_through_one_recomputed_module(monkeypatch, leaf):
    """Each backward recomputes. A plan's kept inputs made by autograd are let go after the
    first (the plan's model counts them so): the second then asks for the graph to be kept,
    and recomputes bitwise where it is. A leaf input stays, as with checkpointing alone."""
    blocks = torch.nn.ModuleList([_TwoHeads()])
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)

    def step(retain_graph=False):
        blocks.zero_grad(set_to_none=True)
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        a, b = blocks[0](x if leaf else x + 1)  # an add saves nothing: plain PyTorch runs both
        a.square().sum().backward(retain_graph=retain_graph)
        b.square().sum().backward()
        return [t.clone() for t in [x.grad] + [p.grad for p in blocks.parameters()]]

    plain = step()
    with ao.wrap(blocks, off):
        for _ in range(PROFILE_STEPS):
            assert_bitwise(step(), plain)  # inputs moved out: reloaded again
        _forced(off, ["recompute"], monkeypatch)
        if leaf:
            assert_bitwise(step(), plain)
        else:
            with pytest.raises(RuntimeError, match="retain_graph=True"):
                step()
            assert_bitwise(step(retain_graph=True), plain)
    assert off.stats()["plan"]["groups"][0]["action"] == "recompute"


def test_budget_a_recomputed_groups_wrapper_subclass_input_is_let_go_as_a_plain_one(monkeypatch):
    """A tensor made of several buffers (R7) that autograd made: its buffers have no history of
    their own, and are let go after the recomputation all the same; gradients bitwise."""
    from torch.testing._internal.two_tensor import TwoTensor

    from actoffload.engine import Engine

    released, kept = [], []
    restore = Engine._restore

    def counting(self, group, s):
        had = s.tensor is not None
        out = restore(self, group, s)
        if had:
            (released if s.tensor is None else kept).append(s)
        return out

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(D))

        def forward(self, x):
            return torch.tanh(x * self.w).sin()

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Scaled() for _ in range(2))

    def step():
        blocks.zero_grad(set_to_none=True)
        x = torch.randn(16, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        h = x * TwoTensor(torch.ones(16, D), torch.full((16, D), 2.0))
        for b in blocks:
            h = b(h) + h
        h.square().sum().backward()
        return [x.grad.clone()] + [p.grad.a.clone() if isinstance(p.grad, TwoTensor) else p.grad.clone()
                                   for p in blocks.parameters()]

    plain = step()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for _ in range(PROFILE_STEPS):
            step()
        _forced(off, ["recompute", "recompute"], monkeypatch)
        monkeypatch.setattr(Engine, "_restore", counting)
        assert_bitwise(step(), plain)
    # all that stays is what checkpointing saves beside the inputs on some versions (torch
    # 2.11: an empty tensor of its own)
    assert released and all(s.tensor.numel() == 0 for s in kept)


def test_budget_no_plan_fits_raises_naming_the_smallest_reachable_peak():
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1024, min_offload_bytes=0)
    with pytest.raises(ValueError, match=r"no plan fits a memory budget of 1,024 bytes: the smallest reachable peak"):
        _steps(_blocks(), off, steps=PROFILE_STEPS + 1)


def test_budget_a_new_workload_gets_its_own_plan_and_the_old_one_keeps_its_own():
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)
    blocks = _blocks()
    _, plans = _steps(blocks, off, rows=64)
    first = [sum(g["spans"]) for g in plans[-1]["profile"]["groups"]]
    # another sequence length, twice the bytes: told by its inputs' shapes when its first group
    # opens; no predicted plan fits (the bound takes 4x the bytes), so it profiles at once
    _, plans = _steps(blocks, off, rows=128)
    assert [p["state"] for p in plans] == ["profiling"] * PROFILE_STEPS + ["settled"] * 2
    assert [sum(g["spans"]) for g in plans[-1]["profile"]["groups"]] == [2 * n for n in first]
    assert plans[-1]["predicted_peak_bytes"] <= 3 * GROUP_BYTES
    _, plans = _steps(blocks, off, rows=64, steps=2)  # back: its own plan, from its first group
    assert [p["state"] for p in plans] == ["settled"] * 2
    assert [sum(g["spans"]) for g in plans[-1]["profile"]["groups"]] == first


def test_budget_works_with_groups_opened_by_hand():
    """Groups opened with ``with off.group`` cannot be recomputed; they keep or offload."""
    blocks = _blocks()
    expected, _ = _steps(blocks, None)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=2 * GROUP_BYTES, min_offload_bytes=0)
    got = []
    for step in range(PROFILE_STEPS + 2):
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        h = x * 1
        for i, b in enumerate(blocks):
            with off.group(str(i)):
                h = h + b(h)
        h.square().sum().backward()
        got.append([x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()])
        for p in blocks.parameters():
            p.grad = None
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    actions = {g["action"] for g in off.stats()["plan"]["groups"]}
    assert actions <= {"keep", "offload"} and "offload" in actions


@pytest.mark.parametrize("bad", ["lots", -5, 0, 1.5])
def test_budget_bad_values_name_the_setting(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        ao.Offloader(impl="fast", device="cpu", memory_budget=bad)


@pytest.mark.parametrize("given, named", [({"max_inflight": 2}, "max_inflight=2 does not"),
                                          ({"prefetch": 0, "keep_last": 3}, "prefetch=0, keep_last=3 do not"),
                                          ({"max_inflight": 0}, "max_inflight=0 does not")])
def test_settings_a_budgets_plan_chooses_are_refused_other_than_their_defaults(given, named):
    """A budget's plan chooses the copy window and what stays step by step: given otherwise,
    they would be overruled without a word, so they are refused before any work."""
    with pytest.raises(ValueError, match=f"^{named} apply with a memory_budget: .* leave them at their defaults"):
        ao.Offloader(impl="fast", device="cpu", memory_budget="1GiB", **given)
    for same in ({"max_inflight": 1, "prefetch": 1}, {"keep_last": 0}, {"keep_last": 1}):
        ao.Offloader(impl="fast", device="cpu", memory_budget="1GiB", **same)


def test_a_budgets_settings_show_the_copy_window_its_plan_runs():
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    blocks = _blocks()
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            _step(blocks, step)
        from actoffload.budget.actions import Action, GroupDecision

        off.plan.controller.force([GroupDecision(Action.OFFLOAD)] * 3 + [GroupDecision(Action.KEEP)],
                                  max_inflight=2, prefetch=3)
        _step(blocks, PROFILE_STEPS + 1)
    plan = off.stats()["plan"]
    assert (plan["max_inflight"], plan["prefetch"]) == (2, 3)
    assert (off.settings["max_inflight"], off.settings["prefetch"], off.settings["keep_last"]) == (2, 3, 0)


def test_a_budgets_plan_reloads_whole_groups_ahead_as_its_model_counts_them():
    """Without a budget a group reloaded ahead brings half its bytes (the rest when backward
    reaches it); a plan's model counts the groups ahead whole, and the engine brings them so."""
    expected, _ = _steps(_blocks(), None, steps=PROFILE_STEPS + 2)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    from actoffload.budget.actions import Action, GroupDecision

    calls = []
    reload = off._reload

    def recording(group, share=1.0):
        left = reload(group, share)
        calls.append((group.name, share, len(left)))
        return left

    blocks = _blocks()
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS):
            _step(blocks, step)
        off.plan.controller.force([GroupDecision(Action.OFFLOAD)] * 3 + [GroupDecision(Action.KEEP)],
                                  max_inflight=1, prefetch=1)
        _step(blocks, PROFILE_STEPS)
        off._reload = recording
        got = _step(blocks, PROFILE_STEPS + 1)
    assert_bitwise(got, expected[PROFILE_STEPS + 1])
    ahead = [c for c in calls if c[0] in ("0", "1")]  # reached from 1 and 2; 2 reloaded when reached
    assert [c[1:] for c in ahead] == [(1.0, 0), (1.0, 0)], calls
    assert off.stats()["copies"]["prefetched_groups"] >= 2


def test_budget_is_a_setting_of_fast(monkeypatch):
    with pytest.raises(TypeError, match="memory_budget is a setting of the 'fast' implementation; impl 'ref' "
                                        "does not take it: pass impl='fast' or leave impl out"):
        ao.Offloader(impl="ref", device="cpu", memory_budget="1GiB")
    monkeypatch.setenv("OFFLOAD_IMPL", "ref")
    with pytest.raises(TypeError, match=r"\$OFFLOAD_IMPL is 'ref'; pass impl='fast' or unset OFFLOAD_IMPL"):
        ao.Offloader(device="cpu", memory_budget="1GiB")
    # another of fast's settings, which picks nothing: $OFFLOAD_IMPL named as what chose ref
    with pytest.raises(TypeError, match=r"\$OFFLOAD_IMPL is 'ref'; pass impl='fast' or set OFFLOAD_IMPL=fast"):
        ao.Offloader(device="cpu", max_inflight=2)
    monkeypatch.delenv("OFFLOAD_IMPL")
    with pytest.raises(TypeError, match=r"impl 'ref' does not take it: pass impl='fast'$"):
        ao.Offloader(impl="ref", device="cpu", max_inflight=2)


def test_no_budget_given_as_none_picks_nothing_and_every_implementation_takes_it(monkeypatch):
    """``memory_budget=None`` is the setting's default: a script passing ``args.budget`` with no
    budget runs the implementation it would run without it, $OFFLOAD_IMPL's included."""
    monkeypatch.delenv("OFFLOAD_IMPL", raising=False)
    default = ao.Offloader(device="cpu").impl
    assert ao.Offloader(device="cpu", memory_budget=None).impl == default
    for impl in ("ref", "fast"):
        assert ao.Offloader(impl=impl, device="cpu", memory_budget=None).impl == impl
        monkeypatch.setenv("OFFLOAD_IMPL", impl)
        assert ao.Offloader(device="cpu", memory_budget=None).impl == impl
        monkeypatch.delenv("OFFLOAD_IMPL")
    assert ao.Offloader(impl="fast", device="cpu", memory_budget=None).memory_budget is None


def test_budget_picks_fast_where_impl_is_left_out(monkeypatch):
    """A memory budget is fast's plan, and fast runs on the CPU too: no impl, no $OFFLOAD_IMPL
    gives fast; a setting of fast that picks nothing still says whose it is."""
    from actoffload.budget.plan import BudgetPlan

    monkeypatch.delenv("OFFLOAD_IMPL", raising=False)
    off = ao.Offloader(device="cpu", memory_budget="1GiB")
    assert off.impl == "fast" and isinstance(off.plan, BudgetPlan)
    monkeypatch.setenv("OFFLOAD_IMPL", "fast")
    assert ao.Offloader(device="cpu", memory_budget="1GiB").impl == "fast"
    if not torch.cuda.is_available():
        monkeypatch.delenv("OFFLOAD_IMPL")
        with pytest.raises(TypeError, match="max_inflight is a setting of the 'fast' implementation; impl 'ref' "
                                            "does not take it: pass impl='fast'$"):
            ao.Offloader(device="cpu", max_inflight=2)


def test_budget_profile_counts_what_a_recomputed_group_would_save_even_where_addresses_are_reused():
    """Under checkpoint the forward's saves die as it goes and the allocator hands their
    addresses to later tensors: those are new storages, not aliases, so the profile's
    bytes equal what the group saves when it is not recomputed."""
    from actoffload.tools.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, seq_len=64, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn=176)

    def run(**settings):
        torch.manual_seed(0)
        model = Llama(cfg).to(torch.bfloat16)
        tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(0))
        off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, **settings)
        with ao.wrap(model.blocks, off):
            for _ in range(PROFILE_STEPS + 1):
                model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        return off

    saved = [g["offloaded_bytes"] for g in run().stats()["groups"].values()][-cfg.n_layers:]
    profile = run(memory_budget=1 << 40).plan.controller.profile
    assert [g.offloadable + g.kept for g in profile.groups] == saved


def test_budget_groups_kept_whole_are_left_to_autograd_and_still_notice_a_new_workload():
    blocks = _blocks()
    expected, _ = _steps(blocks, None)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    got, plans = _steps(blocks, off)
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    assert [g["action"] for g in plans[-1]["groups"]] == ["keep"] * 4
    s = off.stats()["groups"]["0"]
    assert s["offloaded"] == 0 and s["kept"] == {"budget": s["saved"]} and s["saved"] >= 3
    # another length: its plan predicted from this one's (everything still fits), never profiled:
    # keeping everything is the fastest plan there is
    _, plans = _steps(blocks, off, rows=128)
    assert [p["state"] for p in plans] == ["settled"] * (PROFILE_STEPS + 2)
    assert plans[-1]["workload"]["predicted_from"] == "[64, 256] torch.float32 cpu"
    assert [g["action"] for g in plans[-1]["groups"]] == ["keep"] * 4
    # the same inputs saving other bytes (more activations in each block): the hooked first
    # group sees it at its commit, and the next step profiles
    for b in blocks:
        b[1] = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Tanh(), torch.nn.Tanh(), torch.nn.Tanh())
    _, plans = _steps(blocks, off, steps=2)
    assert [p["state"] for p in plans] == ["re-planning", "profiling"]


def test_budget_profiling_ends_though_the_batch_varies_a_little():
    """Batches a few rows apart are two workloads (a step never runs a plan made for other
    shapes): each is profiled once, then each runs its own plan."""
    blocks = _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(2 * PROFILE_STEPS + 2):
            x = torch.randn(64 + 2 * (step % 2), D, requires_grad=True)  # 64, 66, 64, ...
            h = x * 1
            for b in blocks:
                h = h + b(h)
            h.square().sum().backward()
            for p in blocks.parameters():
                p.grad = None
    assert off.stats()["plan"]["state"] == "settled"


def test_budget_a_step_with_more_groups_than_profiled_runs_and_profiles_again():
    """A module called once more, or an evaluation forward before the next backward: the
    extra groups move all they can, and the next steps profile the new workload."""
    blocks = _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for calls in [[0, 1, 2, 3]] * (PROFILE_STEPS + 1) + [[0, 1, 2, 3, 3]]:
            x = torch.randn(64, D, requires_grad=True)
            h = x * 1
            for i in calls:
                h = h + blocks[i](h)
            h.square().sum().backward()
    assert off.plan.controller.state is State.REPLANNING  # the next step profiles again


def test_budget_a_graph_kept_for_a_second_backward_recomputes_again():
    blocks = _blocks()
    expected, _ = _steps(blocks, None, steps=1)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off):  # profiling: every block recomputed
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        h = x * 1
        for b in blocks:
            h = h + b(h)
        loss = h.square().sum()
        loss.backward(retain_graph=True)
        first = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
        for t in [x, *blocks.parameters()]:
            t.grad = None
        loss.backward()
        second = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
    assert_bitwise(first, expected[0])
    assert_bitwise(second, expected[0])


def test_budget_too_small_says_so_once_where_the_plan_is_first_chosen():
    """Raised when the step after profiling begins, before its first group saves anything;
    once per workload: a caller that goes on gets the plan that needs the least memory."""
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1024, min_offload_bytes=0)
    blocks = _blocks()
    saved = []
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS):
            _step(blocks, step)
        with pytest.raises(ValueError, match=r"no plan fits a memory budget of 1,024 bytes: the smallest") as e:
            _step(blocks, PROFILE_STEPS)
        saved.append(off.stats()["groups"])
        for step in range(2):
            _step(blocks, step)
    assert saved == [{}]  # raised before the step's first group opened: nothing saved in it
    plan = off.stats()["plan"]
    assert plan["budget_too_small"] == str(e.value)
    assert plan["predicted_peak_bytes"] == plan["smallest_reachable_bytes"] > 1024


class _TwoParts(torch.nn.Module):
    """``x + b(a(x))``: a module whose two parts a plan may recompute one by one, or whole."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU())
        self.b = torch.nn.Linear(H, D)

    def forward(self, x):
        return self.b(self.a(x))


def _parts(m):
    return [m.a, m.b]


def test_budget_a_module_recomputed_whole_is_one_group_and_bitwise():
    from actoffload.budget.actions import Action
    from actoffload.budget.costmodel import GroupDecision

    def blocks():
        torch.manual_seed(0)
        return torch.nn.ModuleList(_TwoParts() for _ in range(4))

    expected = [_step(blocks(), step) for step in range(3)]
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    model = blocks()
    handle = ao.wrap(model, off, parts=_parts)
    for step in range(PROFILE_STEPS + 1):  # profiled, then planned
        _step(model, step)
    controller = off.plan.controller
    # each module's two parts, and what running it whole saves: its input
    assert [(w.first, w.parts, w.inputs) for w in controller.profile.wholes] == [(i, 2, 64 * D * 4) for i in (0, 2, 4, 6)]
    actions = ["recompute_whole", "inside", "recompute_whole_offload", "inside", "recompute", "keep", "keep", "keep"]
    controller.force([GroupDecision(Action(a)) for a in actions], max_inflight=1, prefetch=1)
    got = [_step(model, step) for step in range(3)]
    handle.remove()
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    stats = off.stats()
    assert [g["action"] for g in stats["plan"]["groups"]] == actions
    # a module run whole is one group, its parts open none; nor do groups the plan keeps
    assert list(stats["groups"]) == ["0", "1", "2.0"]
    assert stats["groups"]["1"]["offloaded_bytes"] == 64 * D * 4  # the module's input, moved out


def test_wrap_parts_must_be_distinct_submodules_called_in_order():
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40)
    m = _TwoParts()
    with pytest.raises(ValueError, match="must give submodules of it"):
        ao.wrap([m], off, parts=lambda b: [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="gives a submodule twice"):
        ao.wrap([m], off, parts=lambda b: [b.a, b.a])
    with pytest.raises(ValueError, match="a part inside another"):
        ao.wrap([m], off, parts=lambda b: [b.a, b.a[0]])
    with pytest.raises(ValueError, match="wrap got _TwoParts and its 'a': groups do not nest"):
        ao.wrap([m, m.a], off, parts=lambda b: [b.a] if b is m else [b[0]])
    assert not hasattr(m, "_actoffload_wrap") and not hasattr(m.a, "_actoffload_wrap")  # nothing was wrapped


def _forced(off, actions, monkeypatch=None):
    """Run ``actions`` from the next step on, whatever the model would choose."""
    from actoffload.budget.actions import Action
    from actoffload.budget.costmodel import GroupDecision

    controller = off.plan.controller
    controller.force([GroupDecision(Action(a)) for a in actions])
    return controller


class _TwoInputs(torch.nn.Module):
    """``b(a(x) * memory)``: run whole, checkpointing saves both inputs, though its first part sees one."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x, memory):
        return self.b(self.a(x) * memory)


def test_budget_a_module_run_whole_saves_all_its_inputs_and_the_plan_knows_it(monkeypatch):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_TwoInputs() for _ in range(2))
    memory = torch.randn(64, D, requires_grad=True)

    def step(seed):
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        h, m = x * 1, memory * 1  # activations (a leaf that requires grad would stay: R3)
        for b in blocks:
            h = h + b(h, m)
        h.square().sum().backward()
        out = [x.grad.clone(), memory.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
        memory.grad = None
        for p in blocks.parameters():
            p.grad = None
        return out

    expected = [step(s) for s in range(3)]
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    handle = ao.wrap(blocks, off, parts=lambda m: [m.a, m.b])
    for s in range(PROFILE_STEPS + 1):
        step(s)
    controller = _forced(off, ["recompute_whole", "inside", "recompute_whole_offload", "inside"], monkeypatch)
    assert [w.inputs for w in controller.profile.wholes] == [64 * 2 * D * 4] * 2  # x and memory
    got = [step(s) for s in range(3)]
    handle.remove()
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    assert off.stats()["plan"]["state"] == "settled"  # no workload change seen
    assert off.stats()["groups"]["1"]["offloaded_bytes"] == 64 * 2 * D * 4


def test_budget_a_module_that_does_not_open_just_its_parts_is_never_run_whole():
    class Skips(_TwoParts):
        def forward(self, x):
            return self.a(x)[:, :D]  # b never runs

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Skips(), _TwoParts(), _TwoParts()])
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off, parts=_parts):
        for s in range(PROFILE_STEPS + 1):
            h = torch.randn(64, D, requires_grad=True) * 1
            for b in blocks:
                h = h + b(h)
            h.square().sum().backward()
    # groups: 0.0, then 1.0, 1.1, 2.0, 2.1: only the modules that opened their two parts
    assert [(w.first, w.parts) for w in off.plan.controller.profile.wholes] == [(1, 2), (3, 2)]


def test_budget_kept_groups_still_end_the_step_when_the_first_block_is_frozen():
    # partial fine-tuning: backward never unpacks what the first block saves, so the group that
    # keeps its hooks (and ends the step) is the first whose saves backward unpacks
    blocks = _blocks()
    blocks[0].requires_grad_(False)
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    states = []
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 6):
            h = torch.randn(64, D, generator=torch.Generator().manual_seed(step))
            for b in blocks:
                h = h + b(h)
            h.square().sum().backward()
            states.append(off.stats()["plan"]["state"])
    assert states == ["profiling"] * PROFILE_STEPS + ["settled"] * 6
    assert [g["action"] for g in off.stats()["plan"]["groups"]] == ["keep"] * 4
    assert list(off.stats()["groups"]) == ["1"]


def test_probe_reads_the_allocators_counters_from_its_nested_statistics(monkeypatch):
    """On CUDA the probe reads allocated, reserved and their peaks from the allocator's nested
    statistics as they come (``torch.cuda.memory_allocated`` and its kin flatten every counter in
    Python at each read, five or six reads a step); before CUDA starts they read 0. The CPU
    reads 0 and never asks."""
    stats = {"allocated_bytes": {"all": {"current": 10, "peak": 30}, "large_pool": {"current": 1}},
             "reserved_bytes": {"all": {"current": 40, "peak": 50}}}
    asked = []

    def nested(device):
        asked.append(device)
        return stats

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    probe = Probe(torch.device("cuda", 1))
    assert (probe.allocated(), probe.peak(), probe.reserved(), probe.peak_reserved()) == (10, 30, 40, 50)
    assert asked == [torch.device("cuda", 1)] * 4
    stats = {}  # CUDA not started yet
    assert (probe.allocated(), probe.peak(), probe.reserved(), probe.peak_reserved()) == (0, 0, 0, 0)
    cpu = Probe(torch.device("cpu"))
    assert (cpu.allocated(), cpu.peak(), cpu.reserved(), cpu.peak_reserved()) == (0, 0, 0, 0) and len(asked) == 8


def test_budget_host_memory_short_at_a_commit_keeps_the_group_and_the_step_goes_on():
    """Host memory the allocator cannot give at a commit (R10) leaves the group on the device under
    a memory budget, the step going on (a larger batch's profiling step, here), bitwise; the next
    forward, of the settled workload, runs the plan it settled on, from its first group."""
    failing = []

    def allocator(nbytes, pinned):
        if failing:
            raise ao.HostMemoryError("no host memory (the test's allocator)")
        return torch.empty(nbytes, dtype=torch.uint8)

    blocks, expected = _blocks(), _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=3 * GROUP_BYTES, min_offload_bytes=0,
                       host_allocator=allocator)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            assert_bitwise(_step(blocks, step), _step(expected, step))
        settled, listed = off.stats()["plan"], list(off.stats()["groups"])
        assert settled["state"] == "settled"
        failing.append(True)  # a larger batch, profiled, needs host memory the allocator cannot give
        assert_bitwise(_step(blocks, 0, rows=96), _step(expected, 0, rows=96))
        assert off.stats()["offloaded_bytes"] == 0
        failing.clear()
        for step in range(2):
            assert_bitwise(_step(blocks, step), _step(expected, step))
            plan = off.stats()["plan"]
            assert plan["state"] == "settled" and plan["groups"] == settled["groups"]
            assert list(off.stats()["groups"]) == listed


@pytest.mark.parametrize("groups", [3, 3.5, 4, 5])
def test_budget_on_the_cpu_a_measured_profile_settles_on_the_models_first_choice(groups):
    """On the CPU nothing is timed, so the order of trying plans says nothing: the plan the model
    rates fastest is the one that runs and settles (moving bytes or not)."""
    blocks = _blocks()
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=int(groups * GROUP_BYTES), min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            _step(blocks, step)
    c = off.plan.controller
    assert c.settled and c.plan.key == c._first_choice(c._fitting()).key
