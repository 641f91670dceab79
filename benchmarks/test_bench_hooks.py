"""Host time per saved tensor (pack + unpack) on a stack of many tiny ops."""

import pytest
import torch

from actoffload.tools.workloads import HOOK_MODES, hook_offloader, tiny_op_stack
from conftest import CUDA, ROUNDS

OPS, GROUP = (2000, 100) if CUDA else (200, 50)


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_bench_hooks(benchmark, mode, device):
    off = hook_offloader(mode, device)
    benchmark.pedantic(tiny_op_stack, args=(torch.randn(256, device=device), off, OPS, GROUP), rounds=ROUNDS,
                       warmup_rounds=1)
    benchmark.extra_info["saved_tensors"] = OPS
    benchmark.extra_info["us_per_saved_tensor_incl_op"] = benchmark.stats.stats.min / OPS * 1e6
