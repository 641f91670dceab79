"""Shared fixtures for the pytest-benchmark suites (see benchmarks/README.md)."""

import pytest
import torch

CUDA = torch.cuda.is_available()


@pytest.fixture
def device():
    return torch.device("cuda" if CUDA else "cpu")


def sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True)
