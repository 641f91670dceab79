"""Which groups the running backward pass reaches next, found through the autograd graph.

Used by implementations that reload ahead (``fast``'s prefetch). Each group remembers one
node of the graph: the node that made one of its first saved tensors, where the previous
group's forward created that node (by its autograd sequence number). Backward then
reaches the previous group exactly when that node is part of the running pass, which the
engine itself says (``compat.will_execute``). A group of another graph (another
micro-batch) is never yielded: its nodes are not part of this pass.

Why one node and no search: every autograd node Python has seen gets a Python object that
lives as long as the node does, and PyTorch (2.13) frees such nodes by recursion, one C
stack frame set per node, where it frees the others in a loop. A search that walked the
graph gave most nodes of a deep graph a Python object, and freeing it (``del loss``)
overflowed the stack. One node per group (and only with prefetch) keeps that recursion
as deep as the number of groups, not of nodes.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from . import compat
from .records import Group

G = TypeVar("G", bound=Group)

# How many saved tensors with autograd history, at the start of a group, are looked at for
# a node of the previous group (a linear layer saves its input first, a norm its input; a
# view of a weight or a tensor the group made itself is not one). Each look gives one node
# a Python object for as long as the graph lives.
LINK_TRIES = 2


def note_save(group: Group, t: torch.Tensor) -> None:
    """``group`` saved ``t``, which has an autograd history (not a leaf), while it still
    looks for its link: the node that made ``t``, if the previous group's forward created it."""
    group.link_tries -= 1
    prev = group.previous()
    if prev is None:
        group.link_tries = 0
        return
    node = t.grad_fn
    if node is not None and prev.first_seq <= compat.node_sequence_nr(node) < prev.end_seq:
        group.link = node
        group.link_tries = 0


def upcoming(group: G, depth: int) -> list[G]:
    """Up to ``depth`` groups opened before ``group`` that the running backward pass will
    reach next, nearest first (call it during backward)."""
    out: list[G] = []
    g: Group = group
    while len(out) < depth:
        prev = g.previous()
        if prev is None or g.link is None or not compat.will_execute(g.link):
            break
        out.append(prev)  # type: ignore[arg-type]  # groups link only to their own kind
        g = prev
    return out
