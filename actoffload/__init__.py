"""actoffload: offload the activations autograd saves for backward to host memory.

    import actoffload as ao
    off = ao.Offloader()                 # impl: $OFFLOAD_IMPL, else fast on CUDA, ref on CPU
    ao.wrap(model.blocks, off)           # each block is a group
    model(x).sum().backward()            # gradients bitwise equal to running without it

See docs/semantics.md for the rules (R1..R10) both implementations follow.
"""

from . import ops
from .engine import HostMemoryError
from .factory import IMPLS, Offloader, resolve_impl
from .grouped import GroupedTensor
from .marks import mark_activation_offload, mark_not_offload
from .ops import select_modules
from .quantized import QuantizedTensor, quantize
from .wrap import WrapHandle, wrap

__version__ = "0.1.0"

__all__ = [
    "IMPLS",
    "GroupedTensor",
    "HostMemoryError",
    "Offloader",
    "QuantizedTensor",
    "WrapHandle",
    "mark_activation_offload",
    "mark_not_offload",
    "ops",
    "quantize",
    "resolve_impl",
    "select_modules",
    "wrap",
]
