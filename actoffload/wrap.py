"""``wrap(modules, off)``: make each module an offload group, with module hooks."""

from __future__ import annotations

import sys
from typing import Iterable, Sequence

import torch

from .engine import OffloaderBase


class WrapHandle:
    """Returned by :func:`wrap`; ``remove()`` takes every hook off again."""

    def __init__(self, hooks: list):
        self._hooks = hooks

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> "WrapHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def wrap(
    modules: torch.nn.Module | Iterable[torch.nn.Module],
    off: OffloaderBase,
    names: Sequence[str] | None = None,
) -> WrapHandle:
    """Make each module's forward an offload group named by its index or by ``names``.

    A single module is one group; a ``ModuleList``/``Sequential``/list gives one
    group per element. Leaving a module's forward by an exception leaves its group
    as if by ``with off.group(...)`` (R8).

    Example::

        off = ao.Offloader(keep_last=1)
        handle = ao.wrap(model.blocks, off)          # groups "0", "1", ...
        model(x).sum().backward()
        handle.remove()                              # model back as it was
    """
    if not isinstance(off, OffloaderBase):
        raise TypeError(f"wrap needs an offloader from actoffload.Offloader(...), got {type(off).__name__}")
    if isinstance(modules, torch.nn.Module) and not isinstance(modules, (torch.nn.ModuleList, torch.nn.Sequential)):
        modules = [modules]
    modules = list(modules)
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"wrap takes nn.Modules, got {type(m).__name__}")
    if names is None:
        names = [str(i) for i in range(len(modules))]
    names = list(names)
    if len(names) != len(modules):
        raise ValueError(f"wrap got {len(modules)} modules but {len(names)} names")

    hooks = []
    for module, name in zip(modules, names):
        entered: list = []  # the open group context of this module's running forward

        def pre(_module, _args, _name=name, _entered=entered):
            ctx = off.group(_name)
            ctx.__enter__()
            _entered.append(ctx)

        def post(_module, _args, _output, _entered=entered):
            # always_call hooks run inside the module's `except` block on failure
            if _entered:
                _entered.pop().__exit__(*sys.exc_info())

        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post, always_call=True))
    return WrapHandle(hooks)
