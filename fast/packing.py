"""Packing a group's small spans into one buffer, so they cross the bus in one copy.

Per-tensor copies of 64 KiB reach about a quarter of PCIe bandwidth; one packed copy
of the same bytes runs at full speed. Packing is a device-to-device gather (Triton,
``actoffload.triton_kernels.pack``), cheap next to the bus.

The packer runs the Triton kernels on CUDA, and on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, which the tests set); on the CPU without the
interpreter it uses the kernels' PyTorch references, and says so in ``name``.
"""

from __future__ import annotations

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
            self._pack, self._unpack = kernels.pack, kernels.unpack
        else:
            self.name = "torch-reference"
            self._pack, self._unpack = kernels.pack_reference, kernels.unpack_reference

    def layout(self, sizes: list[int]) -> tuple[list[int], int]:
        """16-byte aligned offsets of each span in the packed buffer, and its size."""
        return self._k.packed_layout(sizes, align=16)

    def pack(self, srcs: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor:
        """A new device buffer of ``total`` bytes holding ``srcs`` at ``offsets`` (current stream)."""
        stage = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._pack(srcs, stage, offsets)
        return stage

    def unpack(self, stage: torch.Tensor, dsts: list[torch.Tensor], offsets: list[int]) -> None:
        self._unpack(stage, dsts, offsets)
