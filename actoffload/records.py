"""The engine's records: groups, saved buffers, moved spans, and the handles autograd holds.

Implementations extend :class:`Group` and :class:`Moved` with their own typed fields
(``fast`` adds its copy events and reload buffers), so no state is hung on a shared
object from outside.

Ownership, which is what makes freeing the graph free everything (R8): autograd's graph
owns the handles, a handle owns its group, a group owns its saved buffers, a saved
buffer owns the moved span it is restored from, and a moved span owns its host copy.
The offloader holds groups only weakly.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from . import policy
from .storageref import WeakStorage


class GroupState(enum.Enum):
    OPEN = "open"  # its forward is running
    PENDING = "pending"  # exited; waiting for its commit (keep_last)
    COMMITTED = "committed"  # decided; its spans were moved
    RESIDENT = "resident"  # decided without moving: backward came first, or host memory ran out
    ABORTED = "aborted"  # left by an exception: never committed, freed with its graph
    INERT = "inert"  # saves go to hooks that must see them (allow_mutation_on_saved_tensors)


def holds_span(dev: torch.Tensor, nbytes: int) -> bool:
    """Whether the flat uint8 ``dev`` still has ``nbytes`` bytes in its storage from its offset
    on (the caller may have resized a storage it shares)."""
    return dev.untyped_storage().nbytes() >= dev.storage_offset() + nbytes


class Moved:
    """A byte span moved off the device: one storage's ``[start, start + nbytes)``.

    ``storage`` is the device storage, referenced until the implementation has copied
    the span out; ``host`` is the copy. Saved buffers of several groups may share one
    ``Moved`` (a storage saved in two groups moves once, R5). (Fields that start the same
    for every span are class attributes until set: a commit may move thousands.)
    """

    host: torch.Tensor | None = None
    guard: torch.Tensor | None = None  # shares the storage's version counter
    version_at_copy = 0
    # its latest reload, while a restored tensor still uses it: every alias restored
    # meanwhile shares it (R5), and a second backward (retain_graph) after it was freed
    # reloads again (R8); the span's first byte is at reloaded_at in that storage (a
    # source used in place keeps its offset)
    reloaded: WeakStorage | None = None
    reloaded_at = 0

    def __init__(self, span: policy.Span, storage: torch.UntypedStorage, device: torch.device):
        self.span = span
        self.nbytes = span.nbytes
        self.storage: torch.UntypedStorage | None = storage
        self.device = device

    def remember_reload(self, dev: torch.Tensor) -> None:
        """``dev`` (the span's bytes on the device, restored tensors use it) is its latest reload."""
        self.reloaded, self.reloaded_at = WeakStorage(dev), int(dev.storage_offset())

    def cached_reload(self) -> torch.Tensor | None:
        """Its latest reload, if a restored tensor still uses it and its storage still holds the
        span (nothing resized it since)."""
        whole = self.reloaded.get(self.device) if self.reloaded is not None else None
        if whole is None or not holds_span(whole, self.reloaded_at + self.nbytes):
            return None
        return whole[self.reloaded_at : self.reloaded_at + self.nbytes]

    def source_intact(self) -> bool:
        """The device storage is still referenced and still holds the span: the caller may
        have resized it (``untyped_storage().resize_(0)``) since the commit."""
        return self.storage is not None and self.storage.nbytes() >= self.span.start + self.nbytes

    def source(self) -> torch.Tensor:
        """The span's bytes on the device, as a flat uint8 tensor sharing the storage. Refuses
        a storage resized below the span: ``set_`` would grow it back (uninitialised bytes)."""
        assert self.storage is not None, "the source was already released"
        if not self.source_intact():
            raise RuntimeError(
                f"a saved storage was resized to {self.storage.nbytes()} bytes after the commit that moves its "
                f"bytes [{self.span.start}, {self.span.start + self.nbytes}): its bytes are gone"
            )
        out = torch.empty(0, dtype=torch.uint8, device=self.device)
        return out.set_(self.storage, self.span.start, (self.nbytes,), (1,))

    def unchanged_since_copy(self) -> bool:
        """No in-place write reached the storage through its version counter since the copy."""
        return self.guard is not None and self.guard._version == self.version_at_copy


class MovedView(NamedTuple):
    """How one saved buffer is rebuilt from a moved span: its view of the span's bytes (a
    tuple: one is made for every moved buffer)."""

    moved: Moved
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements, from the span's first byte (policy.Span aligns it)
    conj: bool  # restored with these bits, as set_() alone would drop them
    neg: bool


class SavedBuffer:
    """One plain tensor saved in a group: resident (``tensor``) or moved (``view``).

    A tensor with an autograd history is held as a ``detach()``ed alias: holding the saved
    tensor itself would, for an op's output, close a cycle through the C++ autograd node
    (tensor -> grad_fn -> handle -> group -> tensor) that Python's garbage collector cannot
    see. A tensor without one (a parameter, an input) is held as itself, so backward sees
    it as PyTorch would, a later ``.data`` replacement included.
    """

    __slots__ = ("tensor", "is_parameter", "version", "guard", "view", "derived", "cloned")

    def __init__(self, t: torch.Tensor, is_parameter: bool, derived: bool | None = None):
        self.is_parameter = is_parameter
        # (not t.grad_fn: a Python object for a graph node, which lives as long as the node)
        self.derived = not t.is_leaf if derived is None else derived
        self.tensor: torch.Tensor | None = t.detach() if self.derived else t
        self.version = t._version
        self.guard: torch.Tensor | None = None  # set when the tensor is let go (moved)
        self.view: MovedView | None = None
        self.cloned = False  # ``tensor`` is a private clone (a recomputed group's input); ``guard`` the original


class Group:
    """The saved buffers of one run of one group.

    Settings most groups keep as they are are class attributes (a group sets its own where it
    differs): a step may open thousands of groups, and each instance attribute costs time and
    memory for every one of them.
    """

    exited_at = 0  # the offloader's count of openings when it exited (R4: it commits keep_last later)
    # a node the previous group's forward created that this group's saves come from (graph.py:
    # backward reaches the previous group when it runs that node), looked for in this many saves
    link: Any = None
    link_tries = 0
    # the node that made the tensor its module was called with, in the previous group's forward:
    # its link once its first save with a history is made from it directly (its graph then holds it)
    link_candidate: Any = None
    position = 0  # its place among the groups of its step
    recomputable = False  # a wrapped module: it can run under activation checkpointing
    compiled = False  # ... compiled, or with a compiled submodule: never run under a dispatch mode (wrapping.py)
    parts = 0  # a module opened whole in place of its parts, this many (a memory plan's)
    recompute = False  # it does: its plan says so (plans.Opening)
    selective = False  # recomputed, it keeps its costly ops' outputs and runs only the rest again (selective.py)
    selective_calls: int | None = None  # ... of its first this many costly ops (None: all)
    selective_attention = False  # ... of its fused attention calls only (the matmuls run again too)
    # its recomputed module lets go of its kept inputs once recomputed from; a second
    # backward through the module then needs the first to keep the graph
    release_inputs = False
    guard_inputs = False  # its inputs are copied (or cloned) before later work may write them
    wrote_inputs = False  # recomputed, its module wrote one of its saved inputs in place in its own forward
    # it keeps all it saves: autograd holds them itself, counted only (storage key -> bytes, set
    # when it opens), with none of the per-save work a group that may move does
    kept_whole = False
    kept_storages: dict[int, int]  # (a dict of its own only where kept_whole)
    reached = False  # backward unpacked one of its saves
    plan_state: Any = None  # the plan's own record of this group (``Plan.opened``)
    # once committed: the spans its buffers are rebuilt from (its own and earlier groups'),
    # how many of its buffers each one serves, and each span's first save in the group
    # (forward order).
    moved: tuple[Moved, ...] = ()
    uses: tuple[int, ...] = ()
    saved_at: tuple[int, ...] = ()
    # the group before it, where it looks for its link (graph.py): only there
    prev: weakref.ref[Group] | None = None
    # its saved buffers until it is decided; then none (each lives as long as its handle)
    saved: list[SavedBuffer] | tuple[()] = ()

    def __init__(self, name: str, prev: Group | None, first_seq: int):
        self.name = name  # unique among the groups in stats(): a repeated name gets "#2", ...
        self.state = GroupState.OPEN
        self.saved = []
        self.summary: dict[str, Any] = {"saved": 0, "offloaded": 0, "offloaded_bytes": 0, "kept": {}}
        if prev is not None:
            self.prev = weakref.ref(prev)
        # autograd sequence numbers of the nodes its forward created: [first_seq, end_seq) (both 0
        # where the implementation does not reload ahead, which alone needs them)
        self.first_seq = first_seq
        self.end_seq = first_seq

    def previous(self) -> Group | None:
        return self.prev() if self.prev is not None else None

    def decided(self) -> None:
        """Committed, or kept for good: its saved buffers are no longer held here."""
        self.saved = ()


@dataclass(eq=False, slots=True)
class Handle:
    """What the pack hook returns for a plain tensor; the graph owns it."""

    group: Group
    saved: SavedBuffer


@dataclass(eq=False)
class MultiHandle:
    """What the pack hook returns for a tensor made of several buffers (R7).

    ``parts`` are the buffers, each a :class:`SavedBuffer`, a nested ``MultiHandle``
    (a wrapper subclass inside another) or ``None``; ``rebuild`` puts the tensor back
    together from them. ``guard`` shares the wrapper's own version counter (R6): an in-place
    op on a wrapper subclass need not touch its buffers' counters (``None`` for a type that
    cannot even be detached, and so cannot be written in place either).
    """

    group: Group
    rebuild: Callable[[list[torch.Tensor | None]], torch.Tensor]
    parts: list[SavedBuffer | MultiHandle | None]
    shape: tuple[int, ...]
    version: int
    guard: torch.Tensor | None = field(repr=False)


@dataclass(eq=False)
class DelegatedHandle:
    """A save handed to saved-tensor hooks that must see it (the group is ``INERT``)."""

    group: Group
    packed: Any
    unpack: Callable[[Any], torch.Tensor]
