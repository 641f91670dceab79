"""Per-storage offload marks (rule R4).

A mark is recorded against the tensor's *storage*, so it holds for every alias
autograd may save (a view, a ``detach()``, the object a pack hook receives) and
lives exactly as long as that storage. Entries are keyed by the address of the
storage object and keep a weak reference to it: while that weak reference exists
the address cannot be handed to another storage, and once the storage dies the
entry reads as absent, so a mark never leaks onto a tensor that later reuses the
same memory.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import compat, multibuffer

OPT_IN = 1
VETO = 2
PARAMETER = 4  # the storage of a parameter: never worth moving (R3)

_lock = threading.Lock()
_marks: dict[int, tuple[StorageWeakRef, int]] = {}
_roles: dict[int, str] = {}  # storage -> the op role that opted it in (reporting only)
_sweep_at = 1024  # sweep dead entries when the table grows past this
_made = 0  # marks made or changed so far (not those set again as they were)


def _mark(tensors, flag: int, fn: str, role: str | None = None) -> None:
    global _sweep_at, _made
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn} takes tensors (or None), got {type(t).__name__}")
        for storage in multibuffer.storages(t):
            key = compat.storage_id(storage)
            with _lock:
                entry = _marks.get(key)
                old = entry[1] if entry is not None and not entry[0].expired() else 0
                if (old & flag) == flag and (role is None or _roles.get(key) == role):
                    continue  # marked already (wrap marks its parameters at every forward)
                _marks[key] = (StorageWeakRef(storage), old | flag)
                _made += 1
                if role is not None:
                    _roles[key] = role
                if len(_marks) > _sweep_at:
                    for k in [k for k, (ref, _) in _marks.items() if ref.expired()]:
                        del _marks[k]
                        _roles.pop(k, None)
                    _sweep_at = max(1024, 2 * len(_marks))


def mark_activation_offload(*tensors: torch.Tensor | None) -> None:
    """Opt tensors in for offloading; this matters under ``policy="marked"`` (R4).

    The mark applies to the tensor's storage, so every view or alias that autograd
    saves is covered, and it may come before or after the save, up to the commit
    of the group. A veto (:func:`mark_not_offload`) always wins.

    Example::

        off = ao.Offloader(policy="marked")
        with off.group("mlp"):
            h = fc1(x)
            ao.mark_activation_offload(h)   # h is offloaded; nothing else is
            y = fc2(torch.nn.functional.gelu(h))  # (GELU saves its input, h; ReLU would save its output)
    """
    _mark(tensors, OPT_IN, "mark_activation_offload")


def mark_not_offload(*tensors: torch.Tensor | None) -> None:
    """Veto offloading for tensors: they stay resident, whatever else marked them (R4).

    Example::

        with off.group("attn"):
            q = proj(x)
            ao.mark_not_offload(q)   # q and every view of it stay on the device
            y = attention(q, k, v)
    """
    _mark(tensors, VETO, "mark_not_offload")


def opt_in_as(role: str, *tensors: torch.Tensor | None) -> None:
    """Opt tensors in on behalf of an op role; ``stats()`` then reports their bytes by role."""
    _mark(tensors, OPT_IN, "opt_in_as", role)


def mark_parameters(*tensors: torch.Tensor | None) -> None:
    """Record tensors as parameters: any tensor over their storage stays resident (R3).

    ``ao.wrap`` records its modules' parameters at every forward, and every parameter
    registered on a module is recorded when it is registered, so a detached view of a
    parameter (``F.linear(x, w.detach())`` saves ``w.detach().t()``, which has no
    ``_base``) is recognised by its storage.
    """
    # the common case, at every wrapped forward: plain parameters marked already
    for i, t in enumerate(tensors):
        if type(t) is not torch.nn.Parameter:
            break
        entry = _marks.get(compat.storage_key(t))
        if entry is None or not entry[1] & PARAMETER or entry[0].expired():
            break
    else:
        return
    _mark(tensors[i:], PARAMETER, "mark_parameters")


# Every parameter registered on a module (weakly): moving a model (`model.cuda()`,
# `model.to(dtype)`) gives its parameters new storages without registering them again.
_parameters: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
# their storages as last looked up (None: to be looked up again); the weak references keep
# a dead storage's address from being taken for a new storage's
_parameter_keys: dict[int, StorageWeakRef] | None = None


def _on_parameter_registered(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None):
    global _parameter_keys
    if param is None or param.device.type == "meta":
        return
    try:
        mark_parameters(param)
        _parameters.add(param)
        _parameter_keys = None
    except Exception:  # noqa: BLE001  a parameter we cannot take apart: nothing to record, and
        pass  # a registration hook must never break the user's model construction


def is_parameter_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in the storage a registered parameter has now. For tensors without
    autograd history (a detached view of a weight looks like any constant): the parameters'
    current storages are looked up once per step (:func:`new_step`), not per tensor."""
    global _parameter_keys
    keys = _parameter_keys
    if keys is None:
        keys = {}
        for p in list(_parameters):
            try:
                keys.update((compat.storage_id(s), StorageWeakRef(s)) for s in multibuffer.storages(p))
            except TypeError:
                pass
        _parameter_keys = keys
    try:
        ref = keys.get(compat.storage_key(t))
    except (RuntimeError, NotImplementedError):
        return False
    return ref is not None and not ref.expired()


def new_step() -> None:
    """Parameters may have moved since the last step: look their storages up again."""
    global _parameter_keys
    _parameter_keys = None


# Every parameter registered on any module from now on (models are usually built after import).
torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


def role_of(storage_key: int) -> str | None:
    """The role that opted the live storage ``storage_key`` in, if any."""
    return _roles.get(storage_key) if flags_of(storage_key) else None


def made() -> int:
    """How many marks were made or changed so far: a caller that read the marks when this was
    the same has nothing new to read."""
    return _made


def flags_of(storage_key: int) -> int:
    """The marks on the live storage whose address is ``storage_key`` (0 when none)."""
    entry = _marks.get(storage_key)
    if entry is None or entry[0].expired():
        return 0
    return entry[1]


def live_mark_count() -> int:
    """Number of marks whose storage is still alive (for tests of R4's lifetime)."""
    with _lock:
        return sum(1 for ref, _ in _marks.values() if not ref.expired())
