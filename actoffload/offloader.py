"""``ao.Offloader``: the public type, its settings, and the choice of implementation."""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, ClassVar

import torch

from . import compat, graph
from .engine import Engine, GroupT, MovedT
from .hostmem import HostAllocator, HostMemory, exact_host_allocator, host_budget_of
from .observe import Observer
from .plans import Plan
from .policy import POLICIES
from .settings import IMPLS, check_choice, check_count, parse_memory_budget, resolve_device, resolve_impl

_CLASSES = {"ref": "actoffload.ref:RefOffloader", "fast": "actoffload.fast:FastOffloader"}


def implementation(name: str) -> type[Offloader]:
    """The class of the implementation ``name`` (``"ref"`` or ``"fast"``)."""
    module, _, cls = _CLASSES[resolve_impl(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


def _setting_names(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                names.add(p.name)
    return names


# Settings that pick their implementation where none is named (``impl`` left out and no
# $OFFLOAD_IMPL): a memory budget is fast's plan, and fast runs on the CPU too. Given as
# ``None``, their default, they are not given: ``memory_budget=args.budget`` with no budget
# picks nothing, and any implementation takes it.
PICKS = {"memory_budget": "fast"}


def _unset(name: str, value: Any) -> bool:
    """Whether setting ``name`` given as ``value`` counts as not given (see :data:`PICKS`)."""
    return value is None and name in PICKS


def _picked(settings: dict[str, Any]) -> str | None:
    """The implementation the given settings pick (:data:`PICKS`), if any.

    >>> _picked({"memory_budget": "auto"}), _picked({"memory_budget": None}), _picked({})
    ('fast', None, None)
    """
    return next((PICKS[name] for name, value in settings.items() if name in PICKS and not _unset(name, value)), None)


def _of_another(name: str, other: str, impl: str, named: str | None) -> str:
    """The error for a setting ``name`` of implementation ``other`` given to ``impl`` (``named``:
    the ``impl`` argument; ``None``: it came from $OFFLOAD_IMPL or the default): whose it is,
    and what to do."""
    said = f"{name} is a setting of the {other!r} implementation; impl {impl!r} does not take it: "
    from_env = named is None and bool(os.environ.get("OFFLOAD_IMPL"))  # (else the default chose it)
    if from_env and PICKS.get(name) == other:  # it would have picked its own, but for $OFFLOAD_IMPL
        return said + f"$OFFLOAD_IMPL is {impl!r}; pass impl={other!r} or unset OFFLOAD_IMPL"
    if from_env:
        return said + f"$OFFLOAD_IMPL is {impl!r}; pass impl={other!r} or set OFFLOAD_IMPL={other}"
    if PICKS.get(name) == other:
        return said + f"pass impl={other!r} or leave impl out"
    return said + f"pass impl={other!r}"


class ObserverHandle:
    """Returned by :meth:`Offloader.add_observer`; ``remove()`` stops the events (also as a
    context manager)."""

    def __init__(self, observers: list[Observer], observer: Observer):
        self._observers = observers
        self._observer = observer

    def remove(self) -> None:
        if self._observer in self._observers:
            self._observers.remove(self._observer)

    def __enter__(self) -> ObserverHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class GroupContext:
    """Context manager returned by :meth:`Offloader.group`."""

    __slots__ = ("_offloader", "_name", "_recomputable", "_parts", "_inputs", "_compiled", "_group")

    def __init__(self, offloader: Offloader, name: str, recomputable: bool = False, parts: int = 0,
                 inputs: int = 0, compiled: bool = False):
        self._offloader = offloader
        self._name = name
        self._recomputable = recomputable  # ao.wrap's groups: the module can be run again
        self._compiled = compiled  # ... and runs compiled code: never under a dispatch mode
        # ao.wrap's modules given with parts: a group only when run whole, saving ``inputs`` bytes
        self._parts, self._inputs = parts, inputs
        self._group: Any = None  # the group it opened, until it closes

    def open(self) -> GroupContext:
        """``__enter__`` for callers already kept out of ``torch.compile`` (``ao.wrap``)."""
        self._group = self._offloader._enter(self._name, self._recomputable, self._parts, self._inputs,
                                             self._compiled)
        return self

    __enter__ = compat.not_traced(open)

    @property
    def opened(self) -> bool:
        """Whether entering opened a group (not inside a recomputation, or a module run whole)."""
        return self._group is not None

    @property
    def recompute(self) -> bool:
        """Whether a memory plan runs this group under activation checkpointing."""
        return self._group is not None and self._group.recompute

    def called_with(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The module whose group this is was called with ``args`` and ``kwargs``: where the
        group before made the first tensor among them with an autograd history, and this group's
        first save with a history is made from it directly, prefetch knows from it when backward
        reaches that group (only where it looks for that: reading a tensor's ``grad_fn`` gives
        its node a Python object, graph.py)."""
        if self._group is None or not self._group.link_tries:
            return
        made = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_leaf), None)
        if made is not None:
            graph.note_input(self._group, made)

    def inputs_written(self) -> None:
        """The recomputed module wrote a tensor it was called with in place in its forward,
        after checkpoint saved it: its recomputation cannot read what the forward read (R6
        says so in backward, and no copy made after the write stands for it)."""
        if self._group is not None:
            self._group.wrote_inputs = True

    def checkpoint_contexts(self) -> tuple[Any, Any]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` when :attr:`recompute`."""
        return self._offloader._checkpoint_contexts(self._group)

    def close(self, failed: bool) -> None:
        """``__exit__`` for callers already kept out of ``torch.compile``."""
        group, self._group = self._group, None
        if group is None and self._parts:
            self._offloader.plan.whole_closed(self._parts)
        self._offloader._exit(group, failed=failed)

    @compat.not_traced
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(failed=exc_type is not None)


class Offloader(Engine[GroupT, MovedT]):
    """Moves the activations autograd saves inside groups to host memory, and back for backward.

    ``ao.Offloader(...)`` builds the implementation ``impl`` names and returns it; every
    implementation is an ``ao.Offloader`` (``isinstance`` works, and annotations can use it).

    Settings of every implementation (each is checked here, before any work):

    - ``impl``: ``"ref"`` (plain, synchronous: the reference) or ``"fast"`` (copy streams,
      pinned pool, packed copies, prefetch); ``None`` reads ``$OFFLOAD_IMPL``, else picks
      ``"fast"`` where a ``memory_budget`` is given (a setting of ``fast`` only; it runs on
      the CPU too), else ``"fast"`` with CUDA and ``"ref"`` without.
    - ``device``: the compute device whose saved tensors move (default: the current CUDA
      device, else the CPU, where host memory stands in for device memory).
    - ``min_offload_bytes`` (default 1 MiB): smaller saved tensors stay; moving them costs
      more in per-copy overhead than the memory is worth.
    - ``policy``: ``"all"`` offloads every eligible saved tensor, ``"marked"`` only those
      opted in with :func:`actoffload.mark_activation_offload` (or a role selection).
    - ``keep_last`` (default 1): the last groups of a forward stay on the device, because
      backward needs them first; each costs its activations in device memory and saves
      their round trip over the bus.
    - ``host_budget``: the most host memory (bytes, a size such as ``"64GiB"``, or a share
      of this machine's RAM such as ``"50%"``, divided among its ranks) this offloader may
      hold; a commit that would exceed it raises :class:`actoffload.HostMemoryError` and the
      group stays resident (with a ``memory_budget``, what does not fit stays, and nothing is
      raised). Default (``None`` or ``"auto"``): 80% of this machine's RAM
      divided among its ranks (``LOCAL_WORLD_SIZE``). A share that leaves under 1 MiB, or a
      ``LOCAL_WORLD_SIZE`` that is no whole number of at least 1, raises ``ValueError`` here.
    - ``host_allocator``: ``allocator(nbytes, pinned) -> uint8 CPU tensor``, where host
      buffers come from (default: ``fast`` pins exactly what its pool keeps; ``ref``, which
      allocates every step, takes PyTorch's cached pinned memory).
    - ``plan``: an :class:`actoffload.Plan`, what each group does (default: offload every
      group as the policy says); see :mod:`actoffload.plans`.

    ``fast`` adds ``max_inflight``, ``prefetch``, ``pack_below``, ``packer``, ``warmup`` and
    ``memory_budget``; see
    :class:`actoffload.fast.FastOffloader`. A setting of the other implementation is
    refused with a message that says so.

    Example::

        import torch
        import actoffload as ao

        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        off = ao.Offloader(min_offload_bytes=0)
        with ao.wrap(model, off):                  # each layer is one group
            model(torch.randn(512, 1024)).sum().backward()
        print(off.stats()["offloaded_bytes"])      # what the latest forward moved
    """

    impl: ClassVar[str] = "base"

    def __new__(cls, impl: str | None = None, **settings: Any):
        if cls is Offloader:
            chosen = impl or resolve_impl(None, picks=_picked(settings))
            cls = implementation(chosen)
            known = _setting_names(cls)
            for name, value in settings.items():
                if name in known or _unset(name, value):
                    continue
                others = [i for i in IMPLS if i != cls.impl and name in _setting_names(implementation(i))]
                if others:
                    raise TypeError(_of_another(name, others[0], cls.impl, impl))
                raise TypeError(f"unknown setting {name!r}; valid ones for impl {cls.impl!r} are: "
                                f"{', '.join(sorted(known))}")
        return super().__new__(cls)

    def __init__(
        self,
        impl: str | None = None,
        *,
        device: Any = None,
        min_offload_bytes: int = 1 << 20,
        policy: str = "all",
        keep_last: int = 1,
        host_budget: int | str | None = None,
        host_allocator: HostAllocator | None = None,
        plan: Plan | None = None,
        **others: Any,
    ):
        others = {name: value for name, value in others.items() if not _unset(name, value)}
        if others:  # ao.Offloader(...) names whose setting it is; a class built directly lands here
            raise TypeError(f"{type(self).__name__} takes no setting {', '.join(sorted(others))}")
        if impl is not None and resolve_impl(impl) != self.impl:
            raise ValueError(f"{type(self).__name__} is the {self.impl!r} implementation, not {impl!r}; "
                             f"use ao.Offloader(impl={impl!r})")
        dev = resolve_device(device)
        budget = host_budget_of("auto" if host_budget is None else
                                parse_memory_budget("host_budget", host_budget, of="this host's memory"))
        if host_allocator is not None and not callable(host_allocator):
            raise TypeError(f"host_allocator must be callable as allocator(nbytes, pinned), got {host_allocator!r}")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be an ao.Plan (a subclass of it), got {type(plan).__name__}")
        super().__init__(
            dev,
            check_count("min_offload_bytes", min_offload_bytes),
            check_choice("policy", policy, POLICIES, "policies"),
            check_count("keep_last", keep_last),
            HostMemory(host_allocator or self._default_host_allocator(), pinned=dev.type == "cuda", budget=budget),
            Plan() if plan is None else plan,
        )

    def _default_host_allocator(self) -> HostAllocator:
        """Where host buffers come from unless the user injects an allocator."""
        return exact_host_allocator

    # ------------------------------------------------------------------ public API
    def group(self, name: str) -> GroupContext:
        """A unit of saved activations offloaded and reloaded together (R2).

        Example::

            off = ao.Offloader()
            for i, block in enumerate(blocks):
                with off.group(f"block{i}"):
                    x = block(x)
            x.sum().backward()
        """
        if not isinstance(name, str):
            raise TypeError(f"group name must be a str, got {type(name).__name__}")
        return GroupContext(self, name)

    def stats(self) -> dict[str, Any]:
        """What the groups opened since a backward pass last began did, and host memory now.

        Groups are keyed by name; a name opened again before the next backward (a block
        called twice, or micro-batches' forwards run back to back) appears as ``name#2``,
        ``name#3``, ... so every group counts once.

        Example::

            s = off.stats()
            s["groups"]["block0"]   # {'saved': 7, 'offloaded': 5, 'offloaded_bytes': ..., 'kept': {'parameter': 2}}
            s["host_bytes_in_use"]  # 0 once every graph is freed
        """
        return self._stats()

    def synchronize(self) -> None:
        """Block until every copy out has finished and released its source (a no-op for ``ref``,
        whose copies are synchronous)."""

    def add_observer(self, observer: Observer) -> ObserverHandle:
        """Send this offloader's events to ``observer`` until the returned handle's ``remove()``.

        Example::

            handle = off.add_observer(my_observer)   # an ao.Observer subclass
            ...
            handle.remove()
        """
        if not isinstance(observer, Observer):
            raise TypeError(f"add_observer takes an ao.Observer, got {type(observer).__name__}")
        self._observers.append(observer)
        return ObserverHandle(self._observers, observer)

    @property
    def settings(self) -> dict[str, Any]:
        """Every setting as it is in effect (defaults resolved)."""
        return {"device": str(self.device), "min_offload_bytes": self.min_offload_bytes, "policy": self.policy,
                "keep_last": self.keep_last, "host_budget": self.host_budget}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"
