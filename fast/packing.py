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

from actoffload.triton_kernels.layout import packed_layout


class Packer:
    """Packs flat uint8 spans into a staging buffer and unpacks them again."""

    def __init__(self, device: torch.device):
        self.device = device
        # Decided before the kernels' module is imported: on a machine without a GPU that
        # import turns the interpreter on, which only tests (and the curious) should pay for.
        self._reference = device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        if self._reference:
            self.name = "torch-reference"
        else:
            from actoffload.triton_kernels import pack as kernels

            self._k = kernels
            self.name = "triton" if device.type == "cuda" else "triton-interpreter"

    def layout(self, sizes: list[int]) -> tuple[list[int], int]:
        """16-byte aligned offsets of each span in the packed buffer, and its size."""
        return packed_layout(sizes, align=16)

    def prepare(self, ptrs: list[int], offsets: list[int], sizes: list[int], total: int):
        """Host-side work of a pack or unpack, done before entering a copy stream."""
        if self._reference:
            return (ptrs, offsets, sizes)
        return self._k.make_table(ptrs, offsets, sizes, total, self.device)

    def pack(self, prepared, total: int) -> torch.Tensor:
        """A new device buffer of ``total`` bytes holding the prepared spans (current stream)."""
        stage = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._run(prepared, stage, True)
        return stage

    def unpack(self, prepared, stage: torch.Tensor) -> None:
        """Copy each prepared span out of ``stage`` to its address (current stream)."""
        self._run(prepared, stage, False)

    def _run(self, prepared, stage: torch.Tensor, to_packed: bool) -> None:
        if self._reference:
            _copy_table_reference(*prepared, stage, to_packed)
        else:
            self._k.launch_table(prepared, stage, to_packed)


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
