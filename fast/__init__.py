"""actoffload.fast: the CUDA offloader (stream-overlapped, pooled, packed)."""

from .offloader import FastOffloader

__all__ = ["FastOffloader"]
