"""Deterministic kernels, so that runs with and without an offloader compare bit for bit."""

from __future__ import annotations

import os

import torch


def use_deterministic(enabled: bool = True) -> None:
    """Turn PyTorch's deterministic algorithms on (or off), cuBLAS included.

    cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first handle is made; a value
    the user set is kept.

    Example::

        use_deterministic()          # before the first CUDA matmul
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
