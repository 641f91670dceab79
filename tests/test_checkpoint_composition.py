"""Activation checkpointing composes with groups (R2): around one or several groups, with
saves outside the groups, inside a group, reentrant or not, selective; for ref, fast, fast
recomputing (its warm-up) and a memory budget. A group opened inside a checkpointed region
hands its saves to checkpoint, which recomputes the region and must see the same saves in
its recomputation (where no group opens) as in the forward."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as cp

import actoffload as ao
from helpers import assert_bitwise

SETTINGS = {
    "ref": dict(impl="ref"),
    "fast": dict(impl="fast", warmup="offload"),
    "fast-recompute": dict(impl="fast", warmup="recompute"),
    "budget": dict(impl="fast", memory_budget=1 << 40),
}
STEPS = 3  # a budget profiles twice, then runs its plan


class Layer(torch.nn.Module):
    """A decoder-like layer: a norm outside the groups, then two parts."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.inner_checkpoint = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm(h))
        if self.inner_checkpoint:
            return h + cp.checkpoint(self.mlp, h, use_reentrant=False)
        return h + self.mlp(h)


def _layers(n=3, d=16):
    torch.manual_seed(0)
    return torch.nn.ModuleList(Layer(d) for _ in range(n))


def _selective():
    policy = lambda ctx, op, *a, **k: (cp.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default  # noqa: E731
                                       else cp.CheckpointPolicy.PREFER_RECOMPUTE)
    return cp.create_selective_checkpoint_contexts(policy)


def _run(layers, arrangement: str, step: int) -> list[torch.Tensor]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).requires_grad_(True)
    h = x * 1
    if arrangement == "around each layer":
        for layer in layers:
            h = cp.checkpoint(layer, h, use_reentrant=False)
    elif arrangement == "around two layers":
        h = cp.checkpoint(lambda t: layers[1](layers[0](t)), h, use_reentrant=False)
        h = layers[2](h)
    elif arrangement == "reentrant":
        for layer in layers:
            h = cp.checkpoint(layer, h, use_reentrant=True)
    elif arrangement == "selective":
        for layer in layers:
            h = cp.checkpoint(layer, h, use_reentrant=False, context_fn=_selective)
    elif arrangement == "inside a group":
        for layer in layers:
            layer.inner_checkpoint = True
            h = layer(h)
    h.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    for p in layers.parameters():
        p.grad = None
    return grads


ARRANGEMENTS = ["around each layer", "around two layers", "reentrant", "selective", "inside a group"]


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_R2_checkpoint_around_or_inside_groups_is_bitwise(setting, arrangement):
    expected = [_run(_layers(), arrangement, step) for step in range(STEPS)]
    layers = _layers()
    off = ao.Offloader(device="cpu", min_offload_bytes=0, **SETTINGS[setting])
    groups = [m for layer in layers for m in ((layer,) if arrangement == "inside a group" else (layer.attn, layer.mlp))]
    with ao.wrap(groups, off):
        for step in range(STEPS):
            assert_bitwise(_run(layers, arrangement, step), expected[step])


@pytest.mark.parametrize("arrangement", ["around each layer", "reentrant", "selective"])
def test_a_budget_whose_groups_all_run_under_checkpointing_settles_on_a_plan_of_no_groups(arrangement):
    """Every group inside a checkpointed region leaves the plan nothing to decide (checkpointing
    owns the saves, or, reentrant, its forward saves nothing): the budget still profiles, plans
    and settles, rather than profiling every step."""
    expected = [_run(_layers(), arrangement, step) for step in range(STEPS + 1)]
    layers = _layers()
    off = ao.Offloader(device="cpu", min_offload_bytes=0, memory_budget=1 << 40)
    with ao.wrap([m for layer in layers for m in (layer.attn, layer.mlp)], off):
        for step in range(STEPS + 1):
            assert_bitwise(_run(layers, arrangement, step), expected[step])
    plan = off.stats()["plan"]
    assert plan["state"] == "settled" and plan["groups"] == []
    assert plan["workload"]["groups"] == 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_R2_gradient_checkpointing_of_layers_wrapped_with_parts_is_bitwise(setting):
    """transformers' gradient_checkpointing checkpoints each layer; here the layers are wrapped
    with their attention and MLP as the parts."""
    expected = [_run(_layers(), "around each layer", step) for step in range(STEPS)]
    layers = _layers()
    off = ao.Offloader(device="cpu", min_offload_bytes=0, **SETTINGS[setting])
    with ao.wrap(layers, off, parts=lambda layer: [layer.attn, layer.mlp]):
        for step in range(STEPS):
            assert_bitwise(_run(layers, "around each layer", step), expected[step])


def test_R2_groups_inside_a_checkpointed_region_are_inert_and_say_so():
    layers = _layers()
    off = ao.Offloader(impl="ref", device="cpu", min_offload_bytes=0)
    with ao.wrap([layers[0].attn, layers[0].mlp], off):
        x = torch.randn(8, 16, requires_grad=True)
        y = cp.checkpoint(layers[0], x, use_reentrant=False)
        groups = off.stats()["groups"]
        y.sum().backward()
    assert groups["0"]["offloaded_bytes"] == 0 and "inert" in groups["0"]["kept"]
