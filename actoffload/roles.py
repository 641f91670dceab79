"""Roles: the activations a module saves, named, so that a selection (``ao.select_modules``)
offloads those of the selected roles and keeps the module's other saves.

A module with ``offload_roles`` names what its ops save (:func:`select_in_forward`). Where a
module of the selection names roles during its forward, the named tensors of selected roles
are opted in, tagged with their role, and every other tensor the module saved meanwhile is
vetoed: those it names under other roles, and those it cannot name (a norm's statistics, a
fused attention's log-sum-exp, the copies ``matmul`` makes of non-contiguous inputs). A
module's forward covers what it saves with :func:`selects`; nested modules that carry roles
of their own keep theirs. Marks apply to storages (R4), so a storage that a selected role
names is opted in even where an unselected role names it too (a view of one output under
two roles): its bytes are what the selection asked for.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterable, Mapping, TypeVar

import torch
import torch.nn as nn

from . import compat, marks, multibuffer
from .engine import group_open, open_group_saves

F = TypeVar("F", bound=Callable[..., Any])


class _Frame:
    """One module's forward under :func:`selects`: where its saves begin in the open group's,
    the roles it named, and the storages its nested role-carrying modules saved (theirs)."""

    __slots__ = ("module", "saves", "start", "named", "claimed")

    def __init__(self, module: nn.Module, saves: list[Any]):
        self.module, self.saves, self.start = module, saves, len(saves)
        self.named: Mapping[str, object] | None = None
        self.claimed: set[int] = set()


_frames = threading.local()


def _stack() -> list[_Frame]:
    stack = getattr(_frames, "stack", None)
    if stack is None:
        stack = _frames.stack = []
    return stack


def _tensors(ts: object) -> tuple[torch.Tensor, ...]:
    return ts if isinstance(ts, tuple) else (ts,)


def _keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {compat.storage_id(s) for t in tensors if t is not None for s in multibuffer.storages(t)}


def mark_selection(selected: set[str] | frozenset[str], saved_by_role: Mapping[str, object],
                   others: Iterable[torch.Tensor] = ()) -> None:
    """Opt in the tensors of selected roles (labelled with their role, for ``stats()``) and veto
    the rest: the other roles' tensors and ``others`` (what the module saved unnamed), but for
    storages a selected tensor shares. A role maps to a tensor or to a tuple of them (an op that
    saves several).

    >>> a, b = torch.randn(4), torch.randn(4)
    >>> mark_selection({"qkv"}, {"qkv": a, "attn_norm": b})  # a opted in, b vetoed
    """
    chosen = [(role, _tensors(ts)) for role, ts in saved_by_role.items() if role in selected]
    keep = _keys(t for _, ts in chosen for t in ts)
    for role, ts in chosen:
        marks.opt_in_as(role, *ts)
    rest = [t for role, ts in saved_by_role.items() if role not in selected for t in _tensors(ts)]
    rest += others
    vetoed = (b for t in rest if t is not None for b in multibuffer.plain_buffers(t))
    marks.mark_not_offload(*(b for b in vetoed if not _keys((b,)) <= keep))


def select_in_forward(module: nn.Module, saved_by_role: dict[str, object]) -> None:
    """For modules built from plain ops: name what ``module`` saves, by role, so that its
    selection applies. Under :func:`selects` (the module's forward decorated) the marking waits
    for the forward's end, when every save of the module is known; otherwise it happens now, and
    only the named tensors are marked.

    >>> class Norm(nn.Module):
    ...     offload_roles = ("mlp_norm",)
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norm = nn.LayerNorm(8)
    ...     @selects
    ...     def forward(self, x):
    ...         select_in_forward(self, {"mlp_norm": x})  # what the norm saves
    ...         return self.norm(x)
    """
    selected = getattr(module, "offload_selected", None)
    if not selected or not group_open():
        return
    stack = _stack()
    if stack and stack[-1].module is module:
        stack[-1].named = saved_by_role
    else:
        mark_selection(selected, saved_by_role)


def selects(forward: F) -> F:
    """Decorate a role-carrying module's ``forward``: once it returns, its selection (if any)
    applies to everything it saved, named or not (module docstring). Costs a check a call while no
    offload group is open, or the module has no selection and no module around it has one."""

    @functools.wraps(forward)
    def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        stack = _stack()
        saves = open_group_saves() if (stack or getattr(module, "offload_selected", None)) else None
        if saves is None:
            return forward(module, *args, **kwargs)
        frame = _Frame(module, saves)
        stack.append(frame)
        try:
            out = forward(module, *args, **kwargs)
        finally:
            stack.pop()
        if open_group_saves() is not saves:  # (groups do not nest: the group it began in is gone)
            return out
        mine = [(s.tensor, _keys((s.tensor,))) for s in saves[frame.start:] if s.tensor is not None]
        if stack:  # a module around this one leaves this one's saves to it
            stack[-1].claimed.update(*(keys for _, keys in mine))
        selected = getattr(module, "offload_selected", None)
        if selected and frame.named is not None:
            named = _keys(t for ts in frame.named.values() for t in _tensors(ts))
            mark_selection(selected, frame.named,
                           [t for t, keys in mine if not (keys <= named or keys <= frame.claimed)])
        return out

    return run  # type: ignore[return-value]
