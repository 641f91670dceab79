"""Deterministic kernels, so that runs with and without an offloader compare bit for bit.

The one place that sets ``CUBLAS_WORKSPACE_CONFIG``: the test and benchmark setup, the
conformance runner, the demo and ``actoffload bench`` all call in here.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # a workspace size cuBLAS accepts for deterministic results


def set_cublas_workspace() -> None:
    """Let cuBLAS run deterministically: sets ``CUBLAS_WORKSPACE_CONFIG`` unless the user did.

    cuBLAS reads it when its first handle is made (the first matmul on a device), so call
    this before that; without it, deterministic mode makes every cuBLAS matmul raise.

    Example::

        set_cublas_workspace()       # first thing, before any CUDA matmul
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


def use_deterministic(enabled: bool = True) -> None:
    """Turn PyTorch's deterministic algorithms on (or off), cuBLAS included.

    Example::

        use_deterministic()          # before the first CUDA matmul
    """
    set_cublas_workspace()
    torch.use_deterministic_algorithms(enabled)
