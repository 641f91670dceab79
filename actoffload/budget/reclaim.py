"""The caching allocator told where the budget is, so that it gives idle blocks back before
it grows past it.

What goes over a budget is most often the cache, not the step: a plan's first steps on blocks
that other plans or other lengths left, too large or too small for it, which the allocator keeps
while it asks the device for more (docs/budgets.md, "The reserve on a GPU"). PyTorch's
allocator can give back idle blocks itself, without the device-wide synchronization of
``torch.cuda.empty_cache``: with ``garbage_collection_threshold`` set, whenever it is about
to ask the device for a new block while it holds more than that share of the memory it may
use, it frees cached blocks no tensor uses (whole ones, the least recently used first) until it
is back under. With the threshold at the budget, a step on a cache built for something else
takes that cache's idle blocks back before it takes new memory past the budget. It is a soft
bound: the block asked for is still granted, and blocks of which a part is in use stay; the
hard limit (``set_per_process_memory_fraction``) stays as it was (but for 2 MiB under the
whole device, where it was the whole device: the allocator collects only under a limit), so a
step that needs more than its budget runs as it would have, not out of memory.

The threshold is a setting of the process's allocator, shared by every device: the latest
budget sets it, as a share of the memory its device allows, and once that budget's offloader
is let go the user's settings are back. A threshold the user set
(``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``) is left as it is, as is an allocator
other than PyTorch's native one (``backend:cudaMallocAsync``).
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

_SETTING = "garbage_collection_threshold"
_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_ROUNDING = 2 << 20  # the allocator's rounding of large blocks
_latest = 0  # the setting made last (each reclaim_above makes one)


def reclaim_above(device: torch.device, budget: int, owner: object = None) -> str:
    """Have the caching allocator of ``device`` give back idle cached blocks before what it
    holds grows past ``budget`` bytes, until ``owner`` (the budget's) is let go, where it is
    the latest to have set it; what was done, in words (``stats()["plan"]``).

    Example::

        reclaim_above(torch.device("cuda"), 20 << 30, owner)   # 'threshold 0.143 of 140.0 GiB'
    """
    if device.type != "cuda":
        return "not a CUDA device"
    conf = ",".join(v for v in (os.environ.get(name, "") for name in _CONF_VARS) if v)
    if _SETTING in conf:
        return f"the user's {_SETTING}"
    if "cudaMallocAsync" in conf:
        return "not PyTorch's native allocator"
    fraction_of = getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    configure = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                 or getattr(torch.cuda.memory, "_set_allocator_settings", None))  # (deprecated in torch 2.11)
    if fraction_of is None or configure is None:
        return f"this torch ({torch.__version__}) cannot set it"
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    # The allocator collects only under a memory fraction below 1 (at 1.0, PyTorch's default,
    # it never did on an H200 with torch 2.11): the one in force, or one block of the
    # allocator's rounding (2 MiB) under the whole device.
    fraction = min(float(fraction_of(index)), 1.0 - _ROUNDING / total)
    allowed = fraction * total
    threshold = f"{budget / allowed:.12f}"  # (torch's parser takes no exponent; a byte of a TB is not 0)
    if budget >= allowed:
        return "the budget is all the memory the allocator may use"
    before = float(fraction_of(index))
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    try:  # its settings are read whole each time: the user's, then the threshold
        configure(",".join(v for v in (conf, f"{_SETTING}:{threshold}") if v))
    except RuntimeError as e:  # (a setting of the user's that only holds before CUDA starts, say)
        torch.cuda.set_per_process_memory_fraction(before, index)
        return f"torch refused the settings: {e}"
    global _latest
    _latest += 1
    if owner is not None:
        weakref.finalize(owner, _restore, _latest, configure, conf, index, before).atexit = False
    return f"threshold {float(threshold):.3f} of {allowed / 2**30:.1f} GiB"


def _restore(setting: int, configure: Callable[[str], None], conf: str, index: int, fraction: float) -> None:
    """The budget that made ``setting`` was let go: the user's settings again, unless a later
    budget's stand."""
    if setting == _latest:
        configure(conf)  # (read whole: without a threshold, none)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
