"""Validating settings: every constructor argument is checked here, before any work."""

from __future__ import annotations

import math
import numbers
import operator
import os
import re
from typing import Any

import torch

IMPLS = ("ref", "fast")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def resolve_impl(impl: str | None = None, picks: str | None = None) -> str:
    """``impl``, else ``$OFFLOAD_IMPL``, else ``picks`` (the implementation a setting given
    picks, such as ``memory_budget``: ``"fast"``), else ``"fast"`` with CUDA and ``"ref"``
    without.

    >>> resolve_impl("ref")
    'ref'
    >>> resolve_impl(None, picks="fast") if not os.environ.get("OFFLOAD_IMPL") else "fast"
    'fast'
    """
    source = "impl"
    if impl is None:
        impl, source = os.environ.get("OFFLOAD_IMPL") or None, "OFFLOAD_IMPL"
    if impl is None:
        return picks or ("fast" if torch.cuda.is_available() else "ref")
    if impl not in IMPLS:
        raise ValueError(f"unknown {source} {impl!r}; valid implementations are: {', '.join(IMPLS)}")
    return impl


def resolve_device(device: Any) -> torch.device:
    """The compute device: CUDA (current device) when available and ``None`` given, else as named."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_device(device: Any) -> torch.device:
    """``device`` as a torch device, checked as :func:`resolve_device` checks it, without making
    a CUDA context (an integration checks its settings as it is built, before training begins).

    >>> check_device("cpu")
    device(type='cpu')
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device (try 'cuda', 'cuda:0' or 'cpu')") from e
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device {dev} is not supported: actoffload offloads from 'cuda' (or 'cpu' for testing)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {dev} asked for, but CUDA is not available here; use device='cpu'")
    return dev


def check_count(name: str, value: Any, least: int = 0) -> int:
    """An integer ``>= least``, as an ``int`` (``numpy.int64`` and other integer types too;
    bools are refused: ``True`` is not a count).

    >>> check_count("keep_last", 2)
    2
    """
    n = None
    if not isinstance(value, (bool, torch.Tensor)):  # (a one-element tensor is no setting)
        try:
            n = operator.index(value)
        except TypeError:
            pass
    if n is None or isinstance(n, bool) or n < least:  # (an __index__ may answer a bool)
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return n


def check_choice(name: str, value: Any, choices: tuple[str, ...], plural: str | None = None) -> str:
    """One of ``choices``; the error lists them (as "valid <plural> are: ...")."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid {plural or name + 's'} are: {', '.join(choices)}")
    return value


_MAX_BYTES = 1 << 63  # more than any machine holds: a larger size is a typo


def parse_bytes(name: str, value: Any) -> int:
    """Bytes from a number (an int, a whole float, or the like from NumPy or a one-element
    tensor; not a bool) or a string such as ``"60GiB"``, ``"512 MB"`` or ``"1e9"``; at most
    ``2**63`` bytes. A size in a unit is rounded down to whole bytes; bytes themselves must be
    whole (``"1.5"`` is refused).

    >>> parse_bytes("memory_budget", "1.5GiB")
    1610612736
    """
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"{name} must be a number of bytes or a size such as '60GiB', got {value!r}")
    number = value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point:
        number = value.item()
    elif isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        number = float(value)  # numpy.float32 and the like, as a float is
    if isinstance(number, float):
        if not number.is_integer():  # also inf and nan
            raise ValueError(f"{name} must be a whole number of bytes or a size such as '60GiB', got {value!r}")
        n = int(number)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([+-]?)([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(3).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{name} {value!r} is not a size; write bytes as a number or with a unit: "
                "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
            )
        digits = m.group(2).lstrip("0") or "0"
        if digits.isdigit():  # exact, and checked for length before int() reads it
            n = int(digits) * _UNITS[unit] if len(digits) <= 30 else _MAX_BYTES + 1
        else:  # a fraction or an exponent: float() gives inf rather than raise when it overflows
            x = float(m.group(2)) * _UNITS[unit]
            if _UNITS[unit] == 1 and math.isfinite(x) and not x.is_integer():  # a size in a unit may round; bytes may not
                raise ValueError(f"{name} must be a whole number of bytes or a size such as '60GiB', got {value!r}")
            n = int(x) if math.isfinite(x) and x <= _MAX_BYTES else _MAX_BYTES + 1
        if m.group(1) == "-":
            n = -n  # (refused below as not positive, where "-1" read as no size at all)
    else:
        try:
            n = operator.index(value)  # int, numpy.int64, an integer tensor of one element
        except TypeError:
            raise ValueError(f"{name} must be a number of bytes or a size such as '60GiB', got {value!r}") from None
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if n > _MAX_BYTES:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{name} {shown} is too large: a size is at most 2**63 bytes")
    return n


# memory_budget="auto": this share of the device's memory. The budget bounds what PyTorch's
# caching allocator reserves during a step; the tenth left over is for what grows outside the
# allocator while training runs (the CUDA context loading kernels at their first use, NCCL's
# buffers at the first collective) and for the allocator's share before it has been measured.
AUTO_FRACTION = 0.9


def parse_memory_budget(name: str, value: Any, of: str = "the device's memory") -> int | str:
    """A memory budget: bytes (:func:`parse_bytes`), or a share of memory (``of``: whose, for the
    errors), as ``"auto"`` or a percentage such as ``"90%"`` (more than 0, at most 100), returned
    as the string, normalized, for :func:`memory_fraction` and :func:`budget_of` once the
    memory is known (a device's at the first step).

    >>> parse_memory_budget("memory_budget", "1GiB"), parse_memory_budget("memory_budget", " 85.5 % ")
    (1073741824, '85.5%')
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.endswith("%"):
            number = text[:-1].strip()
            try:
                share = float(number)
            except ValueError:
                share = math.nan
            if not math.isfinite(share) or not 0 < share <= 100:
                raise ValueError(f"{name} {value!r} is not a share of {of}: write a percentage "
                                 "above 0 and at most 100, such as '90%', or 'auto'")
            return f"{number}%"
    try:
        return parse_bytes(name, value)
    except ValueError as e:
        if isinstance(value, str):
            raise ValueError(f"{e}; or a share of {of}: 'auto' or a percentage such as '90%'") from None
        raise


def device_memory(device: torch.device) -> int:
    """All the memory of ``device``: a GPU's, or on the CPU the machine's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_fraction(spec: int | str) -> float | None:
    """The share of the device's memory a parsed budget asks for (``None``: it is bytes)."""
    if isinstance(spec, int):
        return None
    return AUTO_FRACTION if spec == "auto" else float(spec[:-1]) / 100


def budget_of(name: str, spec: int | str, total: int, outside: int) -> int:
    """Bytes a parsed budget means on a device of ``total`` bytes where ``outside`` bytes are
    held outside this process's PyTorch allocator (other processes, CUDA contexts, NCCL's
    buffers): ``fraction * total - outside``; a number of bytes stands as given.

    >>> budget_of("memory_budget", "auto", total=80 << 30, outside=2 << 30) / 2**30
    70.0
    """
    fraction = memory_fraction(spec)
    if fraction is None:
        assert isinstance(spec, int)
        return spec
    share = int(fraction * total)
    n = share - outside
    if n <= 0:
        held = (f", and {outside:,} are held outside this process's allocator (other processes, CUDA contexts)"
                if outside else "")
        raise ValueError(f"{name}={spec!r} leaves nothing: {spec} of the device's {total:,} bytes is {share:,}{held}; "
                         f"give a larger share or a size in bytes{', or free the device' if outside else ''}")
    return n
