"""Which groups the running backward pass reaches next, found through the autograd graph.

Used by implementations that reload ahead (``fast``'s prefetch). Each group remembers one
node of the graph: a node the previous group's forward created (by its autograd sequence
number) that one of its first saved tensors comes from: the node that made it, or, where
ops outside any group lie between the two (a norm, a residual add: a layer wrapped by its
parts), a node a few steps up from it (:data:`WALK`); or the node that made the tensor a
wrapped module was called with, once the group's first save with a history is seen to be
made from it directly (transformers' decoder layers save first what their own float32 cast of
the layer's input made). A group lives as long as its graph, and so does its link: a
node its own graph does not reach (a module that reads its input detached) would keep the
previous group's graph alive. Backward then
reaches the previous group exactly when that node is part of the running pass, which the
engine itself says (``compat.will_execute``). A group of another graph (another
micro-batch) is never yielded: its nodes are not part of this pass.

Why one node and no search: every autograd node Python has seen gets a Python object that
lives as long as the node does, and PyTorch (2.13) frees such nodes by recursion, one C
stack frame set per node, where it frees the others in a loop. A search that walked the
graph gave most nodes of a deep graph a Python object, and freeing it (``del loss``)
overflowed the stack. One node per group (and only with prefetch) keeps that recursion
as deep as the number of groups, not of nodes. (The few nodes a walk looks at between two
groups are made outside any group, where a layer's parts leave a norm or an add.)
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from . import compat
from .records import Group

G = TypeVar("G", bound=Group)

# How many saved tensors with autograd history, at the start of a group, are looked at for
# a node of the previous group (a linear layer saves its input first, a norm its input; a
# view of a weight or a tensor the group made itself is not one). Each look gives one node
# a Python object for as long as the graph lives.
LINK_TRIES = 2
# How many nodes made after the previous group's forward (outside any group) are looked
# at, from a saved tensor's node up towards that forward: a norm and a residual add between
# a layer's parts, with their weights' leaves, take about six.
WALK = 8


def note_save(group: Group, t: torch.Tensor) -> None:
    """``group`` saved ``t``, which has an autograd history (not a leaf), while it still
    looks for its link: the node that made ``t``, if the previous group's forward created it,
    or the group's candidate (:func:`note_input`), if ``t``'s node is it or was made from it
    directly (the first save only)."""
    group.link_tries -= 1
    prev = group.previous()
    if prev is None:
        group.link_tries = 0
        return
    node = t.grad_fn
    found, candidate = None, group.link_candidate
    group.link_candidate = None  # looked for in the first save only: each look costs nodes their Python objects
    if node is not None:
        found = _made_by(prev, group, node)
        if found is None and candidate is not None:
            if _comes_from(node, candidate):
                found = candidate
            else:  # its first saves are not of its input: looking on costs more nodes their objects
                group.link_tries = 0
    if found is not None:
        group.link = found
        group.link_tries = 0


def note_input(group: Group, t: torch.Tensor) -> None:
    """``group``'s module was called with ``t``: where the previous group's forward made it
    (a few nodes up at most), that node is the group's candidate link, confirmed by its first
    save with a history (:func:`note_save`), else dropped (at the latest when the group
    closes). A layer's first saves may all be of tensors its own ops made (transformers'
    decoder layers cast their input to float32 in their first norm): on an H200 such layers,
    wrapped whole, were linked to none through their saves, and no reload ran ahead of backward."""
    prev = group.previous()
    node = t.grad_fn
    if prev is not None and node is not None:
        group.link_candidate = _made_by(prev, group, node)


def _comes_from(node: Any, candidate: Any) -> bool:
    """Whether ``node`` is ``candidate`` or was made from it directly (a cast of the tensor the
    module was called with). No further: each node looked at gets a Python object, and on a
    chain of 3,500 wrapped modules whose first save came a dozen of their own ops after their
    input, a walk of eight nodes up from it made freeing the graph overflow the C stack."""
    return node is candidate or any(f is candidate for f, _ in node.next_functions)


def _made_by(prev: Group, group: Group, node: Any) -> Any:
    """A node of ``prev``'s forward that ``node`` comes from: ``node`` itself, or one found
    through at most :data:`WALK` nodes made between the two groups' forwards, outside both."""
    queue, looked = [node], 0
    while queue and looked < WALK:
        n = queue.pop(0)
        looked += 1
        seq = compat.node_sequence_nr(n)
        if prev.first_seq <= seq < prev.end_seq:
            return n
        if prev.end_seq <= seq < group.first_seq:  # (older nodes, and the group's own, lead elsewhere)
            queue.extend(f for f, _ in n.next_functions if f is not None)
    return None


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
