"""Host time per saved tensor (pack + unpack) on a stack of many tiny ops."""

import pytest
import torch

import actoffload as ao
from conftest import CUDA, sync
from actoffload.tools.workloads import tiny_op_stack

OPS, GROUP = (2000, 100) if CUDA else (200, 50)


def _run(device, off):
    tiny_op_stack(torch.randn(256, device=device), off, OPS, GROUP)
    sync()


@pytest.mark.parametrize("mode", ["none", "ref_kept", "fast_kept", "fast_offloaded"])
def test_bench_hooks(benchmark, mode, device):
    off = None
    if mode != "none":
        impl, what = mode.split("_")
        off = ao.Offloader(impl=impl, device=device, keep_last=1, min_offload_bytes=0 if what == "offloaded" else 1 << 40)
    benchmark.pedantic(_run, args=(device, off), rounds=5, warmup_rounds=1)
    benchmark.extra_info["saved_tensors"] = OPS
    benchmark.extra_info["us_per_saved_tensor_incl_op"] = benchmark.stats.stats.min / OPS * 1e6
