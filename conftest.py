"""Repository-wide pytest setup: runs before any test module imports triton or touches CUDA."""

import gc
import os

import pytest

# One CPU thread per process unless the caller chose otherwise: the tests' tensors are tiny,
# and on a 2-core machine two OpenMP threads per process (and per spawned rank or worker, which
# inherit this) spin against each other and whatever else runs; under load a step of a tiny
# model took seconds instead of milliseconds. Results do not depend on it (each comparison is
# between runs of one process).
_ONE_THREAD = "OMP_NUM_THREADS" not in os.environ
if _ONE_THREAD:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if _ONE_THREAD:
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter; it reads this at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from actoffload.tools.determinism import use_deterministic  # noqa: E402  (imports triton)

# Bitwise comparisons need deterministic kernels; this also sets CUBLAS_WORKSPACE_CONFIG,
# which cuBLAS reads when CUDA's first matmul makes its handle, so it comes first.
use_deterministic(True)


# A full garbage collection walks every object torch and Triton made at import (about 300,000:
# up to a second each on a busy 2-core machine), and tests collect often to check lifetimes.
# Freezing what exists once the tests are collected (and again after any test that unfroze it,
# as the budget sweep does) leaves each collection only the objects made since: what a test
# checks the lifetime of is made inside the test, so it is never frozen before it is checked.
def _freeze() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (scripts/test runs with --dist loadgroup) the planted-bug tests share
    # one worker: each process checks the bugs' scenarios with the unpatched fast once.
    for item in items:
        if getattr(item, "originalname", None) == "test_planted_bug_is_caught":
            item.add_marker(pytest.mark.xdist_group("planted_bugs"))


def pytest_collection_finish(session):
    _freeze()


def pytest_runtest_teardown(item, nextitem):
    if gc.get_freeze_count() == 0:  # a test unfroze everything (gc.unfreeze())
        _freeze()
