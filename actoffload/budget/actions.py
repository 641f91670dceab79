"""What a memory plan has one group do: the one vocabulary of the budget's modules."""

from __future__ import annotations

import enum


class Action(enum.Enum):
    """A group's action under a memory plan.

    ``KEEP``: everything it saves stays on the device. ``OFFLOAD``: its largest spans (up
    to a share of its offloadable bytes) move to host memory and come back for backward.
    ``RECOMPUTE``: its module runs under activation checkpointing, saving only its inputs,
    and runs again in backward; ``RECOMPUTE_OFFLOAD`` also moves those inputs out.
    ``RECOMPUTE_WHOLE`` and ``RECOMPUTE_WHOLE_OFFLOAD``: on the first part of a module given
    to ``ao.wrap`` with ``parts``, that whole module is recomputed as one group; its other
    parts are ``INSIDE`` it and open no group.
    """

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    RECOMPUTE_OFFLOAD = "recompute_offload"
    RECOMPUTE_WHOLE = "recompute_whole"
    RECOMPUTE_WHOLE_OFFLOAD = "recompute_whole_offload"
    INSIDE = "inside"

    @property
    def recomputes(self) -> bool:
        """Its module runs under checkpointing (as a group of its own, or a whole module)."""
        return self in _RECOMPUTING

    @property
    def whole(self) -> bool:
        """It recomputes a whole module whose parts are the groups."""
        return self in (Action.RECOMPUTE_WHOLE, Action.RECOMPUTE_WHOLE_OFFLOAD)

    @property
    def moves_inputs(self) -> bool:
        """It recomputes and moves the inputs it saves to host memory."""
        return self in (Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_WHOLE_OFFLOAD)

    def __str__(self) -> str:  # stats() and logs show the plain name
        return self.value


_RECOMPUTING = frozenset({Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_WHOLE,
                          Action.RECOMPUTE_WHOLE_OFFLOAD})
