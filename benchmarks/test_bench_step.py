"""One training step (forward + backward) per mode, side by side, as ``actoffload bench`` runs it."""

import pytest
import torch

from actoffload.tools.models import GPTConfig
from actoffload.tools.workloads import STEP_MODES, TrainingStep, make_stack
from conftest import CUDA, ROUNDS

CFG, BATCH = (GPTConfig(d_model=1024, n_heads=8, n_layers=4, seq_len=1024), 8) if CUDA else (
    GPTConfig(d_model=64, n_heads=4, n_layers=3, seq_len=32), 2)


@pytest.mark.parametrize("mode", STEP_MODES)
def test_bench_step(benchmark, mode, device):
    dtype = torch.bfloat16 if CUDA else torch.float32
    stack = make_stack(CFG, device, dtype)
    x = torch.randn(BATCH, CFG.seq_len, CFG.d_model, device=device, dtype=dtype)
    with TrainingStep(stack, x, mode, device) as step:
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)
        if step.off is not None:
            benchmark.extra_info["offloaded_bytes"] = step.off.stats()["offloaded_bytes"]
