"""The plan seam: a plan object decides what each group does; the engine asks it."""

from __future__ import annotations

import re

import pytest
import torch

import actoffload as ao
from helpers import IMPLS, assert_bitwise, residual_step


class Matching(ao.Plan):
    """Offload only the groups whose names match; the others open no group at all."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)
        self.asked: list[str] = []

    def opening(self, name, recomputable, parts):
        self.asked.append(name)
        return ao.Opening() if self.pattern.fullmatch(name) else ao.Opening(hooked=False)


class RecomputeAll(ao.Plan):
    """Every wrapped module recomputed in backward, saving only its inputs."""

    def opening(self, name, recomputable, parts):
        return ao.Opening(recompute=True)


def _blocks(n=4, d=32):
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                                   torch.nn.Linear(2 * d, d)) for _ in range(n))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_plan_written_in_one_file_offloads_only_the_groups_it_names(impl):
    expected = residual_step(_blocks(), 0, 16)
    plan = Matching(r"[13]")
    off = ao.Offloader(impl=impl, device="cpu", min_offload_bytes=0, keep_last=0, plan=plan)
    blocks = _blocks()
    with ao.wrap(blocks, off):
        got = residual_step(blocks, 0, 16)
        assert plan.asked == ["0", "1", "2", "3"]
        stats = off.stats()
    assert_bitwise(got, expected)
    assert sorted(stats["groups"]) == ["1", "3"]  # the others opened no group
    assert all(g["offloaded_bytes"] > 0 for g in stats["groups"].values())


@pytest.mark.parametrize("impl", IMPLS)
def test_a_plan_that_recomputes_every_wrapped_module_is_bitwise(impl):
    expected = residual_step(_blocks(), 1, 16)
    off = ao.Offloader(impl=impl, device="cpu", min_offload_bytes=0, plan=RecomputeAll())
    blocks = _blocks()
    with ao.wrap(blocks, off):
        got = residual_step(blocks, 1, 16)
        groups = off.stats()["groups"]
    assert_bitwise(got, expected)
    assert all(g.get("recomputed") for g in groups.values())


def test_a_plan_serves_one_offloader():
    plan = ao.Plan()
    ao.Offloader(impl="ref", device="cpu", plan=plan)
    with pytest.raises(ValueError, match="already serves another offloader"):
        ao.Offloader(impl="ref", device="cpu", plan=plan)


def test_plan_must_be_a_plan_and_not_beside_a_memory_budget():
    with pytest.raises(TypeError, match="plan must be an ao.Plan"):
        ao.Offloader(impl="ref", device="cpu", plan=object())
    with pytest.raises(ValueError, match="either memory_budget or a plan"):
        ao.Offloader(impl="fast", device="cpu", plan=ao.Plan(), memory_budget="1GiB")


def test_the_default_plans_are_the_warm_up_and_the_budget():
    from actoffload.budget.plan import BudgetPlan
    from actoffload.warmup import WarmUp

    assert type(ao.Offloader(impl="ref", device="cpu").plan) is ao.Plan
    assert isinstance(ao.Offloader(impl="fast", device="cpu").plan, WarmUp)
    assert isinstance(ao.Offloader(impl="fast", device="cpu", memory_budget="1GiB").plan, BudgetPlan)
