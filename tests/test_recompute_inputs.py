"""R6 and recomputation: a module the library recomputes (the warm-up, a memory budget) saves
its inputs for it; the caller may write them in place once the forward is over
(``h += block(h)``, which autograd allows where nothing saved ``h``), and the recomputation
still reads what the forward read: bitwise as without an offloader."""

from __future__ import annotations

import pytest
import torch

import actoffload as ao
from helpers import assert_bitwise

STEPS = 5  # a budget profiles twice, then plans (and may explore)


def _blocks():
    torch.manual_seed(0)
    # tanh saves its output, not its input: autograd saves no h, so h += ... is allowed
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(64, 64)) for _ in range(4))


def _step(blocks, step: int) -> list[torch.Tensor]:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).requires_grad_(True)
    h = x * 1
    for b in blocks:
        h += b(h)
    h.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
    for p in blocks.parameters():
        p.grad = None
    return grads


def _smallest_and_largest() -> tuple[int, int]:
    off = ao.Offloader(impl="fast", device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    blocks = _blocks()
    with ao.wrap(blocks, off):
        for step in range(3):
            _step(blocks, step)
        plan = off.stats()["plan"]
    return plan["smallest_reachable_bytes"], plan["predicted_peak_bytes"]


def _settings():
    least, most = _smallest_and_largest()
    return {
        "warm-up": dict(warmup="recompute"),
        "warm-up, small inputs kept": dict(warmup="recompute", min_offload_bytes=1 << 20),
        "budget, everything fits": dict(memory_budget=1 << 40),
        "budget, least memory": dict(memory_budget=least),
        "budget, halfway": dict(memory_budget=(least + most) // 2),
    }


SETTINGS = _settings()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_R6_inputs_a_recomputed_module_saved_may_be_written_in_place_after_its_forward(name):
    expected = [_step(_blocks(), step) for step in range(STEPS)]
    settings = {"min_offload_bytes": 0, **SETTINGS[name]}
    off = ao.Offloader(impl="fast", device="cpu", **settings)
    blocks = _blocks()
    with ao.wrap(blocks, off):
        for step in range(STEPS):
            assert_bitwise(_step(blocks, step), expected[step])


def test_R6_a_saved_tensor_written_in_place_still_raises_where_autograd_saved_it():
    """The exception is for inputs only a plan saved: a tensor the module's own ops saved and
    the caller then wrote raises as it does without an offloader."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])  # linear saves its input
    off = ao.Offloader(impl="fast", device="cpu", warmup="recompute", min_offload_bytes=0)
    with ao.wrap(blocks, off):
        h = torch.randn(4, 8, requires_grad=True) * 1
        h += blocks[0](h)
        with pytest.raises(RuntimeError, match="modified by an in-place operation"):
            h.sum().backward()


class _Decision:
    def __init__(self, action):
        self.action = action


class _RecomputingController:
    """Stands in for the budget's controller: one profiling step, then every group recomputed
    with its inputs kept on the device (the plan a budget picks where that is cheapest)."""

    def __init__(self):
        self.profiling, self.next_position, self.steps = True, 0, 0

    def step_begins(self, may_raise=True):
        self.steps += 1
        self.profiling, self.next_position = self.steps == 1, 0

    def unhooked_next(self):
        return False

    def action(self, recomputable, parts=0):
        from actoffload.budget.actions import Action

        self.next_position += 1
        return _Decision(Action.RECOMPUTE_OFFLOAD if self.profiling else Action.RECOMPUTE)

    def move_at_most(self, position, decision):
        return None if self.profiling else 0  # kept on the device once planned

    def __getattr__(self, name):  # every other point: nothing to do here
        return lambda *args, **kwargs: None


def test_R6_a_budget_that_saw_inputs_written_while_profiling_guards_them_in_its_plan():
    from actoffload.budget.plan import BudgetPlan

    expected = [_step(_blocks(), step) for step in range(3)]
    plan = BudgetPlan(1 << 40, torch.device("cpu"))
    plan.controller = _RecomputingController()
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, plan=plan)
    blocks = _blocks()
    with ao.wrap(blocks, off):
        for step in range(3):
            assert_bitwise(_step(blocks, step), expected[step])
            assert all(g["recomputed"] for g in off.stats()["groups"].values())


class _Called(torch.nn.Module):
    """``_blocks()``' block, its input given by keyword or inside a tuple."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, pair=None, *, h=None):
        return self.block(pair[0] if h is None else h)


def _step_called(blocks, step: int, how: str) -> list[torch.Tensor]:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).requires_grad_(True)
    h = x * 1
    for b in blocks:
        h += b(h=h) if how == "keyword" else b((h, torch.ones(1)))
    h.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
    for p in blocks.parameters():
        p.grad = None
    return grads


@pytest.mark.parametrize("how", ["keyword", "tuple"])
@pytest.mark.parametrize("name", ["warm-up", "budget, least memory", "budget, halfway"])
def test_R6_inputs_given_by_keyword_or_in_a_tuple_are_saved_and_guarded_as_positional_ones(name, how):
    """Checkpointing saves only the positional tensors it is handed (any other it holds by
    reference, out of the group's sight): the library hands it every tensor the module is
    called with, so that a later in-place write cannot reach what the recomputation reads."""
    expected = [_step_called(torch.nn.ModuleList(map(_Called, _blocks())), step, how) for step in range(STEPS)]
    off = ao.Offloader(impl="fast", device="cpu", **{"min_offload_bytes": 0, **SETTINGS[name]})
    blocks = torch.nn.ModuleList(map(_Called, _blocks()))
    with ao.wrap(blocks, off):
        for step in range(STEPS):
            assert_bitwise(_step_called(blocks, step, how), expected[step])
            if step == 0:  # the warm-up's step, a budget's profiling step: every block recomputed
                assert all(g.get("recomputed") for g in off.stats()["groups"].values())


class _WritesItsInput(torch.nn.Module):
    """Scales its own input in place before anything saves it: valid without checkpointing."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h):
        h.mul_(1.5)
        return self.block(h)


@pytest.mark.parametrize("per_step", [False, True], ids=["wrapped-once", "wrapped-per-step"])
@pytest.mark.parametrize("save_policy", ["all", "marked"])
@pytest.mark.parametrize("name", ["warm-up", "budget, everything fits"])
def test_R6_a_module_writing_its_own_input_raises_once_and_is_not_recomputed_again(name, save_policy, per_step):
    """Checkpoint saved the input before the module's forward wrote it: the recomputation
    cannot read what the forward read. The first step that recomputes the module raises R6's
    error saying so and what to do (an input that stays on the device, under policy="marked",
    is cloned after the write: that clone stands for nothing); from the next step on the module
    is not recomputed, also where it is wrapped anew at every step (as the integrations do),
    and steps are bitwise as without an offloader."""
    def step(blocks, seed):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
        h = x * 1
        for b in blocks:
            h = h + b(h * 1)
        h.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
        for p in blocks.parameters():
            p.grad = None
        return grads

    expected = [step(torch.nn.ModuleList(map(_WritesItsInput, _blocks())), seed) for seed in range(STEPS)]
    off = ao.Offloader(impl="fast", device="cpu", policy=save_policy, **{"min_offload_bytes": 0, **SETTINGS[name]})
    blocks = torch.nn.ModuleList(map(_WritesItsInput, _blocks()))
    handle = ao.wrap(blocks, off)
    with pytest.raises(RuntimeError, match=r"wrote a tensor it was called with \(shape \[32, 64\]\) in place in its "
                                           r"forward.*not recomputed again from the next step on.*write out of place"):
        step(blocks, 0)
    for p in blocks.parameters():
        p.grad = None
    for seed in range(1, STEPS):
        if per_step:
            handle.remove()
            handle = ao.wrap(blocks, off)
        assert_bitwise(step(blocks, seed), expected[seed])
        assert not any(g.get("recomputed") for g in off.stats()["groups"].values())
    handle.remove()


def test_an_inference_tensor_given_by_keyword_to_a_recomputed_module_is_held_as_autograd_holds_it():
    """Checkpoint cannot save an inference tensor (made under ``torch.inference_mode()``), and
    nothing can write one in place outside it: it is held by reference, as autograd holds it."""
    with torch.inference_mode():
        shift = torch.randn(64)

    class Shifted(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, h, *, shift):
            return self.block(h + shift)

    def run(off):
        blocks = torch.nn.ModuleList(map(Shifted, _blocks()))
        handle = ao.wrap(blocks, off) if off is not None else None
        grads = []
        for seed in range(STEPS):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
            h = x * 1
            for b in blocks:
                h = h + b(h, shift=shift)
            h.square().sum().backward()
            grads.append([x.grad] + [p.grad.clone() for p in blocks.parameters()])
            blocks.zero_grad(set_to_none=True)
        if handle is not None:
            handle.remove()
        return grads

    expected = run(None)
    for name in ("warm-up", "budget, least memory"):
        for got, want in zip(run(ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, **SETTINGS[name])), expected):
            assert_bitwise(got, want)


def test_R6_a_subclass_input_written_by_its_module_is_seen_too():
    """A wrapper tensor subclass (R7) written in place by the module it is given to: its own
    version counter says so, as a plain tensor's does; the steps after are bitwise."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor", reason="this torch has no TwoTensor")

    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, h, *, t):
            t.mul_(2)
            return torch.tanh(self.fc(h)) * t

    def step(blocks, seed):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        t = two_tensor.TwoTensor(torch.ones(4, 16), torch.ones(4, 16)) * 1
        h = x * 1
        for b in blocks:
            h = b(h, t=t * 1)
        h.sum().backward()
        grads = [x.grad] + [p.grad.clone() for p in blocks.parameters()]
        blocks.zero_grad(set_to_none=True)
        return grads

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleList(Writes() for _ in range(2))

    expected = [step(model(), seed) for seed in range(3)]
    blocks = model()
    with ao.wrap(blocks, ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, memory_budget=1 << 40)):
        with pytest.raises(RuntimeError, match="wrote a tensor it was called with"):
            step(blocks, 0)
        blocks.zero_grad(set_to_none=True)
        for seed in (1, 2):
            assert_bitwise(step(blocks, seed), expected[seed])
