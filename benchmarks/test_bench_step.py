"""One training step (forward + backward) per implementation, side by side."""

import pytest
import torch

import actoffload as ao
from actoffload.tools.models import Block, GPTConfig
from conftest import CUDA, sync

CFG, BATCH = (GPTConfig(d_model=1024, n_heads=8, n_layers=4, seq_len=1024), 8) if CUDA else (
    GPTConfig(d_model=64, n_heads=4, n_layers=3, seq_len=32), 2)


@pytest.mark.parametrize("mode", ["none", "save_on_cpu", "ref", "fast"])
def test_bench_step(benchmark, mode, device):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    stack = torch.nn.Sequential(*[Block(CFG) for _ in range(CFG.n_layers)]).to(device=device, dtype=dtype)
    x = torch.randn(BATCH, CFG.seq_len, CFG.d_model, device=device, dtype=dtype)
    off = ao.Offloader(impl=mode, device=device, keep_last=1) if mode in ("ref", "fast") else None
    handle = ao.wrap(stack, off) if off is not None else None

    def step():
        inp = x.clone().requires_grad_(True)
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=CUDA):
                out = stack(inp * 1)
        else:
            out = stack(inp * 1)
        out.float().square().mean().backward()
        for p in stack.parameters():
            p.grad = None
        sync()

    benchmark.pedantic(step, rounds=5, warmup_rounds=1)
    if off is not None:
        benchmark.extra_info["offloaded_bytes"] = off.stats()["offloaded_bytes"]
        handle.remove()
