"""Shared fixtures for the pytest-benchmark suites (see benchmarks/README.md).

What each suite times is written once, in actoffload/tools/workloads.py, and
``actoffload bench`` times the same code.
"""

import pytest
import torch

from actoffload.tools.determinism import use_deterministic

CUDA = torch.cuda.is_available()
# Timed rounds of each benchmark, after one warm-up round: on a CPU the suites check that every
# case runs and give rough figures (the GPU's are the ones reported), so fewer rounds there
ROUNDS = 5 if CUDA else 3


@pytest.fixture
def device():
    return torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    use_deterministic(True)  # and CUBLAS_WORKSPACE_CONFIG, without which cuBLAS raises in deterministic mode
    yield
    use_deterministic(before)
