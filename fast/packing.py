"""Packing a group's small spans into one buffer, so they cross the bus in one copy.

Per-tensor copies of 64 KiB reach about a quarter of PCIe bandwidth; one packed copy
of the same bytes runs at full speed. Packing is a device-to-device gather (Triton,
``actoffload.triton_kernels.pack``), cheap next to the bus.

Which packer runs is chosen explicitly (``FastOffloader(packer=...)``): ``"auto"`` runs
the Triton kernels on CUDA and their PyTorch reference on the CPU; ``"triton"`` runs the
kernels on the CPU too, through Triton's interpreter (slow: for testing the kernels);
``"torch"`` runs the reference everywhere. ``name`` says which one runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from actoffload.triton_kernels.layout import packed_layout

PACKERS = ("auto", "triton", "torch")


class Packer:
    """Packs flat uint8 spans into a staging buffer and unpacks them again."""

    def __init__(self, device: torch.device, kind: str = "auto"):
        self.device = device
        # Decided before the kernels' module is imported: on a machine without a GPU that
        # import turns Triton's interpreter on, which only the kernels' tests should pay for.
        self._reference = kind == "torch" or (kind == "auto" and device.type != "cuda")
        self._k: Any = None
        if self._reference:
            self.name = "torch-reference"
        else:
            from actoffload.triton_kernels import pack as kernels

            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "packer='triton' on the CPU runs Triton's interpreter, which must be turned on "
                    "(TRITON_INTERPRET=1) before triton is first imported; with a GPU visible it is not. "
                    "Use packer='auto' or 'torch' on the CPU."
                )
            self._k = kernels
            self.name = "triton" if device.type == "cuda" else "triton-interpreter"

    def layout(self, sizes: list[int]) -> tuple[list[int], int]:
        """Offsets of each span in the packed buffer, and its size: back to back, no padding.

        Each offset is aligned to the widest power of two up to 16 that divides every size, so
        the offsets add no padding (host memory stays within R9's bound however small the
        spans: 16-byte alignment held four times the bytes of one-float tensors), and the
        kernels' word (the widest dividing every pointer, offset and size of a launch) is as
        wide as the sizes alone allow it to be anyway.
        """
        align = 16
        for n in sizes:
            while n % align:
                align //= 2
        return packed_layout(sizes, align=align)

    def prepare(self, spans: list[torch.Tensor], offsets: list[int], total: int) -> Any:
        """Host-side work of a pack or unpack of the flat uint8 ``spans``, done before entering
        a copy stream. The caller keeps the spans' memory alive until the launch has run."""
        if self._reference:
            return (spans, offsets)
        return self._k.make_table([t.data_ptr() for t in spans], offsets, [t.numel() for t in spans], total,
                                  self.device)

    def stage(self, total: int) -> torch.Tensor:
        """A device buffer of ``total`` bytes to pack into or unpack from, from the current
        stream's pool (allocate it on the compute stream, then ``record_stream`` the copy stream)."""
        return torch.empty(total, dtype=torch.uint8, device=self.device)

    def pack(self, prepared: Any, stage: torch.Tensor) -> None:
        """Copy each prepared span into ``stage`` (current stream)."""
        self._run(prepared, stage, True)

    def unpack(self, prepared: Any, stage: torch.Tensor) -> None:
        """Copy each prepared span out of ``stage`` to where it belongs (current stream)."""
        self._run(prepared, stage, False)

    def _run(self, prepared: Any, stage: torch.Tensor, to_packed: bool) -> None:
        if not self._reference:
            self._k.launch_table(prepared, stage, to_packed)
            return
        spans, offsets = prepared  # what the kernels do, in plain PyTorch
        for t, off in zip(spans, offsets):
            if to_packed:
                stage[off : off + t.numel()].copy_(t)
            else:
                t.copy_(stage[off : off + t.numel()])
