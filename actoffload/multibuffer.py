"""The multi-buffer protocol (rule R7): one mechanism for every tensor made of several buffers.

A tensor type that is made of several buffers (an FP8 tensor with its scale, a
grouped tensor with its offsets) takes part by defining two methods::

    t.prepare_for_saving() -> (buffers: list[Tensor | None], state)
    type(t).restore_from_saved(state, buffers) -> Tensor

``prepare_for_saving`` may hand its buffers over (clear them on the object it is
called on), so it is only ever called on ``copy.copy(t)``: the caller's object is
never touched. Offloaders judge each buffer on its own and always rebuild the
wrapper with ``restore_from_saved``, even when no buffer moved.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def is_multibuffer(t: torch.Tensor) -> bool:
    """Whether ``t`` speaks the protocol (has both methods)."""
    return callable(getattr(t, "prepare_for_saving", None)) and callable(
        getattr(type(t), "restore_from_saved", None)
    )


def split(t: torch.Tensor) -> tuple[type, Any, list[torch.Tensor | None]]:
    """Take ``t`` apart into ``(type, state, buffers)`` without mutating ``t``.

    >>> from actoffload import GroupedTensor
    >>> g = GroupedTensor.from_tensors([torch.ones(2, 3), torch.zeros(1, 3)])
    >>> cls, state, buffers = split(g)
    >>> rebuild(cls, state, buffers).split()[1].shape
    torch.Size([1, 3])
    """
    try:
        shallow = copy.copy(t)
    except Exception as e:  # a type without __copy__ that copy.copy cannot handle
        raise TypeError(
            f"{type(t).__name__} implements prepare_for_saving but cannot be shallow-copied; "
            "define __copy__ returning a new object that shares the same buffers"
        ) from e
    if shallow is t:
        raise TypeError(f"{type(t).__name__}.__copy__ returned the same object; it must return a new one")
    buffers, state = shallow.prepare_for_saving()
    buffers = list(buffers)
    for b in buffers:
        if b is not None and not isinstance(b, torch.Tensor):
            raise TypeError(
                f"{type(t).__name__}.prepare_for_saving returned a {type(b).__name__} among its "
                "buffers; it must return tensors or None"
            )
    return type(t), state, buffers


def buffers_of(t: torch.Tensor) -> list[torch.Tensor | None]:
    """The buffers ``t`` is made of (for marks, which apply to each buffer's storage)."""
    return split(t)[2]


def rebuild(cls: type, state: Any, buffers: list[torch.Tensor | None]) -> torch.Tensor:
    """Put a multi-buffer tensor back together from its (possibly reloaded) buffers."""
    return cls.restore_from_saved(state, buffers)
