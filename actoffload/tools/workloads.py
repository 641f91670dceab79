"""Workloads shared by ``actoffload bench`` and the pytest-benchmark suites in benchmarks/."""

from __future__ import annotations

import torch


class SaveMany(torch.autograd.Function):
    """Saves the given tensors for backward and passes the gradient through: one group of
    exactly those tensors, to time copy throughput."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g,) + (None,) * len(ctx.saved_tensors)


def tiny_op_stack(x0: torch.Tensor, off, ops: int, group_size: int) -> None:
    """``ops`` tiny ops, each saving one tensor, ``group_size`` to a group; then backward.
    ``off=None`` runs without an offloader: the difference is the hooks' host time."""
    h = x0.clone().requires_grad_(True)
    x = h
    for g in range(ops // group_size):
        if off is None:
            for _ in range(group_size):
                x = x.sin()
        else:
            with off.group(str(g)):
                for _ in range(group_size):
                    x = x.sin()  # saves its input: one saved tensor per op
    x.sum().backward()
