"""Every private PyTorch API actoffload relies on, in one place.

Supported torch: the range in ``pyproject.toml``; CI runs the suite on its newest
release and the rule tests on its oldest. Each function below has a test of its own in
``tests/test_compat.py``, so a torch release that changes one of them fails there, by
name, rather than somewhere deep in a training step.
"""

from __future__ import annotations

import functools
import importlib
import operator
import sys
import weakref
from typing import Any, Callable, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# Dynamo's Python side (torch._dynamo) takes seconds to import, about half of importing this
# package: not_traced reaches Dynamo through its C side alone, and imports the rest only once
# Dynamo is running (and so imported).
try:  # (not_traced: where torch lacks any of these, every call goes through disable's wrapper)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback

    _SEES_DYNAMO = hasattr(torch.compiler, "_is_compiling_flag")
except ImportError:  # pragma: no cover - an older torch
    _SEES_DYNAMO = False


def _skip_code(code: Any) -> None:
    """Dynamo's ``skip_code``: it never compiles a frame of ``code``, though it still compiles
    what that frame calls. Through Dynamo's C side where it has the calls for it."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # pragma: no cover - a torch whose C side names them otherwise
        from torch._dynamo.eval_frame import skip_code

        skip_code(code)
        return
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))

F = TypeVar("F", bound=Callable[..., Any])


# Several of the calls below are called as C functions (a getter, a method, a partial), with no
# Python frame of their own: each runs at every save or every group of a step, thousands of times.

# ---------------------------------------------------------------- storages
# storage_id(storage) -> int: identity of a storage, the address of its StorageImpl
storage_id: Callable[[torch.UntypedStorage], int] = operator.attrgetter("_cdata")


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (raises for a tensor without one)."""
    return storage_id(t.untyped_storage())


def storage_weakref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage (``.expired()`` once it was freed)."""
    return StorageWeakRef(t.untyped_storage())


def storage_from_weakref(ref: StorageWeakRef) -> torch.UntypedStorage | None:
    """The storage behind ``ref`` while it lives, else ``None``."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


# ---------------------------------------------------------------- version counters
def version_guard(t: torch.Tensor) -> torch.Tensor:
    """A storage-less tensor sharing ``t``'s version counter (R6 after ``t`` is dropped).

    ``detach()`` shares the version counter; assigning ``.data`` swaps the storage out
    but keeps the counter, so in-place writes to ``t`` or any view of it still show. A
    wrapper subclass's detached copy also holds its inner tensors as attributes: those
    are dropped too, so the guard holds no memory.
    """
    guard = t.detach()
    guard.data = _empty(t.dtype, t.device)
    if type(guard) is not torch.Tensor:
        vars(guard).clear()
    return guard


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One empty tensor per dtype and device, whose storage every guard may share: a guard
    is made for each save of a recomputed group, and allocating each its own took most of it."""
    key = (dtype, device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


# ---------------------------------------------------------------- dispatch modes
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)


def without_dispatch_modes() -> Any:
    """A context in which ops skip the Python dispatch modes that are active (a
    ``TorchDispatchMode`` neither sees nor changes them); the modes stay, and see what runs after."""
    return torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS)


# ---------------------------------------------------------------- tensor kinds
# is_zero_tensor(t) -> bool: a ZeroTensor (forward-mode AD's implicit zeros), which has no data to move
is_zero_tensor: Callable[[torch.Tensor], bool] = torch.Tensor._is_zerotensor


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its negative bit set (the lazy negation ``conj().imag`` produces)."""
    return torch._neg_view(t)


# ---------------------------------------------------------------- autograd
def node_sequence_nr(node: Any) -> int:
    """The sequence number of an autograd node (its creation order on its thread)."""
    return node._sequence_nr()


# sequence_nr() -> int: the sequence number the next autograd node created on this thread will get
sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr


_graph_task_id = torch._C._current_graph_task_id  # (-1: no backward pass runs on this thread)


def in_backward() -> bool:
    """Whether this thread is running a backward pass (checkpoint recomputes there)."""
    return _graph_task_id() != -1


def backward_keeps_graph() -> bool:
    """Whether the running backward pass keeps its graph for another (``retain_graph``);
    ``True`` where this torch cannot say."""
    keeps = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keeps is None else bool(keeps())


def current_node() -> Any:
    """The autograd node whose backward is running on this thread (``None`` outside one)."""
    return torch._C._current_autograd_node()


def will_execute(node: Any) -> bool:
    """Whether the running backward pass will execute ``node``."""
    return torch._C._will_engine_execute_node(node)


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass has finished (call it during one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def mutation_on_saved_allowed() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is active."""
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


# current_saved_tensors_hooks() -> (pack, unpack) | None: the innermost saved-tensor hooks active
# on this thread
current_saved_tensors_hooks: Callable[[], tuple[Callable, Callable] | None] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False)


# What ``torch.autograd.graph.saved_tensors_hooks`` does on entering and leaving, without a context
# manager object: one call each (a step opens and closes a group's hooks thousands of times).
push_saved_tensors_hooks: Callable[[Callable, Callable], None] = torch._C._autograd._push_saved_tensors_default_hooks
pop_saved_tensors_hooks: Callable[[], None] = torch._C._autograd._pop_saved_tensors_default_hooks


def hooks_own_saves(hooks: tuple[Callable, Callable] | None) -> bool:
    """Whether saved-tensor hooks active around a group must see every save made there: the
    forward of non-reentrant activation checkpointing (which recomputes the region and pairs
    its saves by position), or ``allow_mutation_on_saved_tensors()``."""
    if hooks is None:
        return False
    pack = hooks[0]
    in_checkpoint = (getattr(pack, "__module__", None) == "torch.utils.checkpoint"
                     and getattr(pack, "__qualname__", "").startswith("_checkpoint_hook."))
    return in_checkpoint or mutation_on_saved_allowed()


# ---------------------------------------------------------------- compile, CUDA
def not_traced(fn: F) -> F:
    """Keep ``torch.compile`` out of ``fn``: Dynamo breaks the graph there and runs it eagerly.

    Calls that Dynamo cannot see (no callback of its own is set on this thread, as one is while
    compiled code runs, and no compilation or export is under way) go straight to ``fn``:
    ``torch.compiler.disable``'s wrapper costs about a microsecond a call, and a step crosses
    four for each of its groups. Dynamo never compiles the dispatching call itself (its code is
    skipped, and it calls no Python function of ours before choosing), and one tracing a caller
    breaks the graph at it, as at any disabled function. Positional arguments only: taking
    keywords would cost a dict a call."""
    if not _SEES_DYNAMO:  # pragma: no cover - an older torch
        return torch.compiler.disable(fn, recursive=True)
    untraced: list[Callable[..., Any]] = []  # disable's wrapper, made the first time Dynamo runs

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if _dynamo_callback() is not None or torch.compiler._is_compiling_flag:  # (is_compiling(), set by export too)
            if not untraced:
                untraced.append(torch.compiler.disable(fn, recursive=True))
            return untraced[0](*args)
        return fn(*args)

    _skip_code(call.__code__)  # type: ignore[attr-defined]  # (one code object for every function this wraps)
    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def in_function_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``vmap``, ...) runs its
    function on this thread now."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def stream_is_capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pin_exactly(host: torch.Tensor) -> None:
    """Page-lock ``host`` in place for fast copies; unpinned again when it is freed.

    PyTorch's pinned allocator rounds requests up to a power of two; registering the
    exact buffer wastes nothing.
    """
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0))
    weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())


def host_cache_emptier() -> Callable[[], None] | None:
    """PyTorch's call that gives its cached pinned host memory back (its name moved between
    releases), or ``None`` where this torch has none."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            return fn
    return None


def empty_host_cache() -> bool:
    """Give PyTorch's cached pinned host memory back to the system, for benchmarks that run
    many offloaders in one process; ``False`` where there is nothing to do (no CUDA)."""
    fn = host_cache_emptier()
    if fn is None or not torch.cuda.is_available():
        return False
    fn()
    return True


# ---------------------------------------------------------------- modules
def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """A context manager in which ``module``'s parameters and buffers named in ``tensors``
    (dotted names, as ``named_parameters`` gives them) are those tensors, as inside
    ``torch.func.functional_call``; the module's own come back at its exit."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=False, strict=False)


@functools.cache
def _torch_class(module: str, name: str) -> type | tuple[()]:
    """Class ``name`` of torch's ``module``, looked up once (asked of every submodule at every
    call); ``()`` where this torch has none (built without distributed, say), which
    ``isinstance`` matches with nothing."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # pragma: no cover - a torch without it
        return ()


def compiled_module_class() -> type | tuple[()]:
    """The class ``torch.compile(module)`` returns (Dynamo's ``OptimizedModule``); ``()`` while
    Dynamo is not imported, as no module can be compiled then (importing it costs seconds)."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        return ()
    return _torch_class("torch._dynamo.eval_frame", "OptimizedModule")


def parameters_swapped_by_fsdp(module: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) manages ``module``'s own parameters: it swaps them between
    sharded and gathered around each of its forwards, and gathers them again for a recomputation."""
    return isinstance(module, _torch_class("torch.distributed.fsdp", "FSDPModule"))


def own_tensors(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of the registries of the parameters and of the buffers ``module`` holds itself
    (not its submodules'), by name; a value may be ``None``. A fraction of the time of
    ``named_parameters(recurse=False)``: read at every forward of a recomputed group."""
    return dict(module._parameters), dict(module._buffers)


def holds_own_tensors(module: torch.nn.Module, tensors: tuple[dict[str, Any], dict[str, Any]]) -> bool:
    """Whether ``module``'s registries hold exactly ``tensors`` (:func:`own_tensors` of an
    earlier moment): the same names for the very same objects, compared without copying (a
    registry keeps a replaced entry's place)."""
    registries: tuple[dict[str, Any], dict[str, Any]] = (module._parameters, module._buffers)
    return all(now.keys() == then.keys() and all(map(operator.is_, now.values(), then.values()))
               for now, then in zip(registries, tensors))
