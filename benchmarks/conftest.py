"""Shared fixtures for the pytest-benchmark suites (see benchmarks/README.md)."""

import pytest
import torch

from actoffload.tools.determinism import use_deterministic

CUDA = torch.cuda.is_available()


@pytest.fixture
def device():
    return torch.device("cuda" if CUDA else "cpu")


def sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _deterministic():
    # use_deterministic also sets CUBLAS_WORKSPACE_CONFIG, without which deterministic
    # mode makes every cuBLAS matmul raise on CUDA
    before = torch.are_deterministic_algorithms_enabled()
    use_deterministic(True)
    yield
    use_deterministic(before)
