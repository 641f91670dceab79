"""The offload policy: the one piece of code that decides what moves (rules R3, R4, R5).

Both implementations call :func:`plan_group` when a group is committed and do
exactly what the plan says. Having two copies of this logic is how another
project's ``mark_not_offload`` became a silent no-op in one of its two paths.

A group's saved buffers are judged per storage: aliases (views, transposes,
``detach()``) of one storage are judged once and, if eligible, the byte span they
cover moves in one piece; every alias is rebuilt from that copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import compat, marks
from .spans import largest_within

# Reported when several apply: the first in this order.
REASONS = ("device", "parameter", "vetoed", "not_marked", "freed", "small", "alias", "keep_last", "budget", "inert")
POLICIES = ("all", "marked")

try:  # fake tensors carry a device but no data
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # pragma: no cover - older torch
    _FakeTensor = ()  # type: ignore[assignment,misc]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass(slots=True)
class Span:
    """One storage's byte range ``[start, start + nbytes)`` that moves as one copy.

    ``members`` index the group's saved buffers that are rebuilt from it; the first
    is counted as offloaded, the others as ``alias``. ``start`` is aligned down to
    the largest element size among the members, so every member's offset inside the
    span is a whole number of its elements.
    """

    storage_key: int
    start: int
    nbytes: int
    members: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SavePlan:
    """What to do with each saved buffer of a group.

    ``reasons[i]`` is ``None`` for the buffer counted as offloaded and a reason from
    :data:`REASONS` for every other one; ``spans`` lists what moves now, ``shared`` the
    storages an earlier group already moved (their members come back from that copy).
    """

    reasons: list[str | None]
    spans: list[Span]
    shared: list[Span] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)  # span index -> the op role that selected it
    stayed: list[tuple[str, int]] = field(default_factory=list)  # (reason, bytes) of each storage kept

    def summary(self) -> dict:
        kept: dict[str, int] = {}
        offloaded = 0
        for r in self.reasons:
            if r is None:
                offloaded += 1
            else:
                kept[r] = kept.get(r, 0) + 1
        moved = 0
        for s in self.spans:
            moved += s.nbytes
        out = {"saved": len(self.reasons), "offloaded": offloaded, "offloaded_bytes": moved, "kept": kept}
        if self.roles:
            by_role: dict[str, int] = {}
            for i, role in self.roles.items():
                by_role[role] = by_role.get(role, 0) + self.spans[i].nbytes
            out["offloaded_bytes_by_role"] = by_role
        return out


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``(first, end)`` bytes of ``t``'s storage that ``t`` can touch; ``first == end`` if empty."""
    es = t.element_size()
    offset = int(t.storage_offset())
    if t.numel() == 0:
        return offset * es, offset * es
    last = offset
    for n, stride in zip(t.shape, t.stride()):
        last += (int(n) - 1) * int(stride)
    return offset * es, (last + 1) * es


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a leaf that requires grad, or a view of one.

    (A tensor over a known parameter's storage without being a view of it, such as
    ``weight.detach().t()``, is recognised by its storage's mark in :func:`plan_group`.)
    ``F.linear`` saves ``weight.t()``, a view, not the Parameter. A leaf that requires
    grad (a parameter not wrapped in ``nn.Parameter``, an input the caller asked the
    gradient of) is held by autograd's AccumulateGrad node for as long as the graph
    lives, so moving it would cost bus time and free nothing.
    """
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def movable_kind(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor whose bytes can be moved and rebuilt exactly: a plain
    strided tensor with real data of its own (not meta, fake, nested, sparse, quantized,
    a ZeroTensor, or a tensor subclass; a forward-mode tangent is kept by autograd itself,
    beside the saved primal, so dual tensors move like any other)."""
    if type(t) not in _PLAIN_TYPES or t.layout != torch.strided or t.is_meta or t.is_nested:
        return False
    if t.is_quantized or isinstance(t, _FakeTensor) or compat.is_zero_tensor(t):
        return False
    try:
        compat.storage_key(t)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is movable (:func:`movable_kind`) and its data is on ``device``."""
    if t.device.type != device.type or not movable_kind(t):
        return False
    if device.index is None or t.device.index is None:
        return True
    return t.device.index == device.index


@dataclass(slots=True)
class SavedFact:
    """What the policy needs to know of one saved buffer, taken while it is alive (treat it
    as immutable: not frozen only because one is made for every saved buffer at every
    commit, and a frozen dataclass takes four times as long to make).

    ``key`` is its storage's identity, ``None`` when it cannot move at all (reason
    ``device``); ``[start, end)`` the bytes of that storage it can touch; ``storage_bytes``
    the storage's size when the fact was taken (``None``: not known), smaller than ``end``
    where the caller freed it (``untyped_storage().resize_(0)``).
    """

    key: int | None
    start: int = 0
    end: int = 0
    element_size: int = 1
    parameter: bool = False
    storage_bytes: int | None = None


_UNMOVABLE = SavedFact(None)


def fact_of(t: torch.Tensor | None, device: torch.device, parameter: bool | None = None) -> SavedFact:
    """The :class:`SavedFact` of ``t`` (``parameter``: as recorded at save time, when ``t``
    is a ``detach()``ed alias that no longer tells). What :func:`on_device` and
    :func:`byte_extent` say, each property read once: this runs for every saved buffer."""
    if t is None or type(t) not in _PLAIN_TYPES:
        return _UNMOVABLE
    d = t.device
    if d != device and (d.type != device.type or (device.index is not None and d.index is not None)):
        return _UNMOVABLE  # (equal unless one of them has no index: cuda vs cuda:0)
    # (a meta tensor is on no compute device: the check above left it out)
    if t.layout is not torch.strided or t.is_nested or t.is_quantized or compat.is_zero_tensor(t):
        return _UNMOVABLE
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return _UNMOVABLE
    es = t.element_size()
    offset: int = t.storage_offset()  # type: ignore[assignment]  # (real tensors only: never symbolic)
    if t.is_contiguous():  # (most saves) its elements are one run, whatever the strides of size-1 dims
        end = offset + t.numel()
    elif t.numel() == 0:
        end = offset
    else:
        end = offset + 1
        for n, stride in zip(t.shape, t.stride()):
            end += (n - 1) * stride
    return SavedFact(compat.storage_id(storage), offset * es, end * es, es,
                     is_parameter(t) if parameter is None else parameter, storage.nbytes())


def plan_group(
    tensors: Sequence[torch.Tensor | None],
    *,
    parameters: Sequence[bool] | None = None,
    device: torch.device,
    **decisions: Any,
) -> SavePlan:
    """Decide, for one group, which saved buffers move and why the others stay: the
    :class:`SavedFact` of each tensor, judged by :func:`plan_facts` (``decisions`` are its
    keyword arguments).

    ``parameters[i]`` says whether ``tensors[i]`` is a parameter or a view of one; by
    default :func:`is_parameter` tells (callers holding ``detach()``ed aliases must
    record it before detaching). ``None`` entries are buffers no longer held.

    >>> x = torch.randn(1024, 1024)
    >>> plan = plan_group([x, x.t(), torch.ones(3)], device=torch.device("cpu"),
    ...                   min_offload_bytes=1024, policy="all", committed=True)
    >>> plan.reasons
    [None, 'alias', 'small']
    """
    flags = [None] * len(tensors) if parameters is None else list(parameters)
    return plan_facts([fact_of(t, device, p) for t, p in zip(tensors, flags)], **decisions)


def held_by_marks(flags: int, policy: str) -> str | None:
    """Why the marks on a storage (``flags``) keep it on the device under ``policy``: R4's veto
    (``"vetoed"``), or R3's ``policy="marked"`` without an opt-in (``"not_marked"``); ``None``
    where they let it move.

    >>> held_by_marks(0, "all"), held_by_marks(0, "marked"), held_by_marks(marks.VETO | marks.OPT_IN, "all")
    (None, 'not_marked', 'vetoed')
    """
    if flags & marks.VETO:
        return "vetoed"
    if policy == "marked" and not flags & marks.OPT_IN:
        return "not_marked"
    return None


HELD_BY_MARKS = ("vetoed", "not_marked")  # the reasons held_by_marks gives


def plan_facts(
    facts: Sequence[SavedFact],
    *,
    min_offload_bytes: int,
    policy: str,
    committed: bool,
    moved_earlier: Callable[[int, list[SavedFact]], bool] | None = None,
    move_at_most: int | None = None,
    flags_of: Callable[[int], int] | None = None,
) -> SavePlan:
    """Decide, for one group's saved buffers, which move and why the others stay.

    Buffers are judged per storage (R5): a storage with any parameter alias stays
    (``parameter``), then the marks (``vetoed``, ``not_marked``), then a storage now smaller
    than the span (``freed``: the caller resized it, to refill it before backward; copying
    it would read bytes it no longer has, and ``set_`` would silently grow it back with
    uninitialised memory), then the size of the span the aliases cover (``small``).
    ``committed=False`` plans a group whose backward began before its commit (or that is
    still waiting for it): whatever would move is kept with reason ``keep_last``. ``moved_earlier(key, aliases)`` tells whether an earlier group's
    copy of that storage can serve these aliases; if so they come back from it and count
    as ``alias`` (the bytes were counted by the group that moved them). ``move_at_most``
    (a memory plan's share for this group) moves the largest spans whose bytes add up to
    at most that many; the rest stay with reason ``budget``. ``flags_of(key)``: the marks on a
    storage (by default :func:`marks.flags_of`, as they are now; a caller whose storages are
    gone passes what it read while they lived).
    """
    if flags_of is None:
        flags_of = marks.flags_of
    reasons: list[str | None] = [None] * len(facts)
    by_storage: dict[int, list[int]] = {}
    for i, f in enumerate(facts):
        if f.key is None:
            reasons[i] = "device"
        elif f.key in by_storage:
            by_storage[f.key].append(i)
        else:
            by_storage[f.key] = [i]

    plan = SavePlan(reasons, [])
    # the spans that may move: all of them move unless the plan's share caps them
    eligible = plan.spans if move_at_most is None else []
    for key, members in by_storage.items():
        flags = flags_of(key)
        if len(members) == 1:
            start, end = facts[members[0]].start, facts[members[0]].end
        else:
            align = max(facts[i].element_size for i in members)
            start = min(facts[i].start for i in members) // align * align
            end = max(facts[i].end for i in members)
        reason: str | None
        if flags & marks.PARAMETER or (facts[members[0]].parameter if len(members) == 1
                                        else any(facts[i].parameter for i in members)):
            reason = "parameter"
        elif (held := held_by_marks(flags, policy)) is not None:
            reason = held
        elif (size := facts[members[0]].storage_bytes) is not None and end > size:
            reason = "freed"
        elif end - start < min_offload_bytes:
            reason = "small"
        elif not committed:
            reason = "keep_last"
        elif moved_earlier is not None and moved_earlier(key, [facts[i] for i in members]):
            plan.shared.append(Span(key, start, end - start, members))
            reason = "alias"
        else:
            eligible.append(Span(key, start, end - start, members))
            continue
        for i in members:
            reasons[i] = reason
        plan.stayed.append((reason, end - start))

    if move_at_most is not None:  # the plan's share: the largest spans that fit (one rule: spans.py)
        taken = set(largest_within([sp.nbytes for sp in eligible], move_at_most))
        for k in sorted(range(len(eligible)), key=lambda k: -eligible[k].nbytes):
            if k in taken:
                plan.spans.append(eligible[k])
                continue
            for i in eligible[k].members:
                reasons[i] = "budget"
            plan.stayed.append(("budget", eligible[k].nbytes))
    for k, span in enumerate(plan.spans):
        if (role := marks.role_of(span.storage_key)) is not None:
            plan.roles[k] = role
        for i in span.members[1:]:
            reasons[i] = "alias"
    return plan
