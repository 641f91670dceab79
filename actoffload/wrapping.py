"""``wrap(modules, off)``: make each module's forward an offload group."""

from __future__ import annotations

import contextlib
import copy
import copyreg
import functools
import itertools
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence, cast

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import compat, policy
from .marks import mark_parameters
from .offloader import GroupContext, Offloader

_WRAP = "_actoffload_wrap"  # the instance attribute holding a wrapped module's bookkeeping
_TRANSIENT = "_actoffload_transient"  # on a hook kept on a module only while it is wrapped (not in copies)
_BASE = "_actoffload_base"  # on a generated class: the class it wraps
_SET_ASIDE = "_actoffload_deepcopy"  # on a class made again over ours: its own __deepcopy__, for the class without ours
_NEWOBJ, _NEWOBJ_EX = getattr(copyreg, "__newobj__"), getattr(copyreg, "__newobj_ex__")


class WrapHandle:
    """Returned by :func:`wrap`; ``remove()`` gives every module its own class and forward
    back, in the reverse order of wrapping (also as a context manager)."""

    def __init__(self, restores: list[Callable[[], None]]):
        self._restores = restores

    def remove(self) -> None:
        restores, self._restores = self._restores, []
        for restore in reversed(restores):
            restore()

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
    element, a ``ModuleDict`` one per value (named by its keys unless ``names`` is given).
    The module's forward runs inside ``off.group(name)``: leaving it by an exception leaves
    the group as ``with`` would (R8), and a module called twice in one forward is two groups
    (``stats()`` shows ``name`` and ``name#2``). One module given at several positions (a
    layer shared across depth, ``ModuleList([layer] * 4)``) is wrapped once, under the name
    of its first position: each call is a group of its own (``"0"``, ``"0#2"``, ...). The
    module's parameters are recorded at every call, so any tensor over their storage stays
    resident (R3), a detached view of a weight included.

    A wrapped module stays an instance of its class: its class is swapped for a generated
    subclass (``OffloadBlock`` for a ``Block``, as FSDP2's ``fully_shard`` does) whose
    ``forward`` opens the group and runs the module's own (its class's, or one assigned on
    the instance before wrapping). ``remove()`` undoes the wraps in reverse order, giving each
    module its class and instance ``forward`` back, nothing left over; a class swap made after
    wrapping (``fully_shard``) stays, without the wrapper. A copy of a wrapped module
    (``copy.deepcopy``, ``copy.copy``, ``pickle``, ``torch.save`` then ``torch.load``) is a
    plain module of its original class, not wrapped, computing with its own weights
    (``copy.copy`` shares the original's submodules, wrapped where those are); the original
    stays wrapped. A ``forward`` assigned on the instance after wrapping takes
    precedence over the wrapper: no group opens.

    ``names`` must be strings (``TypeError`` otherwise), and ``parts(module)`` must return a
    sequence of submodules of the module. Groups do not nest (R2): a module inside another
    wrapped one, or holding one (given in the same call, or wrapped already), raises
    ``ValueError`` at once.

    Composes with: ``torch.compile`` of the blocks or of the whole model (the group
    boundary is a graph break), FSDP2's ``fully_shard`` on the same modules (before or after
    wrapping), activation checkpointing inside or around a wrapped module (a checkpoint's
    recomputation in backward opens no group).

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
    keys: list[str] | None = None
    if isinstance(modules, torch.nn.ModuleDict):
        keys, modules = list(modules.keys()), list(modules.values())
    elif isinstance(modules, torch.nn.Module) and not isinstance(modules, (torch.nn.ModuleList, torch.nn.Sequential)):
        modules = [modules]
    elif isinstance(modules, (str, bytes, dict)) or not isinstance(modules, Iterable):
        raise TypeError(f"wrap takes an nn.Module or a sequence of them (a ModuleList, a list), got "
                        f"{type(modules).__name__}")
    modules = list(modules)
    if not modules:
        raise ValueError("wrap was given no modules: nothing would be offloaded (an empty ModuleList?)")
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"wrap takes nn.Modules, got {type(m).__name__}")
        if isinstance(m, torch.jit.ScriptModule):
            raise TypeError(f"wrap cannot hook {getattr(m, 'original_name', type(m).__name__)}: it is a TorchScript "
                            "module (torch.jit.script or torch.jit.trace), whose forward is not Python; wrap the "
                            "eager module instead (torch.compile, not TorchScript, compiles wrapped modules)")
    if parts is not None and not callable(parts):
        raise TypeError(f"wrap's parts must be a function giving a module's parts (lambda b: [b.attn, b.mlp]), "
                        f"got {type(parts).__name__}")
    if names is None:
        names = keys if keys is not None else [str(i) for i in range(len(modules))]
    elif isinstance(names, str):
        raise TypeError(f"wrap's names must be a sequence of str, one per module, got the str {names!r}")
    names = list(names)
    if len(names) != len(modules):
        raise ValueError(f"wrap got {len(modules)} modules but {len(names)} names")
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise TypeError(f"wrap's names must be str: names[{i}] is {name!r} ({type(name).__name__})")
    # one module at several positions is wrapped once, under its first position's name
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    for m, name in zip(modules, names):
        first.setdefault(id(m), (m, name))
    modules, names = [m for m, _ in first.values()], [name for _, name in first.values()]
    # groups do not nest (R2): a module given is neither inside another (a module wrapped with
    # parts runs whole too, as one group) nor holds one, wrapped already or given in this call
    given = {id(m): m for m in modules}
    within = {id(x): w for w in list(_WRAPPED) for x in w.modules() if x is not w}
    for m in modules:
        if _is_wrapped(m):
            raise ValueError(f"{_class_name(m)} is already wrapped; remove() its handle before wrapping it again")
        inner = next((path for path, x in m.named_modules() if x is not m and _is_wrapped(x)), None)
        if inner is not None:  # its group would open around the inner one's
            raise ValueError(f"{_class_name(m)} holds {inner!r}, which is already wrapped: groups do not nest "
                             "(R2); wrap one or the other (remove() the inner one's handle first)")
        outer = within.get(id(m))
        if outer is not None:
            raise ValueError(f"{_class_name(m)} is inside {_class_name(outer)}, which is already wrapped: groups "
                             "do not nest (R2); wrap one or the other (remove() the outer one's handle first)")
        both = next((path for path, x in m.named_modules() if x is not m and id(x) in given), None)
        if both is not None:
            raise ValueError(f"wrap got {_class_name(m)} and its {both!r}: groups do not nest (R2); give one or "
                             "the other (a module's parts: parts=)")
    if parts is None:
        return _wrap_all([(m, name, 0) for m, name in zip(modules, names)], off)
    inner_of = [_parts_of(m, parts) for m in modules]
    for m, inner in zip(modules, inner_of):  # all checked before any is wrapped
        owned = {id(x) for x in m.modules()}
        if not inner or any(not isinstance(x, torch.nn.Module) or id(x) not in owned or x is m for x in inner):
            raise ValueError(f"parts({_class_name(m)}) must give submodules of it (its forward calls each once, "
                             f"in order); got {[type(x).__name__ for x in inner]}")
        if len({id(x) for x in inner}) != len(inner):
            raise ValueError(f"parts({_class_name(m)}) gives a submodule twice: each part is one group")
        if any(y is not x and id(y) in {id(z) for z in x.modules()} for x in inner for y in inner):
            raise ValueError(f"parts({_class_name(m)}) gives a part inside another: groups do not nest (R2)")
        if any(_is_wrapped(x) for x in inner):
            raise ValueError(f"a part of {_class_name(m)} is already wrapped; remove() its handle first")
    every = [id(x) for inner in inner_of for x in inner]
    if len(set(every)) != len(every) or {id(m) for m in modules} & set(every):
        raise ValueError("parts gives one submodule for two modules, or a module that is itself wrapped: "
                         "each part is one group (R2)")
    todo: list[tuple[torch.nn.Module, str, int]] = []
    for m, name, inner in zip(modules, names, inner_of):
        todo += [(x, f"{name}.{k}", 0) for k, x in enumerate(inner)]
        todo.append((m, name, len(inner)))
    return _wrap_all(todo, off)


def _parts_of(module: torch.nn.Module, parts: Callable[[torch.nn.Module], Any]) -> list[Any]:
    result = parts(module)
    given = None
    if not isinstance(result, (str, bytes, torch.Tensor)):
        try:
            given = list(result)
        except TypeError:
            pass
    if given is None:
        raise TypeError(f"parts({_class_name(module)}) must return a sequence of submodules of it "
                        f"(its forward calls each once, in order); got {result!r}")
    return given


def _wrap_all(todo: list[tuple[torch.nn.Module, str, int]], off: Offloader) -> WrapHandle:
    restores: list[Callable[[], None]] = []
    try:
        for m, name, n in todo:
            restores.append(_wrap_one(m, off, name, n))
    except BaseException:
        WrapHandle(restores).remove()
        raise
    return WrapHandle(restores)


def _is_wrapped(module: torch.nn.Module) -> bool:
    return _WRAP in vars(module)


def _class_name(module: torch.nn.Module) -> str:
    return _plain_class(type(module)).__name__


class _Wrap:
    """A wrapped module's bookkeeping (kept out of its copies and pickles)."""

    __slots__ = ("off", "name", "parts", "norms", "own_forward")

    def __init__(self, off: Offloader, name: str, parts: int, norms: list[torch.nn.modules.batchnorm._NormBase],
                 own_forward: Callable[..., Any] | None):
        self.off, self.name, self.parts, self.norms = off, name, parts, norms
        self.own_forward = own_forward  # a forward the instance had of its own before wrapping


# modules that, recomputed once, wrote a tensor they were called with in place in their forward:
# never recomputed again, whatever wraps them (the integrations wrap anew at every step)
_WRITES_INPUTS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# the modules wrapped now, so that wrapping a module inside one of them is refused at once
_WRAPPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# module -> training flag -> the buffers (dotted names) its forward writes in place, seen at its
# first recomputed forward in that mode (spectral normalization's power iteration): the
# recomputation runs on copies of them as they were before the forward, so they are written once
# and the recomputed forward is the forward (an empty set: none; no entry: not seen yet)
_BUFFER_WRITES: weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, frozenset[str]]] = weakref.WeakKeyDictionary()


def _wrap_one(module: torch.nn.Module, off: Offloader, name: str, parts: int = 0) -> Callable[[], None]:
    before = type(module)
    if torch.nn.utils.parametrize.is_parametrized(module):
        # torch's parametrizations keep a class of their own per module, over the module's, and
        # change it as they are added and removed (their properties set on and deleted from
        # it, the class taken away with the last): ours goes under it, and it over ours
        cls = _wrapped_class(before.__bases__[0])
        installed = _over(cls, before)
    else:
        cls = installed = _wrapped_class(before)
    made = dict(vars(installed))
    own = vars(module).get("forward")
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    state = _Wrap(off, name, parts, norms, own)
    module.__class__ = installed
    vars(module)[_WRAP] = state
    _WRAPPED.add(module)
    if own is not None:
        del vars(module)["forward"]

    def restore() -> None:
        if vars(module).get(_WRAP) is not state:
            return  # already undone
        del vars(module)[_WRAP]
        _WRAPPED.discard(module)
        if own is not None and "forward" not in vars(module):
            vars(module)["forward"] = own
        now = type(module)
        if now is installed and dict(vars(now)) == made:
            module.__class__ = before
        elif now is cls:  # (the parametrizations' class taken away with the last of them)
            module.__class__ = vars(cls)[_BASE]
        elif cls in now.__mro__:  # a class swap after wrapping (FSDP2), or parametrizations changed: kept, without ours
            module.__class__ = _plain_class(now)

    return restore


def _over(cls: type[torch.nn.Module], parametrized: type) -> type[torch.nn.Module]:
    """The class of torch's parametrizations ``parametrized``, made again over ``cls``: its
    properties, and ``cls``'s copy (torch gives its class one only where the class below has none)."""
    namespace = {k: v for k, v in vars(parametrized).items() if k not in ("__dict__", "__weakref__", "__deepcopy__")}
    if "__deepcopy__" in vars(parametrized):  # its own again once ours is gone (_plain_class)
        namespace[_SET_ASIDE] = vars(parametrized)["__deepcopy__"]
    return type(parametrized)(parametrized.__name__, (cls,), namespace)


_CLASSES: dict[type, type[torch.nn.Module]] = {}  # class -> its generated subclass
# a class with a generated class among its bases -> the same without (weakly: the classes made
# again over ours are one a module, and go with it)
_PLAIN: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def _wrapped_class(base: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """The generated subclass of ``base`` whose forward opens the module's group."""
    known = _CLASSES.get(base)
    if known is not None:
        return known

    def own(self: torch.nn.Module, w: _Wrap, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's own forward: what it runs without an offloader."""
        return w.own_forward(*args, **kwargs) if w.own_forward is not None else base.forward(self, *args, **kwargs)

    # Not a `with` block: torch.compile cannot resume inside a `with` whose context manager
    # it does not trace, and would then run the whole forward eagerly. Two calls it does not
    # trace are two clean graph breaks, and the module's own forward between them compiles.
    @functools.wraps(base.forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        w: _Wrap | None = getattr(self, _WRAP, None)
        if w is None:  # unwrapped after torch bound this forward (remove() from a forward pre-hook)
            restored = self.__dict__.get("forward")
            return restored(*args, **kwargs) if restored is not None else base.forward(self, *args, **kwargs)
        if torch.jit.is_tracing() or (not torch.is_grad_enabled() and w.off._serves_another_thread()):
            # torch.jit.trace records the module as without an offloader; a forward that saves
            # nothing on a thread the offloader does not serve runs as without one (R8), its
            # inputs no step's (a memory budget's signature is the serving thread's steps')
            return own(self, w, args, kwargs)
        # Not recomputed under torch.compile (checkpoint with our contexts would run it eagerly,
        # and eager kernels differ from compiled ones in the last bits), nor while it updates
        # running statistics (recomputing would update them twice).
        cache = _appends_to_cache(args, kwargs)
        if cache:
            _say_a_cache_rules_out_recomputing(w.off, w.name)
        recomputable = (not torch.compiler.is_compiling() and not _updates_stats(w.norms)
                        and not cache and self not in _WRITES_INPUTS)
        group = _open(self, w.off, w.name, recomputable, w.parts, args, kwargs,  # (positional: not_traced takes no keywords)
                      recomputable and w.off.plan.decides_openings and _runs_compiled(self))
        try:
            if group.recompute:  # a plan's choice (budget, warm-up): save only the inputs, recompute in backward
                inner = w.own_forward if w.own_forward is not None else functools.partial(base.forward, self)
                out = _recomputed(self, inner, group, args, kwargs)
            else:
                out = own(self, w, args, kwargs)
        except BaseException:
            _close(group, True)  # (failed; positional: not_traced takes no keywords)
            raise
        _close(group, False)
        return out

    def __reduce_ex__(self: torch.nn.Module, protocol: Any) -> Any:
        # A copy or a pickle is of the class the module had: plain, not wrapped.
        reduced = super(cls, self).__reduce_ex__(protocol)
        if not isinstance(reduced, tuple):
            return reduced
        now, plain = type(self), _plain_class(type(self))
        rv = list(reduced)
        if rv[0] is now:  # a __reduce__ calling the class
            rv[0] = plain
        # pickle insists that __newobj__ makes an object of the pickled one's class: call the
        # class's __new__ directly instead (what __newobj__ does)
        if rv[0] is _NEWOBJ and rv[1][0] is now:
            rv[0], rv[1] = plain.__new__, (plain, *rv[1][1:])
        elif rv[0] is _NEWOBJ_EX and rv[1][0] is now:
            rv[0], rv[1] = functools.partial(plain.__new__, plain, *rv[1][1], **rv[1][2]), ()
        elif len(rv) > 1 and isinstance(rv[1], tuple) and rv[1] and rv[1][0] is now:  # copyreg._reconstructor
            rv[1] = (plain, *rv[1][1:])
        if len(rv) > 2:
            rv[2] = _plain_state(rv[2])
        return tuple(rv)

    namespace: dict[str, Any] = {
        "forward": forward, "__reduce_ex__": __reduce_ex__, _BASE: base,
        "__module__": __name__, "__qualname__": f"Offload{base.__name__}",
    }
    def __deepcopy__(self: torch.nn.Module, memo: dict[int, Any]) -> Any:
        # A copy is of the module as it was. Defined whatever the base: a class swapped in over
        # ours later (torch's parametrizations) then copies through it, not through a default
        # that copies the wrap's bookkeeping, offloader and all.
        plain = _plain_class(type(self))
        state = _plain_state(vars(self))
        own = getattr(plain, "__deepcopy__", None)
        if own is not None:  # the class copies itself: let it copy the module as it was
            proxy: Any = object.__new__(plain)
            vars(proxy).update(state)
            new = own(proxy, memo)
            memo[id(self)] = new
        else:  # as copy.deepcopy copies a plain module, but not through __getstate__, which a
            # parametrized module's class refuses (pickling it is refused, copying it is not)
            new = cast(Any, plain).__new__(plain)
            memo[id(self)] = new
            new.__setstate__(copy.deepcopy(state, memo))
            for slot in copyreg._slotnames(plain):  # type: ignore[attr-defined]
                if hasattr(self, slot):
                    setattr(new, slot, copy.deepcopy(getattr(self, slot), memo))
        return new
    namespace["__deepcopy__"] = __deepcopy__
    cls: type[torch.nn.Module] = type(base)(f"Offload{base.__name__}", (base,), namespace)  # type: ignore[misc]
    _CLASSES[base] = cls
    return cls


def _plain_class(cls: type) -> type:
    """``cls`` without the generated classes of ``wrap`` in its hierarchy."""
    base = vars(cls).get(_BASE)
    if base is not None:
        return base
    if not any(_BASE in vars(k) for k in cls.__mro__):
        return cls
    plain = _PLAIN.get(cls)
    if plain is None:
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        if _SET_ASIDE in namespace:
            namespace["__deepcopy__"] = namespace.pop(_SET_ASIDE)
        plain = type(cls)(cls.__name__, tuple(_plain_class(b) for b in cls.__bases__), namespace)
        _PLAIN[cls] = plain
    return plain


def transient_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook`` as one that a wrapped module carries only while it is wrapped: a copy or a
    pickle of the module, made as the plain module, is made without it (and its pickle loads
    where actoffload is not installed).

    Example::

        module.register_forward_pre_hook(transient_hook(my_hook))   # while ao.wrap holds it
    """
    setattr(hook, _TRANSIENT, True)
    return hook


def _plain_state(state: Any) -> Any:
    """A module's pickled state without the wrap's bookkeeping (with its own forward back, and
    without the hooks kept only while it is wrapped: :func:`transient_hook`)."""
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):  # (dict, slots)
        return (_plain_state(state[0]), state[1])
    if not isinstance(state, dict) or _WRAP not in state:
        return state
    state = dict(state)
    w = state.pop(_WRAP)
    if isinstance(w, _Wrap) and w.own_forward is not None:
        state.setdefault("forward", w.own_forward)
    hooks = state.get("_forward_pre_hooks")
    if hooks and any(getattr(h, _TRANSIENT, False) for h in hooks.values()):
        gone = {k for k, h in hooks.items() if getattr(h, _TRANSIENT, False)}
        state["_forward_pre_hooks"] = type(hooks)((k, h) for k, h in hooks.items() if k not in gone)
        kwargs = state.get("_forward_pre_hooks_with_kwargs")
        if kwargs is not None:
            state["_forward_pre_hooks_with_kwargs"] = type(kwargs)((k, v) for k, v in kwargs.items() if k not in gone)
    return state


def _input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the tensors a module is called with, those inside tuples, lists and dicts too
    (each once; parameters and leaves that require grad aside, which stay where they are, R3):
    what checkpointing it whole saves (:func:`_recomputed`)."""
    seen, total = set(), 0
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and not policy.is_parameter(t):
            nbytes = t.numel() * t.element_size()
            try:  # (an expanded tensor: its storage, not its elements)
                key = (compat.storage_key(t), t.storage_offset())
                nbytes = min(nbytes, t.untyped_storage().nbytes())
            except (NotImplementedError, RuntimeError):  # no storage of its own (a wrapper subclass)
                key = (id(t), 0)
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def _updates_stats(norms: list[torch.nn.modules.batchnorm._NormBase]) -> bool:
    """Whether a forward updates running statistics (batch norm in training): recomputing it
    would update them twice."""
    return any(m.training and m.track_running_stats for m in norms)


def _runs_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule is compiled (``torch.compile(m)``, ``m.compile()``): its
    group is then recomputed plainly, never under a dispatch mode (a budget's profiling meters
    the ops of a recomputed forward with one; a selective recomputation picks what to keep with
    one), since Dynamo, meeting one, runs the compiled code eagerly and marks it never to compile
    again, for every module compiled alike in the process. Asked at each call of a recomputable
    module under a plan that may recompute it (about 8 us for a decoder layer): a submodule may
    be compiled after wrapping. A function compiled on its own (``torch.compile(fn)``) that the
    forward calls is not seen (docs/semantics.md, "Compiled code")."""
    compiled = compat.compiled_module_class()
    return any(isinstance(m, compiled) or m._compiled_call_impl is not None for m in module.modules())


def _appends_to_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call is handed a key-value cache its forward appends to (transformers'
    ``Cache``, which a model makes when ``use_cache`` is on, in training too): a recomputation
    would append again, and attend over twice the keys."""
    return any(callable(getattr(v, "get_seq_length", None)) and callable(getattr(v, "update", None))
               for v in itertools.chain(args, kwargs.values()))


_TOLD_OF_A_CACHE: weakref.WeakSet[Offloader] = weakref.WeakSet()  # offloaders warned (once each)


def _say_a_cache_rules_out_recomputing(off: Offloader, name: str) -> None:
    """Under a memory budget, warn once that a training forward handed a key-value cache is never
    recomputed: transformers makes one whenever ``use_cache`` is on, in training too, and a user
    setting a budget expects recomputation among its choices."""
    if off in _TOLD_OF_A_CACHE or getattr(off, "memory_budget", None) is None or not torch.is_grad_enabled():
        return
    _TOLD_OF_A_CACHE.add(off)
    warnings.warn(f"actoffload: {name!r} is called with a key-value cache (transformers' use_cache=True), so the "
                  "memory budget never recomputes it, only keeps or moves what it saves; for training, call the "
                  "model with use_cache=False or set model.config.use_cache = False (an encoder-decoder's decoder, "
                  "T5's, keeps a config of its own), as transformers' gradient checkpointing does", stacklevel=3)


# what every nn.Module has in its __dict__ from Module.__init__ (hooks, registries), except the training flag
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
_MISSING = object()


_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})


def _immutable(value: Any) -> bool:
    """``None``, a bool, int, float or str (or a subclass), or a tuple of such. Asked of the
    value's own type: ``isinstance`` would also read ``__class__`` through the object, which
    some classes make costly (transformers' configs) or make lie."""
    kind = type(value)
    if kind in _PLAIN_TYPES or issubclass(kind, (bool, int, float, str)):
        return True
    return issubclass(kind, tuple) and all(_immutable(v) for v in value)


def _plain_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own immutable plain attributes (the training flag among them), by name."""
    d = vars(module)
    return {k: d[k] for k in d.keys() - _MODULE_INTERNALS if type(d[k]) in _PLAIN_TYPES or _immutable(d[k])}


class _ForwardState:
    """What a recomputed module's forward saw, for its recomputation in backward: the
    parameters and buffers of the module and its submodules (references, not copies; copies of
    the buffers its forward writes in place, as they were before it), and their immutable plain
    attributes (the training flag among them). Taken at every forward of a recomputed group:
    kept to C-level copies and set operations."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        # (a module FSDP2 shards is left its own: it gathers its parameters for the recomputation
        # as for the forward, and those of the forward, swapped back in, would be mixed with its)
        self.entries = [(m, _plain_attributes(m),
                         None if compat.parameters_swapped_by_fsdp(m) else compat.own_tensors(m))
                        for m in module.modules()]
        # buffers the forward may write in place, watched by their versions: copied (the writes
        # cannot be undone) every one the first time in this mode, then those it wrote
        self.training = module.training
        self.seen = _BUFFER_WRITES.get(module, {}).get(module.training)
        self.versions = {name: (b, b._version) for name, b in module.named_buffers()
                         if not b.is_inference()}  # (which has no version)
        self.before = {name: b.detach().clone() for name, (b, _) in self.versions.items()
                       if self.seen is None or name in self.seen}

    def forward_ran(self) -> None:
        """After the forward: keep the copies of the buffers it wrote, for the recomputation,
        and say for the module's later forwards which it writes."""
        written = frozenset(name for name, (b, v) in self.versions.items() if b._version != v)
        self.before = {name: t for name, t in self.before.items() if name in written}
        self.versions = {}
        if self.seen is None or not written <= self.seen:  # (one written first now is missed in this step)
            _BUFFER_WRITES.setdefault(self.module, {})[self.training] = written | (self.seen or frozenset())

    def _changed_tensors(self) -> dict[str, torch.Tensor] | None:
        """The forward's parameters and buffers by dotted name, if any of them is not the
        module's now; else ``None``."""
        if all(tensors is None or compat.holds_own_tensors(m, tensors) for m, _, tensors in self.entries):
            return None
        own = {id(m): tensors for m, _, tensors in self.entries if tensors is not None}
        out: dict[str, torch.Tensor] = {}
        for path, m in self.module.named_modules():
            for registry in own.get(id(m), ()):
                out.update((f"{path}.{k}" if path else k, t) for k, t in registry.items() if t is not None)
        return out

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """The forward's attributes, parameters and buffers, for as long as the block runs;
        then those of now again."""
        undo: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for m, attrs, _ in self.entries:
                d = vars(m)
                for k, v in attrs.items():
                    now = d.get(k, _MISSING)
                    if now is not v:
                        undo.append((d, k, now))
                        d[k] = v
            tensors = self._changed_tensors()
            if self.before:  # a fresh copy each time: a second backward (retain_graph) recomputes again
                tensors = {**(tensors or {}), **{name: t.clone() for name, t in self.before.items()}}
            with contextlib.nullcontext() if tensors is None else compat.reparametrized(self.module, tensors):
                yield
        finally:
            for d, k, v in reversed(undo):
                if v is _MISSING:
                    d.pop(k, None)
                else:
                    d[k] = v


@compat.not_traced
def _recomputed(module: torch.nn.Module, inner: Callable[..., Any], group: GroupContext,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``inner`` under non-reentrant checkpointing with the group's contexts (never traced:
    Dynamo cannot trace checkpoint with a ``context_fn`` of ours). The recomputation in
    backward sees the state the forward saw (:class:`_ForwardState`).

    Every tensor the module is called with goes to ``checkpoint`` as a positional argument,
    those inside tuples, lists and dicts and the keyword arguments too: checkpoint saves only
    those, and the group then handles them like any save (counted, moved or guarded against a
    later in-place write, R6); any other it would hold by reference, unseen. The forward gets
    the caller's own arguments (a list it appends to is the caller's); a recomputation gets
    them rebuilt around the saved tensors. (Nor are keyword arguments handed to ``checkpoint``,
    which would take those named as its own settings, ``use_reentrant`` or ``debug``, for itself.)"""
    state = _ForwardState(module)
    calls = 0
    leaves, spec = tree_flatten((args, kwargs))
    # (an inference tensor cannot be saved for backward, nor written in place outside inference
    # mode: it is held by reference, as autograd would hold it)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and not leaf.is_inference()]
    tensors = [leaves[i] for i in at]
    for i in at:  # held by checkpoint's saves alone (which the group may move, or let go of)
        leaves[i] = None
    caller = [(args, kwargs)]  # for the forward only

    def run(*saved: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward
            a, k = caller.pop()
            return inner(*a, **k)
        rebuilt = list(leaves)
        for i, t in zip(at, saved):
            rebuilt[i] = t
        a, k = tree_unflatten(rebuilt, spec)
        with state.restored():  # a recomputation
            return inner(*a, **k)

    versions = [t._version for t in tensors]
    out = torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False, context_fn=group.checkpoint_contexts)
    state.forward_ran()
    if any(t._version != v for t, v in zip(tensors, versions)):  # written by the module itself
        group.inputs_written()
        _WRITES_INPUTS.add(module)
    return out


@compat.not_traced
def _open(module: torch.nn.Module, off: Offloader, name: str, recomputable: bool, parts: int,
          args: tuple[Any, ...], kwargs: dict[str, Any], compiled: bool) -> GroupContext:
    inputs = _input_bytes(args, kwargs) if parts else 0
    # a memory budget's step signature, read again where the step's first module is called again:
    # the forward before may have been let go, and this call begin a step (R8)
    if (off.plan.wants_inputs or name == off._step_first) and not compat.in_backward():
        off.plan.step_inputs(args, kwargs, module)
    group = GroupContext(off, name, recomputable=recomputable, parts=parts, inputs=inputs, compiled=compiled).open()
    # at every call that opens a group (not a recomputation, a part of a module run whole, or a
    # module whose parts are the groups): a parameter's storage may have changed (.data, FSDP)
    try:
        group.called_with(args, kwargs)
        if group.opened:
            mark_parameters(*module.parameters())
    except BaseException:  # the caller's try begins after this: no group is left open
        group.close(failed=True)
        raise
    return group


@compat.not_traced
def _close(group: GroupContext, failed: bool) -> None:
    group.close(failed)
