"""What a memory plan has one group do: the one vocabulary of the budget's modules."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar


class Action(str, enum.Enum):
    """A group's action under a memory plan.

    ``KEEP``: everything it saves stays on the device. ``OFFLOAD``: its largest spans (up
    to a share of its offloadable bytes) move to host memory and come back for backward.
    ``RECOMPUTE``: its module runs under activation checkpointing, saving only its inputs,
    and runs again in backward; ``RECOMPUTE_OFFLOAD`` also moves those inputs out;
    ``RECOMPUTE_SELECTIVE`` keeps its inputs and the outputs of its costly ops (matmuls,
    attention) and runs only its other ops again (:mod:`actoffload.selective`);
    ``RECOMPUTE_SELECTIVE_OFFLOAD`` also moves the largest of those (up to a share of their
    bytes) to host memory, to come back for its recomputation.
    ``RECOMPUTE_WHOLE`` and ``RECOMPUTE_WHOLE_OFFLOAD``: on the first part of a module given
    to ``ao.wrap`` with ``parts``, that whole module is recomputed as one group; its other
    parts are ``INSIDE`` it and open no group.

    A member is also its plain name (a ``str``): ``stats()`` and logs show the name, and
    code that still compares names keeps working.
    """

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    RECOMPUTE_OFFLOAD = "recompute_offload"
    RECOMPUTE_SELECTIVE = "recompute_selective"
    RECOMPUTE_SELECTIVE_OFFLOAD = "recompute_selective_offload"
    RECOMPUTE_WHOLE = "recompute_whole"
    RECOMPUTE_WHOLE_OFFLOAD = "recompute_whole_offload"
    INSIDE = "inside"

    @property
    def recomputes(self) -> bool:
        """Its module runs under checkpointing (as a group of its own, or a whole module)."""
        return self in _RECOMPUTING

    @property
    def selective(self) -> bool:
        """It keeps its costly ops' outputs (on the device or moved), and recomputes only the rest."""
        return self in (Action.RECOMPUTE_SELECTIVE, Action.RECOMPUTE_SELECTIVE_OFFLOAD)

    @property
    def whole(self) -> bool:
        """It recomputes a whole module whose parts are the groups."""
        return self in (Action.RECOMPUTE_WHOLE, Action.RECOMPUTE_WHOLE_OFFLOAD)

    @property
    def moves_inputs(self) -> bool:
        """It recomputes and moves the inputs it saves to host memory."""
        return self in (Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_WHOLE_OFFLOAD)

    @property
    def moves(self) -> bool:
        """It moves bytes to host memory (what it saves, or its inputs)."""
        return self in (Action.OFFLOAD, Action.RECOMPUTE_SELECTIVE_OFFLOAD) or self.moves_inputs

    @property
    def as_group(self) -> Action:
        """The action of a group of its own that does what this one does to a whole module
        (run as one group): the module is recomputed, its inputs moved out or not."""
        return {Action.RECOMPUTE_WHOLE: Action.RECOMPUTE,
                Action.RECOMPUTE_WHOLE_OFFLOAD: Action.RECOMPUTE_OFFLOAD}.get(self, self)

    def __str__(self) -> str:  # stats() and logs show the plain name
        return self.value


_RECOMPUTING = frozenset({Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_SELECTIVE,
                          Action.RECOMPUTE_SELECTIVE_OFFLOAD, Action.RECOMPUTE_WHOLE, Action.RECOMPUTE_WHOLE_OFFLOAD})


@dataclass(frozen=True)
class GroupDecision:
    """What a memory plan has one group do: its ``action``, and for ``Action.OFFLOAD`` the
    ``fraction`` of its offloadable bytes that moves (largest spans first, see
    :func:`actoffload.spans.largest_within`; for ``Action.RECOMPUTE_SELECTIVE_OFFLOAD``, of
    what it keeps). A plain name is taken for its action."""

    action: Action = Action.KEEP
    fraction: float = 1.0
    _hash: ClassVar[int]  # set per instance in __post_init__ (a ClassVar to the dataclass: not a field)

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            object.__setattr__(self, "action", Action(self.action))
        # A plan's identity is a tuple of these, hashed thousands of times per choice (plans
        # looked up by what they do): hashed once here. Not pickled: an enum's hash is its
        # name's, which differs between processes (the planning process sends these back).
        object.__setattr__(self, "_hash", hash((self.action, self.fraction)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        return GroupDecision, (self.action, self.fraction)
