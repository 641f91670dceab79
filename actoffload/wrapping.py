"""``wrap(modules, off)``: make each module's forward an offload group."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils.checkpoint

from . import compat, policy
from .marks import mark_parameters
from .offloader import GroupContext, Offloader


class WrapHandle:
    """Returned by :func:`wrap`; ``remove()`` gives every module its own forward back."""

    def __init__(self, restores: list[Callable[[], None]]):
        self._restores = restores

    def remove(self) -> None:
        for restore in self._restores:
            restore()
        self._restores = []

    def __enter__(self) -> WrapHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def wrap(
    modules: torch.nn.Module | Iterable[torch.nn.Module],
    off: Offloader,
    names: Sequence[str] | None = None,
    parts: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None = None,
) -> WrapHandle:
    """Make each module's forward an offload group named by its index or by ``names``.

    A single module is one group; a ``ModuleList``/``Sequential``/list gives one group per
    element. The module's forward runs inside ``off.group(name)``: leaving it by an
    exception leaves the group as ``with`` would (R8), and a module called twice in one
    forward is two groups (``stats()`` shows ``name`` and ``name#2``). The module's
    parameters are recorded at every call, so any tensor over their storage stays
    resident (R3), a detached view of a weight included.

    Composes with: ``torch.compile`` of the blocks or of the whole model (the group
    boundary is a graph break), FSDP2's ``fully_shard`` on the same modules, activation
    checkpointing inside or around a wrapped module (a checkpoint's recomputation in
    backward opens no group).

    ``parts``: a function giving each module's parts, submodules its forward calls once
    each, in that order. The parts are then the groups (``"0.0"``, ``"0.1"``, ...), and a
    memory plan may run a module whole instead, as one recomputed group (``"0"``): it
    keeps only the module's inputs, not each part's, and runs its host work once. Under
    ``torch.compile``, compile the parts, not the whole model (docs/semantics.md).

    Example::

        off = ao.Offloader(keep_last=1)
        handle = ao.wrap(model.blocks, off)          # groups "0", "1", ...
        model(x).sum().backward()
        handle.remove()                              # model back as it was
        ao.wrap(model.blocks, off, parts=lambda b: [b.attn, b.mlp])   # groups "0.0", "0.1", ...
    """
    if not isinstance(off, Offloader):
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
    for m in modules:
        if getattr(m.forward, "__actoffload_group__", None) is not None:
            raise ValueError(f"{type(m).__name__} is already wrapped; remove() its handle before wrapping it again")
    if parts is None:
        return WrapHandle([_wrap_one(m, off, name) for m, name in zip(modules, names)])
    inner_of = [list(parts(m)) for m in modules]
    for m, inner in zip(modules, inner_of):  # all checked before any is wrapped
        owned = {id(x) for x in m.modules()}
        if not inner or any(not isinstance(x, torch.nn.Module) or id(x) not in owned or x is m for x in inner):
            raise ValueError(f"parts({type(m).__name__}) must give submodules of it (its forward calls each once, "
                             f"in order); got {[type(x).__name__ for x in inner]}")
        if len({id(x) for x in inner}) != len(inner):
            raise ValueError(f"parts({type(m).__name__}) gives a submodule twice: each part is one group")
        if any(y is not x and id(y) in {id(z) for z in x.modules()} for x in inner for y in inner):
            raise ValueError(f"parts({type(m).__name__}) gives a part inside another: groups do not nest (R2)")
        if any(getattr(x.forward, "__actoffload_group__", None) is not None for x in inner):
            raise ValueError(f"a part of {type(m).__name__} is already wrapped; remove() its handle first")
    every = [id(x) for inner in inner_of for x in inner]
    if len(set(every)) != len(every) or {id(m) for m in modules} & set(every):
        raise ValueError("parts gives one submodule for two modules, or a module that is itself wrapped: "
                         "each part is one group (R2)")
    restores = []
    for m, name, inner in zip(modules, names, inner_of):
        restores += [_wrap_one(x, off, f"{name}.{k}") for k, x in enumerate(inner)]
        restores.append(_wrap_one(m, off, name, parts=len(inner)))
    return WrapHandle(restores)


def _wrap_one(module: torch.nn.Module, off: Offloader, name: str, parts: int = 0) -> Callable[[], None]:
    had_own = "forward" in vars(module)
    inner = module.forward
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]

    # Not a `with` block: torch.compile cannot resume inside a `with` whose context manager
    # it does not trace, and would then run the whole forward eagerly. Two calls it does not
    # trace are two clean graph breaks, and the module's own forward between them compiles.
    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        # Not recomputed under torch.compile (checkpoint with our contexts would run it eagerly,
        # and eager kernels differ from compiled ones in the last bits), nor while it updates
        # running statistics (recomputing would update them twice).
        recomputable = not torch.compiler.is_compiling() and not _updates_stats(norms)
        group = _open(module, off, name, recomputable, parts, args, kwargs)
        try:
            if group.recompute:  # a plan's choice (budget, warm-up): save only the inputs, recompute in backward
                out = _recomputed(inner, group, args, kwargs)
            else:
                out = inner(*args, **kwargs)
        except BaseException:
            _close(group, failed=True)
            raise
        _close(group, failed=False)
        return out

    forward.__actoffload_group__ = name  # type: ignore[attr-defined]
    module.forward = forward

    def restore() -> None:
        if had_own:
            module.forward = inner
        else:
            del module.forward

    return restore


def _input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the tensors a module is called with (each once; parameters and leaves that
    require grad aside, which stay where they are, R3): what checkpointing it whole saves."""
    seen, total = set(), 0
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor) and not policy.is_parameter(t):
            try:
                key = (compat.storage_key(t), t.storage_offset())
            except (NotImplementedError, RuntimeError):  # no storage of its own (a wrapper subclass)
                key = (id(t), 0)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _updates_stats(norms: list[torch.nn.modules.batchnorm._NormBase]) -> bool:
    """Whether a forward updates running statistics (batch norm in training): recomputing it
    would update them twice."""
    return any(m.training and m.track_running_stats for m in norms)


@compat.not_traced
def _recomputed(inner: Callable[..., Any], group: GroupContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``inner`` under non-reentrant checkpointing with the group's contexts (never traced:
    Dynamo cannot trace checkpoint with a ``context_fn`` of ours)."""
    return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False,
                                             context_fn=group.checkpoint_contexts, **kwargs)


@compat.not_traced
def _open(module: torch.nn.Module, off: Offloader, name: str, recomputable: bool, parts: int,
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> GroupContext:
    inputs = _input_bytes(args, kwargs) if parts else 0
    group = GroupContext(off, name, recomputable=recomputable, parts=parts, inputs=inputs).open()
    # at every call that opens a group (not a recomputation, a part of a module run whole, or a
    # module whose parts are the groups): a parameter's storage may have changed (.data, FSDP)
    if group.opened:
        mark_parameters(*module.parameters())
    return group


@compat.not_traced
def _close(group: GroupContext, failed: bool) -> None:
    group.close(failed)
