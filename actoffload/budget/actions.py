"""What a memory plan has one group do: the one vocabulary of the budget's modules."""

from __future__ import annotations

import enum
import threading
import weakref
from dataclasses import dataclass


class Action(str, enum.Enum):
    """A group's action under a memory plan.

    ``KEEP``: everything it saves stays on the device. ``OFFLOAD``: its largest spans (up
    to a share of its offloadable bytes) move to host memory and come back for backward.
    ``RECOMPUTE``: its module runs under activation checkpointing, saving only its inputs,
    and runs again in backward; ``RECOMPUTE_OFFLOAD`` also moves those inputs out;
    ``RECOMPUTE_SELECTIVE`` keeps its inputs and the outputs of its costly ops (matmuls,
    attention) and runs only its other ops again (:mod:`actoffload.selective`);
    ``RECOMPUTE_SELECTIVE_OFFLOAD`` also moves the largest of those (up to a share of their
    bytes) to host memory, to come back for its recomputation. ``RECOMPUTE_ATTENTION`` and
    ``RECOMPUTE_ATTENTION_OFFLOAD`` do the same keeping only its fused attention's outputs,
    and run its matmuls again too: at long sequences the attention is a layer's costliest op,
    and its outputs take what the layer's input does.
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
    RECOMPUTE_ATTENTION = "recompute_attention"
    RECOMPUTE_ATTENTION_OFFLOAD = "recompute_attention_offload"
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
        return self in _SELECTIVE

    @property
    def attention_only(self) -> bool:
        """Selective, it keeps its fused attention's outputs only."""
        return self in _ATTENTION_ONLY

    @property
    def moves_kept(self) -> bool:
        """Selective, it moves the largest of what it keeps (up to its decision's fraction)."""
        return self in _MOVES_KEPT

    @property
    def whole(self) -> bool:
        """It recomputes a whole module whose parts are the groups."""
        return self in _WHOLE

    @property
    def moves_inputs(self) -> bool:
        """It recomputes and moves the inputs it saves to host memory."""
        return self in _MOVES_INPUTS

    @property
    def moves(self) -> bool:
        """It moves bytes to host memory (what it saves, or its inputs)."""
        return self in _MOVES

    @property
    def as_group(self) -> Action:
        """The action of a group of its own that does what this one does to a whole module
        (run as one group): the module is recomputed, its inputs moved out or not."""
        return _AS_GROUP.get(self, self)

    def __str__(self) -> str:  # stats() and logs show the plain name
        return self.value


# each property's members, looked up in a set: the search and the controller ask them of every
# group of hundreds of plans (naming two members in a tuple took 0.9 us an ask on the CPU)
_SELECTIVE = frozenset({Action.RECOMPUTE_SELECTIVE, Action.RECOMPUTE_SELECTIVE_OFFLOAD, Action.RECOMPUTE_ATTENTION,
                        Action.RECOMPUTE_ATTENTION_OFFLOAD})
_ATTENTION_ONLY = frozenset({Action.RECOMPUTE_ATTENTION, Action.RECOMPUTE_ATTENTION_OFFLOAD})
_MOVES_KEPT = frozenset({Action.RECOMPUTE_SELECTIVE_OFFLOAD, Action.RECOMPUTE_ATTENTION_OFFLOAD})
_WHOLE = frozenset({Action.RECOMPUTE_WHOLE, Action.RECOMPUTE_WHOLE_OFFLOAD})
_MOVES_INPUTS = frozenset({Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_WHOLE_OFFLOAD})
_MOVES = _MOVES_KEPT | _MOVES_INPUTS | {Action.OFFLOAD}
_AS_GROUP = {Action.RECOMPUTE_WHOLE: Action.RECOMPUTE, Action.RECOMPUTE_WHOLE_OFFLOAD: Action.RECOMPUTE_OFFLOAD}
_RECOMPUTING = _SELECTIVE | {Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD, Action.RECOMPUTE_WHOLE,
                             Action.RECOMPUTE_WHOLE_OFFLOAD}


@dataclass(frozen=True, eq=False, init=False)
class GroupDecision:
    """What a memory plan has one group do: its ``action``, and for ``Action.OFFLOAD`` the
    ``fraction`` of its offloadable bytes that moves (largest spans first, see
    :func:`actoffload.spans.largest_within`; for ``Action.RECOMPUTE_SELECTIVE_OFFLOAD`` and
    ``Action.RECOMPUTE_ATTENTION_OFFLOAD``, of
    what it keeps). A plain name is taken for its action.

    There is one object per action and fraction, however it is made (called, replaced, copied,
    unpickled): a plan's identity is a tuple of these, hashed and compared thousands of times
    per choice, and one object each, they hash and compare as objects do, without Python code
    (on the CPU a choice among 600 candidates took a quarter of the time a hash kept per object
    left it).

    >>> GroupDecision("offload", 0.5) is GroupDecision(Action.OFFLOAD, 0.5)
    True
    """

    action: Action = Action.KEEP
    fraction: float = 1.0

    def __new__(cls, action: Action | str = Action.KEEP, fraction: float = 1.0) -> GroupDecision:
        action = action if isinstance(action, Action) else Action(action)
        key = (action, fraction)
        # under a lock: the planning process's answers are unpickled on a thread of their own while
        # the step's thread makes decisions, and two objects for one decision are two plans
        with _MAKING:
            made = _DECISIONS.get(key)
            if made is None:
                made = super().__new__(cls)
                object.__setattr__(made, "action", action)
                object.__setattr__(made, "fraction", fraction)
                _DECISIONS[key] = made
        return made

    def __reduce__(self) -> tuple:  # unpickled (sent back by the planning process): this process's object
        return GroupDecision, (self.action, self.fraction)


# the decisions made, by action and fraction: held while a plan holds them
_DECISIONS: weakref.WeakValueDictionary[tuple[Action, float], GroupDecision] = weakref.WeakValueDictionary()
_MAKING = threading.RLock()  # (a finalizer that made a decision while one is made on its thread would not block)
