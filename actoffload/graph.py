"""Which groups the running backward pass reaches next: a search of the autograd graph.

Used by implementations that reload ahead (``fast``'s prefetch): from the node now
unpacking a group, a search towards the forward's earlier nodes finds a node the previous
group's forward created, by its autograd sequence number; the engine then says whether
this pass executes it. The search never yields a group of another graph (another
micro-batch).
"""

from __future__ import annotations

from collections import deque
from typing import Any, TypeVar

from . import compat
from .records import Group

G = TypeVar("G", bound=Group)


def upcoming(group: G, depth: int) -> list[G]:
    """Up to ``depth`` groups opened before ``group`` that the running backward pass will
    reach next, nearest first (empty outside backward)."""
    out: list[G] = []
    node = compat.current_node() if depth else None
    if node is None:
        return out
    frontier = [node]
    prev = group.previous()
    while prev is not None and len(out) < depth:
        found = nodes_created_in(frontier, prev.first_seq, prev.end_seq)
        if not found or not compat.will_execute(found[0]):
            break
        out.append(prev)  # type: ignore[arg-type]  # groups link only to their own kind
        frontier = found
        prev = prev.previous()
    return out


def nodes_created_in(frontier: list[Any], first_seq: int, end_seq: int) -> list[Any]:
    """Nodes reachable from ``frontier`` (towards inputs) whose sequence number lies in
    ``[first_seq, end_seq)``, nearest first. Nodes older than ``first_seq`` cannot lead
    into that range (a node's inputs are older than it), so the search stops there."""
    seen: dict[int, Any] = {}  # id -> node: holding the node keeps its id from being reused
    queue = deque(frontier)
    found = []
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None or id(nxt) in seen:
                continue
            seen[id(nxt)] = nxt
            seq = compat.node_sequence_nr(nxt)
            if first_seq <= seq < end_seq:
                found.append(nxt)
            elif seq >= first_seq and seq < 1 << 62:  # AccumulateGrad nodes have the largest number
                queue.append(nxt)
    return found
