"""Reliability of the engine under adversarial inputs: deep graphs, storages freed and
refilled before backward, tiny tensors, many groups. Each is checked bitwise against the
same run without an offloader (R1), or the error PyTorch itself gives."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import actoffload as ao
from actoffload import graph
from helpers import IMPLS, off_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- deep graphs
def _node_objects() -> int:
    """Autograd nodes that have a Python object now (each is freed by recursion in torch 2.13)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.autograd.graph.Node))


def _chain(off, groups: int, muls: int, x: torch.Tensor) -> torch.Tensor:
    """``groups`` groups of ``muls`` multiplications by a scalar (no saves) and one sin (saves its
    input): backward enters each group at its last node, ``muls`` nodes from the group before."""
    h = x * 1
    for _ in range(groups):
        with off.group("g"):
            for _ in range(muls):
                h = h * 1.0001
            h = h.sin()
            h = h * 1.0001
    return h


@pytest.mark.parametrize("min_offload_bytes", [0, 1 << 20])
def test_prefetch_gives_at_most_a_few_graph_nodes_a_python_object_per_group(min_offload_bytes):
    """Prefetch finds the groups backward reaches next from one node per group, not by walking
    the graph (which gave every node a Python object, and freeing a deep graph then overflowed
    the C stack)."""
    gc.collect()
    before = _node_objects()
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=min_offload_bytes, prefetch=1, keep_last=1)
    x = torch.randn(4, requires_grad=True)
    y = _chain(off, 20, 10, x)
    y.sum().backward()
    made = _node_objects() - before
    moved = min_offload_bytes == 0
    assert made <= (graph.LINK_TRIES * 20 if moved else 0), made  # 20 groups of 12 nodes
    del y
    gc.collect()
    assert _node_objects() == before


def test_prefetch_still_follows_a_chain_of_linear_layers():
    """A group whose first saves are its input, made by the group before: prefetch goes there."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=1, prefetch=2)
    h = x
    for i, layer in enumerate(model):
        with off.group(str(i)):
            h = layer(h)
    got = torch.autograd.grad(h.square().sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert off.stats()["copies"]["prefetched_groups"] == 5  # groups 0..4 moved; 5 stayed (keep_last)


_DEEP = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import actoffload as ao

    def chain(off, groups, muls, saves):
        x = torch.randn(4, requires_grad=True)
        h = x * 1
        for _ in range(groups):
            with off.group("g"):
                for _ in range(muls):
                    h = h * 1.0001
                for _ in range(saves):
                    h = h.sin()
        return h

    # fast with its defaults (nothing big enough to move): 5,000 groups of 20 nodes
    y = chain(ao.Offloader(impl="fast", device="cpu"), 5000, 19, 1)
    y.sum().backward()
    del y
    print("fast defaults freed", flush=True)
    # fast moving every save: 2,500 groups of 40 nodes
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, warmup="offload")
    y = chain(off, 2500, 39, 1)
    y.sum().backward()
    del y
    print("fast moving freed", flush=True)
    # ref: 60,000 saves in one group
    off = ao.Offloader(impl="ref", device="cpu", min_offload_bytes=0)
    y = chain(off, 1, 0, 60000)
    y.sum().backward()
    del y
    print("ref freed", flush=True)
""")


def test_a_graph_of_100000_nodes_with_offloading_frees_like_plain_pytorch():
    """In a subprocess (a stack overflow is a segfault): fast's prefetch search used to give
    every node it walked a Python object, and torch frees such nodes by recursion, so freeing
    these graphs crashed (the first at 100,000 nodes; 40,000 did not) where plain PyTorch frees
    them."""
    proc = subprocess.run([sys.executable, "-c", _DEEP.format(root=ROOT)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.split("\n")[:3] == ["fast defaults freed", "fast moving freed", "ref freed"]
