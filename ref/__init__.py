"""actoffload.ref: the reference offloader (the oracle)."""

from .offloader import RefOffloader

__all__ = ["RefOffloader"]
