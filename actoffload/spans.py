"""Which spans move when a group may move only some of its bytes: one rule, for the policy
that moves them and for the memory model that predicts what they will be."""

from __future__ import annotations

from typing import Sequence


def largest_within(sizes: Sequence[int], cap: float) -> list[int]:
    """Indices of the spans taken under ``cap`` bytes, in the order taken: the sizes sorted
    largest first (equal sizes in their given order), each taken if it still fits, that is if
    the bytes taken so far plus its own are at most ``cap``; one that does not fit is
    skipped and the smaller ones after it are still tried. The largest spans go first
    because each span moves as one copy: fewer, larger copies move the same bytes for less
    overhead.

    Edge rules: a cap at least the largest size always takes the largest; a cap at least
    the sum takes every span; a cap below the smallest size takes none; a span of zero
    bytes always fits. ``cap`` may be fractional (a share of a group's bytes).

    >>> largest_within([4, 6, 3, 2], cap=8)   # 6 fits; 4 and 3 no longer do; 2 does
    [1, 3]
    >>> largest_within([4, 6, 3, 2], cap=100)
    [1, 0, 2, 3]
    >>> largest_within([4, 6], cap=3)
    []
    """
    taken: list[int] = []
    total = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if total + sizes[i] <= cap:
            taken.append(i)
            total += sizes[i]
    return taken
