"""Tensors made of several buffers (rule R7): one mechanism for every such type.

Two ways in, one path through the offloader:

- A type that defines ``t.prepare_for_saving() -> (buffers, state)`` and
  ``type(t).restore_from_saved(state, buffers) -> Tensor`` (FP8 tensors with their
  scale, grouped tensors with their offsets). ``prepare_for_saving`` may hand its
  buffers over (clear them on the object it is called on), so it is only ever called
  on ``copy.copy(t)``: the caller's object is never touched.
- A wrapper subclass that speaks PyTorch's traceable-subclass protocol,
  ``__tensor_flatten__`` / ``__tensor_unflatten__`` (DTensor, torchao's Float8 and NF4
  tensors, TwoTensor): its inner tensors are its buffers.

Either way :func:`split` gives the buffers and a function that rebuilds the tensor from
them; offloaders judge each buffer on its own (a buffer may itself be such a tensor)
and always rebuild, also when no buffer moved.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator, NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class Split(NamedTuple):
    """A multi-buffer tensor taken apart: ``rebuild(buffers)`` puts it back together."""

    rebuild: Callable[[list[torch.Tensor | None]], torch.Tensor]
    buffers: list[torch.Tensor | None]


def speaks_r7(t: torch.Tensor) -> bool:
    """Whether ``t`` has both methods of the explicit protocol."""
    return callable(getattr(t, "prepare_for_saving", None)) and callable(
        getattr(type(t), "restore_from_saved", None)
    )


def is_multibuffer(t: torch.Tensor) -> bool:
    """Whether ``t`` is made of several buffers that :func:`split` can take apart. Not a nested
    tensor (R3: it stays resident): the jagged layout is a wrapper subclass, but one rebuilt from
    moved buffers has a ragged size of its own, which no longer matches its gradient's."""
    return type(t) is not torch.Tensor and not t.is_nested and (speaks_r7(t) or is_traceable_wrapper_subclass(t))


def split(t: torch.Tensor) -> Split:
    """Take ``t`` apart into its buffers without mutating ``t``.

    >>> from actoffload import GroupedTensor
    >>> g = GroupedTensor.from_tensors([torch.ones(2, 3), torch.zeros(1, 3)])
    >>> parts = split(g)
    >>> parts.rebuild(parts.buffers).split()[1].shape
    torch.Size([1, 3])
    """
    if speaks_r7(t):
        return _split_r7(t)
    if is_traceable_wrapper_subclass(t):
        return _split_flattened(t)
    raise TypeError(f"{type(t).__name__} is not made of buffers actoffload can take apart")


def plain_buffers(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``'s plain buffers (R7): ``t`` itself where it is one tensor, else the buffers it is
    made of, taken apart as far as they go (a mark or a veto reaches each of them alone).

    >>> from actoffload import GroupedTensor
    >>> len(list(plain_buffers(GroupedTensor.from_tensors([torch.ones(2), torch.ones(3)]))))
    2
    """
    if is_multibuffer(t):
        for b in split(t).buffers:
            if b is not None:
                yield from plain_buffers(b)
    else:
        yield t


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The device storages ``t`` is made of, one per plain buffer; none for a sparse or nested
    tensor (R3: resident anyway, nothing to mark).

    >>> len(storages(torch.ones(2)[1:]))
    1
    """
    out = []
    for b in plain_buffers(t):
        try:
            out.append(b.untyped_storage())
        except (RuntimeError, NotImplementedError):
            pass
    return out


def _split_r7(t: torch.Tensor) -> Split:
    cls = type(t)
    try:
        shallow = copy.copy(t)
    except Exception as e:  # a type without __copy__ that copy.copy cannot handle
        raise TypeError(
            f"{cls.__name__} implements prepare_for_saving but cannot be shallow-copied; "
            "define __copy__ returning a new object that shares the same buffers"
        ) from e
    if shallow is t:
        raise TypeError(f"{cls.__name__}.__copy__ returned the same object; it must return a new one")
    buffers, state = shallow.prepare_for_saving()  # type: ignore[attr-defined]
    buffers = list(buffers)
    for b in buffers:
        if b is not None and not isinstance(b, torch.Tensor):
            raise TypeError(
                f"{cls.__name__}.prepare_for_saving returned a {type(b).__name__} among its "
                "buffers; it must return tensors or None"
            )

    def rebuild(parts: list[torch.Tensor | None]) -> torch.Tensor:
        return cls.restore_from_saved(state, parts)  # type: ignore[attr-defined]

    return Split(rebuild, buffers)


def _split_flattened(t: torch.Tensor) -> Split:
    cls = type(t)
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: getattr(t, name) for name in names}
    # Only tensors are buffers; anything else a type lists (DTensor lists its device mesh,
    # an opaque object) is handed back to __tensor_unflatten__ as it was.
    tensor_names = [name for name, v in inner.items() if isinstance(v, torch.Tensor)]
    others = {name: v for name, v in inner.items() if name not in tensor_names}  # never the tensors:
    size, stride = t.size(), t.stride()  # holding them here would keep moved bytes alive

    def rebuild(parts: list[torch.Tensor | None]) -> torch.Tensor:
        return cls.__tensor_unflatten__({**others, **dict(zip(tensor_names, parts))}, ctx, size, stride)  # type: ignore[attr-defined]

    return Split(rebuild, [inner[name] for name in tensor_names])
