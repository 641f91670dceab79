"""Small shared helpers for the rule tests."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import actoffload as ao
from actoffload.tools.determinism import use_deterministic

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")),
]


IMPLS = list(ao.IMPLS)


@contextlib.contextmanager
def deterministic():
    """Deterministic kernels (CUDA's index backward and cuBLAS), restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    use_deterministic(True)
    try:
        yield
    finally:
        use_deterministic(before)


def grads_of(model: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Every gradient (inputs first, then parameters), cloned."""
    out = [i.grad.clone() for i in inputs if i.grad is not None]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out


def zero_grads(model: torch.nn.Module, *inputs: torch.Tensor) -> None:
    for t in list(model.parameters()) + list(inputs):
        t.grad = None


def reference_grads(model, x: torch.Tensor, loss=torch.sum) -> list[torch.Tensor]:
    """Gradients of ``loss(run_groups(model, x))`` without an offloader; grads reset after."""
    zero_grads(model, x)
    loss(run_groups(model, x)).backward()
    out = grads_of(model, x)
    zero_grads(model, x)
    return out


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y), f"gradient {i} differs: max |diff| {(x.double() - y.double()).abs().max()}"


@contextlib.contextmanager
def maybe_group(off, name):
    if off is None:
        yield
    else:
        with off.group(name):
            yield


def run_groups(layers, x, off=None):
    """Run ``layers`` one group each; return the output."""
    for i, layer in enumerate(layers):
        with maybe_group(off, str(i)):
            x = layer(x)
    return x


def residual_step(blocks, step: int, rows: int, device="cpu", by_hand=None) -> list[torch.Tensor]:
    """One step of ``h = h + block(h)`` over ``blocks`` on a seeded input: the gradients of the
    input and the parameters (zeroed after). ``by_hand``: an offloader opening a group around
    each block."""
    d = next(blocks[0].parameters()).shape[-1]  # the first layer's input features
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(step)).to(device).requires_grad_(True)
    h = x * 1
    for i, b in enumerate(blocks):
        with maybe_group(by_hand, str(i)):
            h = h + b(h)
    h.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
    for p in blocks.parameters():
        p.grad = None
    return grads


def mlp_stack(n: int, d: int, device, dtype=torch.float32, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d)) for _ in range(n)
    ]
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


def off_for(impl: str, device: str, **kw):
    """An offloader for tests of what offloading does: on CUDA fast would otherwise recompute
    wrapped modules in its first steps (its warm-up, tested in test_warmup.py)."""
    kw.setdefault("min_offload_bytes", 0)
    if impl == "fast":
        kw.setdefault("warmup", "offload")
    return ao.Offloader(impl=impl, device=device, **kw)


def train_steps(off, model, steps: int, device, batch: int = 32) -> list[dict]:
    """Forward + backward ``steps`` times; after each forward, R9's host bound must hold and,
    after each backward, no host byte may stay in use. Returns ``stats()`` after each forward."""
    after_forward = []
    for _ in range(steps):
        x = torch.randn(batch, model[0][0].in_features, device=device, requires_grad=True)
        y = run_groups(model, x, off).square().sum()
        s = off.stats()
        assert s["host_bytes_in_use"] <= 1.05 * s["offloaded_bytes"]
        after_forward.append(s)
        y.backward()
        del y
        gc.collect()
        assert off.stats()["host_bytes_in_use"] == 0
    return after_forward
