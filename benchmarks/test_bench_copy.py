"""Copy throughput of one group: per-tensor copies vs fast's packed and direct paths.

GB/s of a whole offload + reload go into each benchmark's extra_info.
"""

import pytest
import torch

from actoffload.tools.workloads import copy_per_tensor, group_offloader, group_round_trip, random_bytes, sync
from conftest import CUDA, ROUNDS

KiB = 1 << 10
MIXES = {
    # name: (sizes on CUDA, sizes on CPU)
    "1000x64KiB": ([64 * KiB] * 1000, [4 * KiB] * 20),
    "mixed_4KiB_16MiB": ([4 * KiB * 4**i for i in range(8)] * 4, [64, 4 * KiB, 64 * KiB] * 3),
}


def _record(benchmark, total: int) -> None:
    benchmark.extra_info["bytes_each_way"] = total
    benchmark.extra_info["gbps_both_ways"] = 2 * total / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("mix", list(MIXES))
def test_bench_per_tensor_copies(benchmark, mix, device):
    tensors = random_bytes(MIXES[mix][0 if CUDA else 1], device)
    hosts = [torch.empty(t.numel(), dtype=torch.uint8, pin_memory=CUDA) for t in tensors]

    def out_and_back():
        copy_per_tensor(tensors, hosts, "d2h")
        copy_per_tensor(tensors, hosts, "h2d")
        sync(device)

    benchmark.pedantic(out_and_back, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, sum(t.numel() for t in tensors))


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("pack_below", [0, 4 << 20], ids=["direct", "packed"])
def test_bench_fast_group(benchmark, mix, pack_below, device):
    tensors = random_bytes(MIXES[mix][0 if CUDA else 1], device)
    off = group_offloader(device, pack_below=pack_below)
    x = torch.zeros(1, device=device, requires_grad=True)

    benchmark.pedantic(group_round_trip, args=(off, x, tensors), rounds=ROUNDS, warmup_rounds=1)
    total = sum(t.numel() for t in tensors)
    _record(benchmark, total)
    assert off.stats()["groups"]["g"]["offloaded_bytes"] == total
