"""Multi-tensor pack / unpack: many small byte ranges <-> one contiguous buffer.

``pack`` gathers ``srcs[i]`` (flat uint8 tensors anywhere in device memory) into
``out[offsets[i] : offsets[i] + srcs[i].numel()]`` in one launch, so a group's many
small saved buffers cross PCIe in one copy; ``unpack`` scatters them back after the
reload. Each has a plain PyTorch function beside it computing the same thing
(``pack_reference`` / ``unpack_reference``), and tests compare the two on awkward
inputs under ``TRITON_INTERPRET=1``.

Kernel layout: program ``(i, j)`` copies tensor ``i``, taking every ``SPLIT``-th block
of ``BLOCK`` words starting at block ``j``. Addresses come from a table of
``(pointer, offset, size)`` per tensor. The word is the widest of 8, 4, 2 or 1 bytes
that divides every pointer, offset and size of the launch, so aligned inputs (the
usual case) move 8 bytes per load instead of one.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the kernels run through Triton's interpreter, which it reads at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .layout import packed_layout  # noqa: E402,F401  (part of this module's interface)

BLOCK = 1024  # words per block
SPLIT = 8  # programs sharing one tensor
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_kernel(table_ptr, packed_ptr, TO_PACKED: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    ptr = tl.load(table_ptr + 3 * i).to(tl.pointer_type(packed_ptr.dtype.element_ty))
    offset = tl.load(table_ptr + 3 * i + 1)
    size = tl.load(table_ptr + 3 * i + 2)
    lanes = tl.arange(0, BLOCK)
    for start in range(j * BLOCK, size, SPLIT * BLOCK):
        idx = start + lanes
        mask = idx < size
        if TO_PACKED:
            tl.store(packed_ptr + offset + idx, tl.load(ptr + idx, mask=mask), mask=mask)
        else:
            tl.store(ptr + idx, tl.load(packed_ptr + offset + idx, mask=mask), mask=mask)


def _check_packed(packed: torch.Tensor, what: str) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous():
        raise ValueError(f"{what}: the packed buffer must be a contiguous 1-D uint8 tensor")


def _check(tensors: list[torch.Tensor], packed: torch.Tensor, offsets: list[int], what: str) -> None:
    _check_packed(packed, what)
    if len(tensors) != len(offsets):
        raise ValueError(f"{what}: {len(tensors)} tensors but {len(offsets)} offsets")
    for t, o in zip(tensors, offsets):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{what}: every tensor must be a contiguous 1-D uint8 tensor (a byte view)")
        if t.device != packed.device:
            raise ValueError(f"{what}: tensor on {t.device} but packed buffer on {packed.device}")
        if o < 0 or o + t.numel() > packed.numel():
            raise ValueError(f"{what}: range [{o}, {o + t.numel()}) outside the packed buffer of {packed.numel()} bytes")


def _check_runnable(packed: torch.Tensor, what: str) -> None:
    if not packed.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{what}: Triton runs CPU tensors only through its interpreter; set TRITON_INTERPRET=1 "
            f"before triton is imported, or use {what}_reference"
        )


def make_table(ptrs: list[int], offsets: list[int], sizes: list[int], packed_nbytes: int, device: torch.device,
               packed_ptr: int = 0):
    """Host-side preparation of one launch: ``(table, word)``, or ``None`` if nothing to copy.

    Separate from :func:`launch_table` so a caller can prepare before entering a copy
    stream and keep host work off the device timeline. ``packed_ptr`` is the packed
    buffer's address where already known (a fresh allocation is aligned enough). The
    table stays on the host (pinned for a CUDA device): :func:`launch_table` uploads it
    on the stream that runs the kernel, so the device copy lives in that stream's order.
    """
    if not len(ptrs) == len(offsets) == len(sizes):
        raise ValueError(f"copy_table: {len(ptrs)} pointers, {len(offsets)} offsets and {len(sizes)} sizes")
    rows = [(p, o, n) for p, o, n in zip(ptrs, offsets, sizes) if n > 0]
    if not rows:
        return None
    if min(o for _, o, _ in rows) < 0 or max(o + n for _, o, n in rows) > packed_nbytes:
        raise ValueError(f"copy_table: a range falls outside the packed buffer of {packed_nbytes} bytes")
    word = 8
    for v in [packed_ptr] + [v for row in rows for v in row]:
        while v % word:
            word //= 2
    table = torch.tensor([(p, o // word, n // word) for p, o, n in rows], dtype=torch.int64).reshape(-1)
    if device.type == "cuda":
        table = table.pin_memory()  # uploaded asynchronously by launch_table
    return table, word


def launch_table(prepared, packed: torch.Tensor, to_packed: bool) -> None:
    """Run a table from :func:`make_table` on ``packed``, on the current stream."""
    if prepared is None:
        return
    table, word = prepared
    _check_packed(packed, "copy_table")
    if packed.data_ptr() % word:
        raise ValueError(f"copy_table: the packed buffer is not aligned to the table's {word}-byte words")
    _check_runnable(packed, "pack" if to_packed else "unpack")
    if packed.is_cuda:
        # On the current stream, the kernel's: its allocator reuses this block only after
        # the kernel (no host synchronization; the pinned source is kept until the copy ran).
        table = table.to(packed.device, non_blocking=True)
    words = packed[: packed.numel() // word * word].view(_WORD_DTYPES[word])
    _copy_kernel[(table.numel() // 3, SPLIT)](table, words, TO_PACKED=to_packed, BLOCK=BLOCK, SPLIT=SPLIT)


def copy_table(ptrs: list[int], offsets: list[int], sizes: list[int], packed: torch.Tensor, to_packed: bool) -> None:
    """The kernel behind :func:`pack` / :func:`unpack`, on raw device addresses.

    Copies ``sizes[i]`` bytes between address ``ptrs[i]`` and ``packed[offsets[i]:]``
    (into ``packed`` if ``to_packed``). The caller keeps the memory behind ``ptrs``
    alive until the launch has run. One launch on the current stream.
    """
    prepared = make_table(ptrs, offsets, sizes, packed.numel(), packed.device, packed.data_ptr())
    launch_table(prepared, packed, to_packed)


def pack(srcs: list[torch.Tensor], out: torch.Tensor, offsets: list[int]) -> None:
    """Copy each flat uint8 ``srcs[i]`` into ``out[offsets[i]:][:len]`` (one launch).

    >>> a, b = torch.arange(3, dtype=torch.uint8), torch.arange(5, dtype=torch.uint8)
    >>> out = torch.zeros(16, dtype=torch.uint8)
    >>> pack([a, b], out, [0, 8]); out[:13].tolist()
    [0, 1, 2, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]
    """
    _check(srcs, out, offsets, "pack")
    copy_table([t.data_ptr() for t in srcs], offsets, [t.numel() for t in srcs], out, to_packed=True)


def unpack(packed: torch.Tensor, dsts: list[torch.Tensor], offsets: list[int]) -> None:
    """Copy ``packed[offsets[i]:][:len]`` into each flat uint8 ``dsts[i]`` (one launch)."""
    _check(dsts, packed, offsets, "unpack")
    copy_table([t.data_ptr() for t in dsts], offsets, [t.numel() for t in dsts], packed, to_packed=False)


def pack_reference(srcs: list[torch.Tensor], out: torch.Tensor, offsets: list[int]) -> None:
    """What :func:`pack` computes, in plain PyTorch."""
    _check(srcs, out, offsets, "pack")
    for s, o in zip(srcs, offsets):
        out[o : o + s.numel()].copy_(s)


def unpack_reference(packed: torch.Tensor, dsts: list[torch.Tensor], offsets: list[int]) -> None:
    """What :func:`unpack` computes, in plain PyTorch."""
    _check(dsts, packed, offsets, "unpack")
    for d, o in zip(dsts, offsets):
        d.copy_(packed[o : o + d.numel()])
