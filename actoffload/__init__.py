"""actoffload: offload the activations autograd saves for backward to host memory.

    import actoffload as ao
    off = ao.Offloader()                 # impl: $OFFLOAD_IMPL, else fast on CUDA, ref on CPU
    ao.wrap(model.blocks, off)           # each block is a group
    model(x).sum().backward()            # gradients bitwise equal to running without it

See docs/semantics.md for the rules (R1..R10) both implementations follow.
"""

from pathlib import Path as _Path

# In a source checkout, ref/, fast/ and triton_kernels/ sit beside this package (an
# installed copy has them inside it as actoffload.ref, ...): find them there too, so that
# running from the checkout works whether or not the package is also installed.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "ref" / "offloader.py").is_file() and not (_Path(__file__).parent / "ref").is_dir():
    __path__.append(str(_checkout))  # noqa: F821  (a package's own __path__)

from . import ops  # noqa: E402
from .grouped import GroupedTensor  # noqa: E402
from .hostmem import HostMemoryError  # noqa: E402
from .marks import mark_activation_offload, mark_not_offload  # noqa: E402
from .observe import Observer  # noqa: E402
from .offloader import Offloader  # noqa: E402
from .ops import select_modules  # noqa: E402
from .quantized import QuantizedTensor, quantize  # noqa: E402
from .settings import IMPLS, resolve_impl  # noqa: E402
from .wrap import WrapHandle, wrap  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    "IMPLS",
    "GroupedTensor",
    "HostMemoryError",
    "Observer",
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
