"""Finding a model's layers, and a handle that wraps them (and takes them off) on demand.

Shared by the framework integrations; imports no framework.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence, Union

import torch

from ..fast.packing import PACKERS
from ..offloader import Offloader
from ..settings import check_choice, check_device
from ..wrapping import WrapHandle, transient_hook, wrap

# Where the common architectures keep their decoder layers (transformers' names); tried in this
# order when the model says nothing through ``_no_split_modules``.
KNOWN_PATHS = (
    "model.layers",                 # Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral, OLMo, ...
    "model.language_model.layers",  # vision-language models (Llava, Gemma 3, Qwen2-VL, ...)
    "language_model.model.layers",
    "transformer.h",                # GPT-2, GPT-J, GPT-Neo, Falcon, BLOOM, StarCoder
    "gpt_neox.layers",              # GPT-NeoX, Pythia
    "model.decoder.layers",         # OPT, BART's decoder
    "transformer.blocks",           # MPT
    "layers", "blocks", "h",        # the bare backbones, and models of one's own
)

# what ``layers=`` may be: the modules, a ``ModuleList``, an attribute path, or a function of the model
LayersArg = Union[None, str, torch.nn.Module, Iterable[torch.nn.Module], Callable[[torch.nn.Module], Any]]


def _class_names(module: torch.nn.Module) -> set[str]:
    """Names of the module's classes: its own and its bases (so FSDP2's ``FSDPLlamaDecoderLayer``
    and actoffload's ``OffloadLlamaDecoderLayer`` still count as ``LlamaDecoderLayer``)."""
    return {k.__name__ for k in type(module).__mro__}


def no_split_modules(model: torch.nn.Module) -> set[str]:
    """The layer classes a model names in ``_no_split_modules`` (transformers' models do; a
    wrapper such as PEFT's holds the model among its submodules)."""
    names: set[str] = set()
    for m in model.modules():
        given = getattr(type(m), "_no_split_modules", None) or getattr(m, "_no_split_modules", None)
        if isinstance(given, (list, tuple, set)):
            names.update(n for n in given if isinstance(n, str))
    return names


Stack = Union[torch.nn.ModuleList, torch.nn.Sequential]


def _stacks(model: torch.nn.Module, one_class: bool = True) -> list[tuple[str, Stack]]:
    """Every ``ModuleList`` (or ``Sequential``) of layers, with its path: of one layer class
    (``one_class``), or of any."""
    found: list[tuple[str, Stack]] = []
    for path, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 0:
            if not one_class or len({type(x) for x in m}) == 1:
                found.append((path, m))
    return found


def _outermost(stacks: list[tuple[str, Stack]]) -> list[tuple[str, Stack]]:
    """Those not inside another's layers (groups do not nest)."""
    return [(p, m) for p, m in stacks
            if not any(q != p and p.startswith(q + ".") for q, _ in stacks)]


def _get_path(model: torch.nn.Module, path: str) -> Any:
    if not path.strip(". "):
        raise ValueError("an empty path names the model itself, not its layers")
    obj: Any = model
    for part in path.split("."):
        if not part:
            continue
        obj = obj[int(part)] if part.isdigit() and isinstance(obj, (torch.nn.ModuleList, torch.nn.Sequential)) \
            else getattr(obj, part)
    return obj


def find_layers(model: torch.nn.Module) -> list[tuple[str, Stack]]:
    """The stacks of layers to wrap in ``model``, each as ``(path, ModuleList)``.

    1. The outermost ``ModuleList``s whose layers are each of a class the model lists in
       ``_no_split_modules`` (transformers' models list their decoder layers there; a hybrid
       model's, Jamba's or Zamba2's, alternate two such classes): every such stack, so a
       vision-language model's vision tower is found too.
    2. Otherwise the first of :data:`KNOWN_PATHS` that holds a ``ModuleList`` of one class.
    3. Otherwise the ``ModuleList`` of one class with the most layers (at least two), if no
       other has as many.

    Raises ``ValueError`` naming ``layers=`` and the candidates where none of these finds one.
    """
    stacks = _stacks(model)
    no_split = no_split_modules(model)
    if no_split:
        listed = _outermost([(p, m) for p, m in _stacks(model, one_class=False)
                             if all(_class_names(layer) & no_split for layer in m)])
        if listed:
            return listed
    by_path = dict(stacks)
    # a wrapper (PEFT, DDP, a LightningModule) holds the model under a prefix: try each
    for path in KNOWN_PATHS:
        for p, m in by_path.items():
            if p == path or p.endswith("." + path):
                return [(p, m)]
    several = [(p, m) for p, m in _outermost(stacks) if len(m) >= 2]
    if several:
        most = max(len(m) for _, m in several)
        top = [(p, m) for p, m in several if len(m) == most]
        if len(top) == 1:
            return top
    seen = ", ".join(f"{p or '<model>'} ({len(m)} x {type(m[0]).__name__})" for p, m in stacks) or "none"
    raise ValueError(
        f"could not tell which layers of {type(model).__name__} to offload: pass layers= (the ModuleList of "
        f"its decoder layers, e.g. layers=model.model.layers, or its attribute path as a string, "
        f"layers='model.layers'). ModuleLists of one layer class in the model: {seen}"
    )


def resolve_layers(model: torch.nn.Module, layers: LayersArg) -> tuple[list[torch.nn.Module], list[str]]:
    """The modules to wrap and their group names, from ``layers=`` (see :data:`LayersArg`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload takes the model (an nn.Module); got {type(model).__name__}")
    if layers is None:
        mods: list[torch.nn.Module] = []
        names: list[str] = []
        for path, stack in find_layers(model):
            mods += list(stack)
            names += [f"{path}.{i}" if path else str(i) for i in range(len(stack))]
        return mods, names
    prefix = ""
    given: Any = layers
    if isinstance(layers, str):
        try:
            given = _get_path(model, layers)
        except (AttributeError, IndexError, ValueError) as e:
            raise ValueError(f"layers={layers!r}: {type(model).__name__} has no such submodule ({e})") from None
        prefix = layers
    elif callable(layers) and not isinstance(layers, torch.nn.Module):
        given = layers(model)
    keys: list[str] | None = None
    if isinstance(given, torch.nn.ModuleDict):  # torchtitan's layers: named by their keys
        keys, given = list(given.keys()), list(given.values())
    elif isinstance(given, torch.nn.Module) and not isinstance(given, (torch.nn.ModuleList, torch.nn.Sequential)):
        given = [given]
        if prefix:  # one layer, named by its path
            prefix, _, last = prefix.rpartition(".")
            keys = [last]
    try:
        mods = list(given)
    except TypeError:
        raise TypeError(f"layers= must give nn.Modules (a ModuleList, a list, a path, a function of the model); "
                        f"got {type(given).__name__}") from None
    for m in mods:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"layers= must give nn.Modules; got a {type(m).__name__}")
    if not mods:
        raise ValueError("layers= gives no modules: nothing to offload")
    paths = {id(m): p for p, m in model.named_modules()}
    outside = [i for i, m in enumerate(mods) if id(m) not in paths]
    if outside:
        raise ValueError(f"layers= gives modules that are not {type(model).__name__}'s (at positions "
                         f"{', '.join(map(str, outside[:5]))}): give the layers of the model being trained")
    if not prefix and keys is None:
        return mods, [paths[id(m)] or str(i) for i, m in enumerate(mods)]
    return mods, [f"{prefix}.{k}" if prefix else str(k) for k in (keys if keys is not None else range(len(mods)))]


def model_device(modules: Sequence[torch.nn.Module]) -> torch.device:
    """Where the modules compute: the device of their first parameter or buffer (the CPU if
    they have none, or where they are on the meta device)."""
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            return t.device if t.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")


def make_offloader(offloader: Offloader | None, settings: dict[str, Any],
                   modules: Sequence[torch.nn.Module]) -> Offloader:
    """``offloader``, or a new ``Offloader(**settings)`` for the modules' device (and with
    ``impl="fast"`` where a ``memory_budget`` is given and no ``impl``)."""
    if offloader is not None:
        if settings:
            raise TypeError(f"give either an offloader or its settings, not both (got offloader= and "
                            f"{', '.join(sorted(settings))})")
        if not isinstance(offloader, Offloader):
            raise TypeError(f"offloader= must be an actoffload.Offloader, got {type(offloader).__name__}")
        return offloader
    settings = dict(settings)
    settings.setdefault("device", model_device(modules))
    if settings.get("memory_budget") is not None:
        settings.setdefault("impl", "fast")  # the implementation that plans under a budget
    return Offloader(**settings)


class _GroupedCheckpoint:
    """A checkpointed layer's checkpoint function, run inside the layer's offload group: what
    checkpoint saves of the layer (its inputs) is in the group and moves; the layer's own
    saves are checkpoint's, recomputed in backward (where no group opens)."""

    def __init__(self, func: Callable[..., Any], offloader: Offloader, name: str):
        self.func, self.offloader, self.name = func, offloader, name

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.offloader.group(self.name):
            return self.func(function, *args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # a copy or a pickle of the layer (TRL's reference model) gets transformers' own function,
        # as that function itself reduces (a partial of torch's checkpoint: no actoffload in a pickle)
        own = self.func.__reduce_ex__(protocol)
        return own if isinstance(own, tuple) else (_same, (self.func,))


def _same(func: Callable[..., Any]) -> Callable[..., Any]:
    return func


_CHECKPOINT_FUNC = "_gradient_checkpointing_func"  # transformers' GradientCheckpointingLayer calls it


def checkpointed(module: torch.nn.Module) -> bool:
    """Whether transformers checkpoints the layer (``gradient_checkpointing`` enabled on it)."""
    return bool(getattr(module, "gradient_checkpointing", False)) and callable(vars(module).get(_CHECKPOINT_FUNC))


# layers attached by ao.wrap -> their handle, weakly (it holds the layer: a strong value would keep
# the key alive); a copy of a layer is in none, and is made without its hook (transient_hook)
_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[OffloadHandle]] = weakref.WeakKeyDictionary()


def _checkpointed_since(module: torch.nn.Module, args: Any) -> None:
    """A layer attached by ``ao.wrap`` that transformers checkpoints now (checkpointing was
    enabled after attaching): its group is inside the checkpoint, which takes its saves, so
    nothing moves and a budget plans nothing. Said once per handle; attaching again groups its
    checkpoint function instead. (A function, not a bound method: a deep copy of the model
    copies its hooks, and a handle holds locks.)"""
    ref = _ATTACHED.get(module)
    handle = ref() if ref is not None else None
    if handle is not None and not handle.warned and checkpointed(module):
        handle.warned = True
        warnings.warn("gradient checkpointing was enabled on the model after its layers were attached for "
                      "offloading: nothing of theirs is offloaded now (their groups run inside the checkpoint). "
                      "Call offload() after model.gradient_checkpointing_enable(), or handle.remove() and "
                      "handle.attach() again", stacklevel=2)


def _detach_hook(module: torch.nn.Module, hook: Any) -> None:
    hook.remove()
    _ATTACHED.pop(module, None)


class OffloadHandle:
    """A model's layers, the offloader their groups use, and whether they are wrapped now.

    ``attach()`` makes each layer an offload group, named by its path, and ``remove()`` undoes
    it; both may be called again and again (the integrations attach for each training step,
    and remove around evaluation and checkpoint saving). Also a context manager: ``with
    handle:`` attaches, and removes on leaving.

    A layer is attached one of two ways, chosen at ``attach()``:

    - ``ao.wrap``: its forward opens its group, everything it saves is a candidate;
    - a layer transformers checkpoints (``model.gradient_checkpointing_enable()``, or
      ``gradient_checkpointing=True`` in a ``Trainer``'s arguments, TRL's default): its
      checkpoint function runs inside its group, so what checkpoint keeps of the layer, its
      inputs, moves to host memory, and the rest is recomputed in backward as before.
      (A group inside the checkpoint would hand its saves to checkpoint: nothing would move.)
    """

    def __init__(self, modules: list[torch.nn.Module], names: list[str], offloader: Offloader):
        self.modules, self.names, self.offloader = modules, names, offloader
        self._wrap: WrapHandle | None = None
        self._undo: list[Callable[[], None]] = []
        self._attached = False
        self.warned = False  # that checkpointing was enabled after attaching (said once)
        self.warned_unchecked = False  # ... or disabled, where the layers were attached through it
        self.for_step = False  # attached by a framework's callback for a step whose end it has not heard of yet

    @property
    def attached(self) -> bool:
        """Whether the layers are wrapped now."""
        return self._attached

    @property
    def checkpointed(self) -> list[str]:
        """Names of the layers attached through their checkpoint function (while attached)."""
        return [n for m, n in zip(self.modules, self.names)
                if isinstance(vars(m).get(_CHECKPOINT_FUNC), _GroupedCheckpoint)]

    def attach(self) -> OffloadHandle:
        if self._attached:
            return self
        self._detach_left_by_a_step()
        plain, names = [], []
        try:
            for m, name in zip(self.modules, self.names):
                if checkpointed(m):
                    _GROUPING[m] = (self.offloader, name)
                    _ATTACHED[m] = weakref.ref(self)
                    _group_checkpoint(m)
                    # transformers sets a fresh checkpoint function whenever checkpointing is enabled
                    # again (TRL's GRPO disables it around generation): group that one too
                    hook = m.register_forward_pre_hook(_group_checkpoint)
                    self._undo.append(functools.partial(_ungroup_checkpoint, m, hook))
                else:
                    plain.append(m)
                    names.append(name)
            if plain:
                self._wrap = wrap(plain, self.offloader, names=names)
                for m in plain:  # checkpointing enabled after attaching: say that nothing moves
                    _ATTACHED[m] = weakref.ref(self)
                    hook = m.register_forward_pre_hook(transient_hook(_checkpointed_since))
                    self._undo.append(functools.partial(_detach_hook, m, hook))
        except BaseException:
            self._attached = True
            self.remove()
            raise
        self._attached = True
        return self

    def _detach_left_by_a_step(self) -> None:
        """Layers another handle attached for a training step that never ended (an exception in
        the step: transformers' ``Trainer`` tells its callbacks nothing then, so they left them
        wrapped): that step is over, and its handle is removed before these layers are attached
        again (a new ``Trainer``, or ``offload(model)``, on the same model)."""
        for m in self.modules:
            ref = _ATTACHED.get(m)
            other = ref() if ref is not None else None
            if other is not None and other is not self and other.attached and other.for_step:
                warnings.warn(f"{other!r} was still attached: a training step that raised left it so; it is "
                              "removed now, and these layers attached afresh", stacklevel=3)
                other.remove()

    def remove(self) -> None:
        self.for_step = False
        if not self._attached:
            return
        handle, self._wrap = self._wrap, None
        undo, self._undo = self._undo, []
        self._attached = False
        if handle is not None:
            handle.remove()
        for u in reversed(undo):
            u()

    def stats(self) -> dict[str, Any]:
        """The offloader's ``stats()``: what the latest forward's groups did."""
        return self.offloader.stats()

    def __enter__(self) -> OffloadHandle:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        first = f"{self.names[0]}..{self.names[-1]}" if self.names else "none"
        return f"OffloadHandle({len(self.modules)} layers {first}, {type(self.offloader).__name__}, {state})"


# checkpointed layers attached -> their offloader and group name (a copy of a layer is in none)
_GROUPING: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Offloader, str]] = weakref.WeakKeyDictionary()


def _group_checkpoint(module: torch.nn.Module, *args: Any) -> None:
    """Run the layer's checkpoint function inside its group (a forward pre-hook too: a function
    looking the layer up, not a partial holding the offloader, which a deep copy would copy)."""
    grouping = _GROUPING.get(module)
    func = vars(module).get(_CHECKPOINT_FUNC)
    if grouping is not None and callable(func) and not isinstance(func, _GroupedCheckpoint):
        vars(module)[_CHECKPOINT_FUNC] = _GroupedCheckpoint(func, *grouping)
    if grouping is not None and not checkpointed(module) and module.training and torch.is_grad_enabled():
        ref = _ATTACHED.get(module)
        handle = ref() if ref is not None else None
        if handle is not None and not handle.warned_unchecked:  # (generation under no_grad says nothing)
            handle.warned_unchecked = True
            warnings.warn("gradient checkpointing was disabled on the model after its layers were attached for "
                          "offloading through it: nothing of theirs is offloaded now (no group opens outside the "
                          "checkpoint). Call handle.remove() and handle.attach() again after "
                          "model.gradient_checkpointing_disable()", stacklevel=2)


def _ungroup_checkpoint(module: torch.nn.Module, hook: Any) -> None:
    hook.remove()
    _GROUPING.pop(module, None)
    _ATTACHED.pop(module, None)
    func = vars(module).get(_CHECKPOINT_FUNC)
    if isinstance(func, _GroupedCheckpoint):
        vars(module)[_CHECKPOINT_FUNC] = func.func


def handle_for(model: torch.nn.Module, layers: LayersArg = None, offloader: Offloader | None = None,
               **settings: Any) -> OffloadHandle:
    """A detached :class:`OffloadHandle` for ``model``'s layers (found, or as ``layers=`` says)."""
    mods, names = resolve_layers(model, layers)
    return OffloadHandle(mods, names, make_offloader(offloader, settings, mods))


class ModelHandle:
    """What a framework's callback keeps: the :class:`OffloadHandle` of the model it was last
    handed, made anew (with the same offloader) when it is handed another one.

    Example::

        handles = ModelHandle("MyCallback", None, layers=None, settings={"memory_budget": "20GiB"})
        handles.attach_for_step(model)   # each training step
        handles.remove()                 # after it
    """

    def __init__(self, owner: str, offloader: Offloader | None, layers: LayersArg, settings: dict[str, Any]):
        if offloader is not None and settings:
            raise TypeError(f"give {owner} either an offloader or its settings, not both")
        if offloader is not None and not isinstance(offloader, Offloader):
            raise TypeError(f"{owner}: offloader= must be an actoffload.Offloader, got {type(offloader).__name__}")
        if settings:  # each setting checked now (R10), not once training has begun: on the CPU, cheaply
            # (with no CUDA context made here; whether the packer named suits the device is checked then)
            cheap = {k: v for k, v in settings.items() if k not in ("device", "packer")}
            if settings.get("device") is not None:
                check_device(settings["device"])
            if "packer" in settings:
                check_choice("packer", settings["packer"], PACKERS)
                cheap["packer"] = "auto"  # (whether this implementation takes a packer at all)
            make_offloader(None, {**cheap, "device": "cpu"}, [])
        self._given = offloader
        self.layers = layers
        self._settings = settings
        self.handle: OffloadHandle | None = None
        self._model: torch.nn.Module | None = None

    @property
    def offloader(self) -> Offloader | None:
        """The offloader the layers' groups use (made with the first handle, if not given)."""
        return self.handle.offloader if self.handle is not None else self._given

    def for_model(self, model: torch.nn.Module) -> OffloadHandle:
        """The handle of ``model``'s layers (detached when new)."""
        if self.handle is not None and self._model is model:
            return self.handle
        offloader = self.offloader
        if self.handle is not None:
            self.handle.remove()
        self.handle = handle_for(model, self.layers, offloader, **({} if offloader is not None else self._settings))
        self._model = model
        return self.handle

    def attach_for_step(self, model: torch.nn.Module | None) -> OffloadHandle | None:
        """Attach ``model``'s layers (``None``: those of the model last handed, if any) for a
        training step; :meth:`remove` at its end. A step that raised before its end left them
        attached: the next attach of these layers, by this callback or another handle, removes
        that first (:meth:`OffloadHandle.attach`)."""
        handle = self.for_model(model) if model is not None else self.handle
        if handle is not None:
            handle.attach().for_step = True
        return handle

    def remove(self) -> None:
        """Give the layers their own forwards back (until the next :meth:`OffloadHandle.attach`)."""
        if self.handle is not None:
            self.handle.remove()
