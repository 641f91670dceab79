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
budget alive sets it, as a share of the memory its device allows, and once no budget's offloader
is alive the user's settings and fractions are back. The user's settings are those torch holds
as the first budget sets its own (from ``PYTORCH_CUDA_ALLOC_CONF`` or its alternatives, or set at
runtime), or, on a torch that cannot say, the variable it reads. A threshold the user set is left
as it is, as is an allocator other than PyTorch's native one (``backend:cudaMallocAsync``), and
expandable segments (``expandable_segments:True``), which PyTorch never collects; settings torch
refuses at runtime leave everything as it was.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable, NamedTuple

import torch

_SETTING = "garbage_collection_threshold"
# where a torch that cannot say what it holds (2.11) read its settings: the first of these set (if empty)
_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_ASYNC = ("cudaMallocAsync", "hipMallocAsync")  # the device's own allocators, which take no threshold
_ROUNDING = 2 << 20  # the allocator's rounding of large blocks


class _Setting(NamedTuple):
    device: int  # its index
    fraction: float  # the memory fraction it needs there
    threshold: str


_live: dict[int, _Setting] = {}  # the settings of the budgets alive, by the order they were made
_users_fraction: dict[int, float] = {}  # each device's fraction before a budget changed it
_users_settings: str | None = None  # the allocator's settings before a budget alive changed them
_made = 0


def reclaim_above(device: torch.device, budget: int, owner: object = None) -> str:
    """Have the caching allocator of ``device`` give back idle cached blocks before what it
    holds grows past ``budget`` bytes, while ``owner`` (the budget's) lives; what was done, in
    words (``stats()["plan"]``).

    Example::

        reclaim_above(torch.device("cuda"), 20 << 30, owner)   # 'threshold 0.143 of 140.0 GiB'
    """
    if device.type != "cuda":
        return "not a CUDA device"
    conf = _users_conf()
    options = _options(conf)
    if _SETTING in options:
        return f"the user's {_SETTING}"
    if options.get("backend") in _ASYNC:
        return "not PyTorch's native allocator"
    if options.get("expandable_segments") == "True":
        # PyTorch collects no expandable segment; and told to collect, the decoder's steps ran
        # slower at the same plans (median 49 ms against 34 at 512 tokens on an H200)
        return "expandable segments, which the allocator does not collect"
    fraction_of = getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    if fraction_of is None or _configure() is None:
        return f"this torch ({torch.__version__}) cannot set it"
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    users = _users_fraction[index] if index in _users_fraction else float(fraction_of(index))
    # The allocator collects only under a memory fraction below 1 (at 1.0, PyTorch's default,
    # it never did on an H200 with torch 2.11): the user's, or one block of the allocator's
    # rounding (2 MiB) under the whole device.
    fraction = min(users, 1.0 - _ROUNDING / total)
    allowed = fraction * total
    if budget >= allowed:
        return "the budget is all the memory the allocator may use"
    global _made, _users_settings
    _made += 1
    made = _made
    _users_fraction.setdefault(index, users)
    if not _live:
        _users_settings = conf  # (read from torch: what the budgets' settings will replace)
    # (torch's parser takes no exponent; a byte of a terabyte is not 0)
    _live[made] = _Setting(index, fraction, f"{budget / allowed:.12f}")
    try:
        _apply()
    except (RuntimeError, ValueError) as e:  # a setting of the user's that holds only before CUDA starts, say
        _forget(made)
        return f"torch refused the settings: {e}"
    if owner is not None:
        weakref.finalize(owner, _forget, made).atexit = False
    return f"threshold {float(_live[made].threshold):.3f} of {allowed / 2**30:.1f} GiB"


def _users_conf() -> str:
    """The allocator settings the user gave torch: as they were before the budgets alive set
    theirs; else what torch holds now; else, on a torch that cannot say, the variable it read."""
    if _users_settings is not None:
        return _users_settings
    holds = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if holds is not None:
        return str(holds())
    return next((os.environ[name] for name in _CONF_VARS if name in os.environ), "")


def _items(conf: str) -> list[str]:
    """``conf``'s settings as given, none empty (torch reads a lone comma as a key)."""
    return [item for item in conf.split(",") if item.strip()]


def _options(conf: str) -> dict[str, str]:
    """``conf``'s settings by name (``"expandable_segments:True,backend:native"``)."""
    pairs = (item.split(":", 1) for item in _items(conf))
    return {pair[0].strip(): pair[-1].strip() for pair in pairs}


def _configure() -> Callable[[str], None] | None:
    return (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            or getattr(torch.cuda.memory, "_set_allocator_settings", None))  # (deprecated in torch 2.11)


def _apply() -> None:
    """The latest live budget's threshold over the user's settings (read whole each time: what a
    call leaves out goes back to torch's default), or the user's alone; on each device, the
    fraction a live budget there needs, or the user's."""
    global _users_settings
    conf, latest = _users_conf(), _live[max(_live)] if _live else None
    if latest is None:
        _users_settings = None  # (the user's are set back below, or left as torch refused them)
    configure = _configure()
    assert configure is not None
    # (no empty item: torch would read a lone comma as a key, and the threshold as its value)
    configure(",".join(_items(conf) + ([f"{_SETTING}:{latest.threshold}"] if latest else [])))
    for index, users in list(_users_fraction.items()):
        needs = [s.fraction for s in _live.values() if s.device == index]
        torch.cuda.set_per_process_memory_fraction(min(needs) if needs else users, index)
        if not needs:
            _users_fraction.pop(index, None)  # (a budget let go while this ran may have set it back)


def _forget(made: int) -> None:
    """The budget whose setting was ``made`` was let go (or its setting refused)."""
    if _live.pop(made, None) is not None:
        try:
            _apply()
        except (RuntimeError, ValueError):
            pass  # (what the user's own settings are refused at runtime stays as torch left it)
