"""Packing a group's small spans into one buffer, so they cross the bus in one copy.

Per-tensor copies of 64 KiB reach about a quarter of PCIe bandwidth; one packed copy
of the same bytes runs at full speed. Packing is a device-to-device gather (Triton,
``actoffload.triton_kernels.pack``), cheap next to the bus.

The packer runs the Triton kernels on CUDA, and on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, which the tests set); on the CPU without the
interpreter it uses the kernels' PyTorch references, and says so in ``name``.
"""

from __future__ import annotations

import ctypes
import os

import torch


def round16(n: int) -> int:
    """Device buffers are rounded up to 16 bytes so they can be viewed as any dtype."""
    return (n + 15) // 16 * 16


class Packer:
    """Packs flat uint8 spans into a staging buffer and unpacks them again."""

    def __init__(self, device: torch.device):
        from actoffload.triton_kernels import pack as kernels

        self._k = kernels
        self.device = device
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            self.name = "triton" if device.type == "cuda" else "triton-interpreter"
            self._copy = kernels.copy_table
        else:
            self.name = "torch-reference"
            self._copy = _copy_table_reference

    def layout(self, sizes: list[int]) -> tuple[list[int], int]:
        """16-byte aligned offsets of each span in the packed buffer, and its size."""
        return self._k.packed_layout(sizes, align=16)

    def pack(self, ptrs: list[int], offsets: list[int], sizes: list[int], total: int) -> torch.Tensor:
        """A new device buffer of ``total`` bytes holding ``sizes[i]`` bytes from each address
        ``ptrs[i]`` at ``offsets[i]`` (on the current stream)."""
        stage = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._copy(ptrs, offsets, sizes, stage, True)
        return stage

    def unpack(self, stage: torch.Tensor, ptrs: list[int], offsets: list[int], sizes: list[int]) -> None:
        """Copy ``stage[offsets[i]:][:sizes[i]]`` to each address ``ptrs[i]``."""
        self._copy(ptrs, offsets, sizes, stage, False)


def _copy_table_reference(ptrs, offsets, sizes, packed, to_packed) -> None:
    """What ``copy_table`` does, for CPU memory, in plain PyTorch (no interpreter needed)."""
    for ptr, off, n in zip(ptrs, offsets, sizes):
        if n == 0:
            continue
        other = _bytes_at(ptr, n)
        if to_packed:
            packed[off : off + n].copy_(other)
        else:
            other.copy_(packed[off : off + n])


def _bytes_at(ptr: int, n: int) -> torch.Tensor:
    """A uint8 tensor over ``n`` bytes of CPU memory at address ``ptr`` (no copy)."""
    array = (ctypes.c_uint8 * n).from_address(ptr)
    return torch.frombuffer(array, dtype=torch.uint8)
