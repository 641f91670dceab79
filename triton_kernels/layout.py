"""Where each span goes in a packed buffer: plain Python, no Triton (so no interpreter switch)."""

from __future__ import annotations


def packed_layout(sizes: list[int], align: int = 16) -> tuple[list[int], int]:
    """Offsets of each size in a packed buffer, each aligned to ``align``; and the total.

    >>> packed_layout([3, 16, 1])
    ([0, 16, 32], 33)
    """
    offsets, total = [], 0
    for n in sizes:
        total = (total + align - 1) // align * align
        offsets.append(total)
        total += n
    return offsets, total
