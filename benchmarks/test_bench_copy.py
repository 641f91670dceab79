"""Copy throughput of one group: per-tensor copies vs fast's packed and direct paths.

GB/s of a whole offload + reload go into each benchmark's extra_info.
"""

import pytest
import torch

import actoffload as ao
from conftest import CUDA, sync
from actoffload.tools.workloads import SaveMany

KiB = 1 << 10
MIXES = {
    # name: (sizes on CUDA, sizes on CPU)
    "1000x64KiB": ([64 * KiB] * 1000, [4 * KiB] * 20),
    "mixed_4KiB_16MiB": ([4 * KiB * 4**i for i in range(8)] * 4, [64, 4 * KiB, 64 * KiB] * 3),
}


def _tensors(mix, device):
    sizes = MIXES[mix][0 if CUDA else 1]
    return [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in sizes]


@pytest.mark.parametrize("mix", list(MIXES))
def test_bench_per_tensor_copies(benchmark, mix, device):
    tensors = _tensors(mix, device)
    hosts = [torch.empty(t.numel(), dtype=torch.uint8, pin_memory=CUDA) for t in tensors]

    def out_and_back():
        for t, h in zip(tensors, hosts):
            h.copy_(t, non_blocking=True)
        for t, h in zip(tensors, hosts):
            t.copy_(h, non_blocking=True)
        sync()

    benchmark.pedantic(out_and_back, rounds=5, warmup_rounds=1)
    benchmark.extra_info["bytes_each_way"] = sum(t.numel() for t in tensors)
    benchmark.extra_info["gbps_both_ways"] = 2 * sum(t.numel() for t in tensors) / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("pack_below", [0, 4 << 20], ids=["direct", "packed"])
def test_bench_fast_group(benchmark, mix, pack_below, device):
    tensors = _tensors(mix, device)
    off = ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=0, prefetch=0)
    off.pack_below = pack_below
    x = torch.zeros(1, device=device, requires_grad=True)

    def out_and_back():
        with off.group("g"):
            y = SaveMany.apply(x, *tensors)
        off.synchronize()
        y.sum().backward()
        sync()

    benchmark.pedantic(out_and_back, rounds=5, warmup_rounds=1)
    total = sum(t.numel() for t in tensors)
    benchmark.extra_info["bytes_each_way"] = total
    benchmark.extra_info["gbps_both_ways"] = 2 * total / benchmark.stats.stats.median / 1e9
    assert off.stats()["groups"]["g"]["offloaded_bytes"] == total
