"""Selective recomputation: a recomputed group that keeps the outputs of its costly ops
(matmuls, fused attention) from its forward, and in backward runs again only the cheap ones
(norms, activation functions, elementwise products) from them. The cheap ops hold a large
share of what a transformer layer saves for a few percent of its time: recomputing them frees
those bytes almost for nothing, where recomputing the whole layer costs its forward again.
At long sequences the other way round pays too: the fused attention is the layer's costliest
op while its outputs take what the layer's input does, so keeping only those
(``attention_only``, a budget's ``recompute_attention``; :func:`attention_policy` for torch's
own) spares most of a recomputation for about checkpointing's memory.

:func:`contexts` gives the pair of contexts a group runs its checkpoint under (a memory
budget's ``recompute_selective`` action); :class:`OpMeter` is what profiling measures of a
group to cost that action (the bytes the costly ops' outputs take, their time within the
recomputation). Both choose the calls kept with :func:`keeps`, as does :func:`sac_policy`, the
same choice for torch's own selective activation checkpointing (the benchmarks' alternative).

Example (what a memory budget does to a group it recomputes selectively)::

    import torch, torch.utils.checkpoint as cp
    from actoffload import selective

    layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(8, 64, requires_grad=True)
    y = cp.checkpoint(layer, x, use_reentrant=False, context_fn=selective.contexts)
    y.sum().backward()          # the matmuls' outputs came from the forward; GELU ran again
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import compat, marks, policy

# the fused attention kernels (those this torch has): their outputs take what a layer's input
# takes, and at long sequences their forward is a layer's costliest op
ATTENTION_OPS = frozenset(getattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward") if hasattr(torch.ops.aten, name))
# ops whose outputs a selective recomputation keeps: the matmuls and the fused attention
# kernels; everything else is recomputed
COSTLY_OPS = ATTENTION_OPS | frozenset(getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution") if hasattr(torch.ops.aten, name))


class _Op(NamedTuple):
    """What is asked of every op a selective group's forward and recomputation run, worked out
    once per op overload from its schema: whether its outputs are kept (a costly op in
    functional form; ``attention``: a fused attention kernel, all that some groups keep), where
    its dropout probability is (position, name; ``None``: it has none), which arguments it
    writes in place (position, name), and whether an output may alias an input (a view,
    ``detach``; ``_unsafe_view``, which says not, does)."""

    costly: bool
    attention: bool
    dropout: tuple[int, str] | None
    writes: tuple[tuple[int, str], ...]
    aliases: bool


# by id of the op overload (its own hash is Python code; overloads live as long as the process)
_OPS: dict[int, _Op] = {}


def _op(func: Any) -> _Op:
    known = _OPS.get(id(func))
    if known is None:
        schema = getattr(func, "_schema", None)
        packet = getattr(func, "overloadpacket", func)
        arguments = list(schema.arguments) if schema is not None else []
        known = _OPS[id(func)] = _Op(
            costly=packet in COSTLY_OPS and schema is not None and not schema.is_mutable,
            attention=packet in ATTENTION_OPS and schema is not None and not schema.is_mutable,
            dropout=next(((i, a.name) for i, a in enumerate(arguments) if a.name == "dropout_p"), None),
            writes=tuple((i, a.name) for i, a in enumerate(arguments)
                         if a.alias_info is not None and a.alias_info.is_write),
            aliases=(schema is None or packet is torch.ops.aten._unsafe_view
                     or any(r.alias_info is not None for r in schema.returns)))
    return known


def is_costly(func: Any) -> bool:
    """Whether a selective recomputation keeps the outputs of ``func`` (an ATen op overload):
    a matmul or fused attention, in its functional form (an ``out=`` form writes a buffer the
    recomputation must write again)."""
    return _op(func).costly


def keeps(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a selective recomputation keeps the outputs of this call: a costly op that draws
    no random numbers (attention with ``dropout_p > 0`` does, on CUDA: skipped in the
    recomputation, it would shift the random numbers of every op after it)."""
    return _kept(_op(func), args, kwargs)


def _kept(op: _Op, args: Any, kwargs: dict[str, Any], attention_only: bool = False) -> bool:
    if not (op.attention if attention_only else op.costly):
        return False
    if op.dropout is None:
        return True
    i, name = op.dropout
    p = kwargs[name] if name in kwargs else args[i] if i < len(args) else 0.0
    return not p


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The same choice as :func:`keeps` for torch's selective activation checkpointing
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts(sac_policy)``)."""
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if keeps(op, args, kwargs) else policy.PREFER_RECOMPUTE


def attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """For torch's selective activation checkpointing: keep the fused attention's outputs only
    (as :func:`keeps` judges them), recompute everything else, the matmuls too. The attention's
    outputs take about what the layer's input does, and at long sequences its forward is the
    layer's costliest op, so this costs checkpointing's memory plus a layer input's per layer.

    Example::

        import functools, torch.utils.checkpoint as cp
        context = functools.partial(cp.create_selective_checkpoint_contexts, attention_policy)
        y = cp.checkpoint(layer, x, use_reentrant=False, context_fn=context)
    """
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if _kept(_op(op), args, kwargs, attention_only=True) else policy.PREFER_RECOMPUTE


# what an op's arguments hold besides tensors and their containers: nothing to walk into
_LEAVES = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                     torch.memory_format})


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs. Tuples, lists and dicts (what ATen ops
    take and give) are walked here, at every costly op of a selective group: pytree's walk took
    most of its host time; anything else is pytree's."""
    if type(tree) is torch.Tensor:  # most ops' output: no tree to walk
        return [tree]
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(tree: Any, out: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind in _LEAVES:
        return
    if kind is tuple or kind is list:
        for v in tree:
            _collect(v, out)
    elif kind is dict:
        for v in tree.values():
            _collect(v, out)
    elif isinstance(tree, torch.Tensor):
        out.append(tree)
    else:
        out.extend(t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _mapped(f: Callable[[Any], Any], tree: Any, leaf: type = torch.Tensor) -> Any:
    """``tree`` with ``f`` applied to each ``leaf`` in it (an op's outputs: a tensor, or a
    tuple or list of them and scalars), as ``tree_map`` would, without its walk where it can."""
    if isinstance(tree, leaf):
        return f(tree)
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(_mapped(f, v, leaf) for v in tree)
    if kind in _LEAVES:
        return tree
    return tree_map(lambda v: f(v) if isinstance(v, leaf) else v, tree)


def _signature(args: Any) -> tuple[Any, ...]:
    """What must match for a kept output to stand for the op run again: its tensor arguments'
    shapes, dtypes and devices (a recomputation that took another path calls it otherwise)."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in _tensors(args))


@dataclass
class _Kept:
    """The outputs one costly op gave in the forward, detached (the forward's graph is not
    kept), what they were made from, and what tells whether they were written since.

    A tensor detached below autograd (in a dispatch mode) does not share the version counter of
    the one autograd hands on, so writes are followed in two ways: those within the forward
    through the dispatch mode (:func:`_written`), those after it by a guard sharing the counter
    of each output, and of each alias of it the forward made (``_unsafe_view``'s, which has a
    counter of its own), still alive when the forward ends (:meth:`_Keeping.__exit__`): only
    those can be written after it."""

    outputs: Any
    signature: tuple[Any, ...]
    # (a weak reference to each output tensor and alias of one, its version when made), until the forward ends
    made: list[tuple[Any, int]]
    guards: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (its version counter, that version)
    stale: bool = False  # written in place since it was made

    def stands(self, signature: tuple[Any, ...]) -> bool:
        return not self.stale and self.signature == signature and all(g._version == v for g, v in self.guards)


@dataclass
class _Cache:
    """The costly ops' outputs of one forward, by (op, its call number in the forward); once
    the forward is over, each output tensor as ``keep`` made it (what ``take`` gives back)."""

    keep: Callable[[torch.Tensor], Any]
    take: Callable[[Any], torch.Tensor]
    calls: int | None  # the ops kept (in forward order) whose outputs are kept: the first this many (None: all)
    attention_only: bool  # only the fused attention's outputs are kept; the matmuls run again
    kept: dict[tuple[int, int], _Kept] = field(default_factory=dict)  # (id of the op, call number) -> its outputs
    by_storage: dict[int, list[_Kept]] = field(default_factory=dict)  # storage key -> the entries on it


def _written(op: _Op, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors the op writes in place (its schema's mutable arguments)."""
    out: list[torch.Tensor] = []
    for i, name in op.writes:
        value = kwargs[name] if name in kwargs else args[i] if i < len(args) else None
        out += _tensors(value)
    return out


class _Keeping(TorchDispatchMode):
    """The forward: each costly op's outputs are kept."""

    def __init__(self, cache: _Cache):
        super().__init__()
        self.cache = cache
        self.calls: dict[int, int] = {}  # id of a costly op -> its calls so far
        self.costly = 0  # ops kept so far

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = _OPS.get(id(func)) or _op(func)
        by_storage = self.cache.by_storage
        if by_storage and op.writes:
            for key in map(_storage, _written(op, args, kwargs)):
                for kept in by_storage.get(key, ()) if key is not None else ():
                    kept.stale = True
        out = func(*args, **kwargs)
        if by_storage and op.aliases:  # an alias of a kept output: followed as the output is
            for t in _tensors(out):
                key = _storage(t)
                for kept in by_storage.get(key, ()) if key is not None else ():
                    kept.made.append((weakref.ref(t), t._version))
        if _kept(op, args, kwargs, self.cache.attention_only):
            n = self.calls.get(id(func), 0)
            self.calls[id(func)] = n + 1
            self.costly += 1
            if self.cache.calls is not None and self.costly > self.cache.calls:
                return out  # past where the recomputation stops: never asked for
            made = _tensors(out)
            detached = _mapped(torch.Tensor.detach, out)
            kept = self.cache.kept[(id(func), n)] = _Kept(detached, _signature((args, kwargs)),
                                                      [(weakref.ref(t), t._version) for t in made])
            for key in map(_storage, made):
                if key is not None:
                    self.cache.by_storage.setdefault(key, []).append(kept)
        return out

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        keep = self.cache.keep
        for key, kept in list(self.cache.kept.items()):  # above autograd now: a guard shares the counter
            for ref, version in kept.made:
                t = ref()
                if t is not None:
                    guard = compat.version_guard(t)
                    kept.stale |= guard._version != version
                    kept.guards.append((guard, version))
            kept.made = []
            if kept.stale or exc[0] is not None:  # its op runs again: nothing to hold
                del self.cache.kept[key]
            else:
                kept.outputs = _mapped(lambda t: _Stored(keep(t)), kept.outputs)
        self.cache.by_storage.clear()
        return out


@dataclass(frozen=True)
class _Stored:
    """An output tensor as ``keep`` made it (a leaf to pytree, whatever ``keep`` returns)."""

    stored: Any


def _storage(t: torch.Tensor) -> int | None:
    try:
        return compat.storage_key(t)
    except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own
        return None


class _Reusing(TorchDispatchMode):
    """A recomputation: each costly op gives the output the forward kept (and lets go of it),
    where it still stands for the op: not written in place since, called with the same shapes.
    Otherwise, and in a second recomputation (a graph kept for another backward), the op runs
    again: recomputing is always right, only slower."""

    def __init__(self, cache: _Cache):
        super().__init__()
        self.cache = cache
        self.calls: dict[int, int] = {}  # id of a costly op -> its calls so far

    def __enter__(self) -> Any:
        self.calls = {}  # each recomputation counts the calls from the start
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = _OPS.get(id(func)) or _op(func)
        if _kept(op, args, kwargs, self.cache.attention_only):
            n = self.calls.get(id(func), 0)
            self.calls[id(func)] = n + 1
            kept = self.cache.kept.pop((id(func), n), None)
            if kept is not None and kept.stands(_signature((args, kwargs))):  # (else it runs again)
                take = self.cache.take
                return _mapped(lambda v: take(v.stored), kept.outputs, _Stored)
        return func(*args, **kwargs)


def same(t: Any) -> Any:
    """What :func:`contexts` keeps and takes by default: the tensor itself."""
    return t


def contexts(keep: Callable[[torch.Tensor], Any] = same, take: Callable[[Any], torch.Tensor] = same,
             calls: int | None = None, attention_only: bool = False) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """A fresh ``(forward, recomputation)`` pair for one checkpointed call
    (``torch.utils.checkpoint.checkpoint(..., context_fn=selective.contexts)``): the forward
    keeps the costly ops' outputs, the recomputation takes them instead of running those ops.
    ``keep`` is handed each output tensor when the forward is over, and its result is held
    instead (an offloader's pack hook: the output is then one of the group's saves, moved as its
    plan says); ``take`` gives the tensor back from it (the unpack hook), in the recomputation.
    ``calls``: keep only the outputs of the first this many costly ops (those the recomputation
    reaches before it stops, as profiled: :attr:`OpMeter.reached`); a later one runs again
    should a recomputation ever reach it. ``attention_only``: keep the fused attention's outputs
    only, and run the matmuls again too (``calls`` then counts attention calls:
    :attr:`OpMeter.attention_reached`): at long sequences the attention is the costliest op, and
    what it keeps takes what the layer's input does.

    Gradients are bitwise those of plain checkpointing: the kept outputs are the forward's own,
    and the ops run again are run on the same inputs."""
    cache = _Cache(keep, take, calls, attention_only)
    return _Keeping(cache), _Reusing(cache)


class OpMeter:
    """What a profiled group's checkpointed forward and recomputation tell of a selective
    recomputation of it: ``costly``, the bytes of each of its costly ops' outputs (distinct
    storages), which it would hold until its backward (``costly_bytes``: their sum); and the
    time of those ops within its recomputation (:meth:`costly_s`), which it would not spend again.

    A recomputation stops once the last tensor backward needs is back: the costly ops after
    that point (a layer's last projection, whose output only its caller reads) never run in
    it. ``reached`` is how many costly ops it ran (``None`` before a recomputation ran);
    ``costly`` counts only theirs, and a selective recomputation keeps only theirs
    (:func:`contexts`' ``calls``). An output the forward wrote in place after its op counts for
    nothing: a selective recomputation would run that op again.

    ``attention``, ``attention_reached`` and :meth:`attention_s`: the same of the fused attention
    calls among them alone, what a recomputation keeping only those would keep and skip.

    ``mark`` and ``seconds``: the profiling clock (CUDA events on a GPU, the host's clock on
    the CPU: :class:`actoffload.budget.probe.Probe`'s).

    Example::

        meter = OpMeter(time.perf_counter, lambda a, b: b - a)
        with meter.forward():
            y = layer(x)
        with meter.recomputation():
            layer(x)
        meter.costly_bytes, meter.costly_s()   # (each output's bytes: meter.costly)
    """

    def __init__(self, mark: Callable[[], Any] = time.perf_counter,
                 seconds: Callable[[Any, Any], float] = lambda a, b: b - a):
        self._mark, self._seconds = mark, seconds
        # per costly op of the forward, in order: each output it made, its storage's key (None: no
        # storage of its own) and bytes
        self._calls: list[list[tuple[int | None, int]]] = []
        self._attention: list[bool] = []  # per costly op of the forward: whether it is a fused attention
        self.reached: int | None = None
        # storage key -> a weak reference to it, which keeps the key from going to another storage
        # once this one is freed (an output freed within the forward is still one a selective
        # recomputation would keep)
        self._storages: dict[int, Any] = {}
        self._storage_call: dict[int, int] = {}  # storage key -> the costly op (its index in _calls) that made it
        # the marks seen on each output's storage while it lived (a checkpointed forward lets go of
        # an output its next ops are done with, and its marks with it: read at each op until then)
        self._flags: dict[int, int] = {}
        self._watched: list[int] = []  # keys of the outputs still alive, as of the latest op
        self._marks_read = -1  # marks.made() when the marks were read last
        self._spans: list[tuple[Any, Any, bool]] = []  # marks around each costly op of the recomputation; attention?

    def forward(self) -> TorchDispatchMode:
        return _Counting(self)

    def recomputation(self) -> TorchDispatchMode:
        return _Timing(self)

    @property
    def costly(self) -> list[int]:
        return [n for _, n in self._kept_outputs(False)]

    @property
    def costly_bytes(self) -> int:
        return sum(self.costly)

    @property
    def attention(self) -> list[int]:
        return [n for _, n in self._kept_outputs(True)]

    def moving(self, save_policy: str, attention_only: bool = False) -> list[int]:
        """The bytes of each output :attr:`costly` (or :attr:`attention`) counts that ``save_policy``
        and the marks seen on it (:meth:`read_marks`) let move (R3, R4); one with no storage of
        its own stays."""
        return [n for key, n in self._kept_outputs(attention_only)
                if key is not None and policy.held_by_marks(self._flags.get(key, 0), save_policy) is None]

    def read_marks(self) -> None:
        """Note the marks on the outputs still alive (the caller marks an output after the op
        that made it, before the next), where any mark was made since they were read last."""
        made = marks.made()
        if made == self._marks_read:
            return
        self._marks_read = made
        alive = []
        for key in self._watched:
            if not self._storages[key].expired():
                self._flags[key] = self._flags.get(key, 0) | marks.flags_of(key)
                alive.append(key)
        self._watched = alive

    def _kept_outputs(self, attention_only: bool) -> list[tuple[int | None, int]]:
        """``(storage key, bytes)`` of each output a selective recomputation keeps (of the costly
        ops its recomputation reached; of its attention calls only, ``attention_only``)."""
        calls = self._calls if self.reached is None else self._calls[:self.reached]
        return [out for spans, attention in zip(calls, self._attention) if attention or not attention_only
                for out in spans]

    @property
    def attention_reached(self) -> int | None:
        return None if self.reached is None else sum(self._attention[:self.reached])

    def costly_s(self) -> float:
        """Seconds the costly ops took in the recomputation (on CUDA: waits for them)."""
        return sum(self._seconds(a, b) for a, b, _ in self._spans)

    def attention_s(self) -> float:
        """Seconds the fused attention calls among them took."""
        return sum(self._seconds(a, b) for a, b, attention in self._spans if attention)

    def _count(self, out: Any, attention: bool) -> None:
        spans: list[tuple[int | None, int]] = []
        for t in _tensors(out):
            if t.layout is not torch.strided or t.is_meta:
                continue
            key = _storage(t)
            if key is None:  # no storage of its own (a wrapper subclass): its bytes, once
                spans.append((None, t.nbytes))
            elif key not in self._storages:
                self._storages[key] = compat.storage_weakref(t)
                self._storage_call[key] = len(self._calls)
                self._watched.append(key)
                self._flags[key] = marks.flags_of(key)  # (marked already: an output of another's)
                spans.append((key, t.untyped_storage().nbytes()))
        self._calls.append(spans)
        self._attention.append(attention)


class _Counting(TorchDispatchMode):
    def __init__(self, meter: OpMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        meter = self.meter
        op = _OPS.get(id(func)) or _op(func)
        if meter._watched:
            meter.read_marks()
        if meter._storages and op.writes:
            for key in map(_storage, _written(op, args, kwargs)):
                if key is not None and key in meter._storage_call:  # written: a selective one would not keep it
                    meter._calls[meter._storage_call[key]] = []
        out = func(*args, **kwargs)
        if op.costly and _kept(op, args, kwargs):
            meter._count(out, op.attention)
        return out


class _Timing(TorchDispatchMode):
    def __init__(self, meter: OpMeter):
        super().__init__()
        self.meter = meter
        self.calls = 0  # costly ops this recomputation ran

    def __enter__(self) -> Any:
        self.calls = 0
        if self.meter.reached is None:  # a recomputation runs: it reaches none until it runs one
            self.meter.reached = 0
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not keeps(func, args, kwargs):
            return func(*args, **kwargs)
        meter = self.meter
        self.calls += 1
        meter.reached = max(meter.reached or 0, self.calls)  # (set by __enter__; 'or' for the type check)
        start = meter._mark()
        out = func(*args, **(kwargs or {}))
        meter._spans.append((start, meter._mark(), _op(func).attention))
        return out
