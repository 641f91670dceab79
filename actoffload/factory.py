"""``Offloader(...)``: pick and build an implementation (``ref`` or ``fast``)."""

from __future__ import annotations

import os

import torch

from .policy import POLICIES as _POLICIES
from .engine import OffloaderBase

IMPLS = ("ref", "fast")


def resolve_impl(impl: str | None = None) -> str:
    """``impl``, else ``$OFFLOAD_IMPL``, else ``"fast"`` with CUDA and ``"ref"`` without.

    >>> resolve_impl("ref")
    'ref'
    """
    source = "impl"
    if impl is None:
        impl, source = os.environ.get("OFFLOAD_IMPL") or None, "OFFLOAD_IMPL"
    if impl is None:
        return "fast" if torch.cuda.is_available() else "ref"
    if impl not in IMPLS:
        raise ValueError(f"unknown {source} {impl!r}; valid implementations are: {', '.join(IMPLS)}")
    return impl


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device (try 'cuda', 'cuda:0' or 'cpu')") from e
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device {dev} is not supported: actoffload offloads from 'cuda' (or 'cpu' for testing)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} asked for, but CUDA is not available here; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def Offloader(
    impl: str | None = None,
    device=None,
    min_offload_bytes: int = 1 << 20,
    policy: str = "all",
    keep_last: int = 1,
    prefetch: int = 1,
) -> OffloaderBase:
    """Create an activation offloader.

    Args:
        impl: ``"ref"`` or ``"fast"``; ``None`` reads ``$OFFLOAD_IMPL``, else picks
            ``"fast"`` when CUDA is available and ``"ref"`` otherwise.
        device: the compute device whose saved tensors are offloaded (default: CUDA if
            available, else CPU, where host memory stands in for device memory).
        min_offload_bytes: saved buffers smaller than this stay resident.
        policy: ``"all"`` offloads every eligible saved tensor, ``"marked"`` only those
            opted in with :func:`actoffload.mark_activation_offload`.
        keep_last: the last N groups of a forward stay resident (backward needs them first).
        prefetch: fast only: how many groups are reloaded ahead of backward.

    Example::

        import actoffload as ao
        off = ao.Offloader()
        handle = ao.wrap(model.layers, off)   # or: with off.group("name"): ...
        loss = model(x).sum()
        loss.backward()
        print(off.stats()["offloaded_bytes"])
    """
    name = resolve_impl(impl)
    if policy not in _POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies are: {', '.join(_POLICIES)}")
    args = (
        _resolve_device(device),
        _check_count("min_offload_bytes", min_offload_bytes),
        policy,
        _check_count("keep_last", keep_last),
        _check_count("prefetch", prefetch),
    )
    if name == "ref":
        from actoffload.ref import RefOffloader

        return RefOffloader(*args)
    from actoffload.fast import FastOffloader

    return FastOffloader(*args)
