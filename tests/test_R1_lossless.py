"""R1: outputs and every gradient are bitwise equal to the run without an offloader."""

import pytest
import torch

import actoffload as ao
from actoffload.tools.models import GPT, GPTConfig
from helpers import DEVICES, IMPLS, assert_bitwise, grads_of, off_for, zero_grads


def _transformer(device, dtype):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=3, embedding=False,
                    attention="sdpa" if device == "cpu" else "eager")
    return GPT(cfg).to(device=device, dtype=dtype)


def _step(model, x, off):
    zero_grads(model, x)
    handle = ao.wrap(model.blocks, off) if off is not None else None
    try:
        out = model(x)
        out.square().mean().backward()
    finally:
        if handle:
            handle.remove()
    return [out.detach().clone()] + grads_of(model, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keep_last", [0, 1, 2])
def test_R1_transformer_grads_bitwise_equal(impl, device, keep_last):
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = _transformer(device, dtype)
    x = torch.randn(2, 16, 32, device=device, dtype=dtype, requires_grad=True)
    base = _step(model, x, None)
    off = off_for(impl, device, keep_last=keep_last)
    got = _step(model, x, off)
    assert_bitwise(base, got)
    assert off.stats()["offloaded_bytes"] > 0  # the run really moved data


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", ["all", "marked"])
def test_R1_training_losses_bitwise_equal_over_steps(impl, device, policy):
    def train(off):
        torch.manual_seed(1)
        cfg = GPTConfig(vocab_size=50, seq_len=12, d_model=24, n_heads=2, n_layers=2,
                        attention="sdpa" if device == "cpu" else "eager")
        model = GPT(cfg).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = ao.wrap(model.blocks, off) if off is not None else None
        losses = []
        for _ in range(3):
            x = torch.randint(0, 50, (2, 12), device=device)
            loss = model.loss(x, x.roll(1, dims=1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        if handle:
            handle.remove()
        return torch.stack(losses)

    assert torch.equal(train(None), train(off_for(impl, device, policy=policy)))
