"""actoffload: offload the activations autograd saves for backward to host memory.

    import actoffload as ao
    off = ao.Offloader()                 # impl: $OFFLOAD_IMPL, else fast on CUDA, ref on CPU
    ao.wrap(model.blocks, off)           # each block is a group
    model(x).sum().backward()            # gradients bitwise equal to running without it

See docs/semantics.md for the rules (R1..R10) both implementations follow.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path as _Path
from typing import TYPE_CHECKING, Any

# In a source checkout, ref/, fast/ and triton_kernels/ sit beside this package (an
# installed copy has them inside it as actoffload.ref, ...): find them there too, so that
# running from the checkout works whether or not the package is also installed.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "ref" / "offloader.py").is_file() and not (_Path(__file__).parent / "ref").is_dir():
    __path__.append(str(_checkout))

__version__ = "0.2.0"

# The public names, each imported from its module on first use: `actoffload --help` then
# answers without importing torch.
_EXPORTS = {
    "IMPLS": "settings", "resolve_impl": "settings",
    "GroupedTensor": "grouped", "QuantizedTensor": "quantized", "quantize": "quantized",
    "HostMemoryError": "hostmem", "Observer": "observe", "Offloader": "offloader",
    "WrapHandle": "wrapping", "wrap": "wrapping", "select_modules": "ops",
    "mark_activation_offload": "marks", "mark_not_offload": "marks",
    "Plan": "plans", "Opening": "plans", "BudgetTooSmall": "budget.search",
}
__all__ = sorted([*_EXPORTS, "ops"])


def __getattr__(name: str) -> Any:
    if name == "ops":
        return importlib.import_module(".ops", __name__)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'actoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module("." + _EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


if "torch" in sys.modules:
    # A training script imported torch already: record parameters from now on (R3), also
    # those of models built before the first Offloader. (Without torch loaded, as for
    # `actoffload --help`, this waits for the first use of anything above.)
    importlib.import_module(".marks", __name__)

if TYPE_CHECKING:
    from . import ops
    from .budget.search import BudgetTooSmall
    from .grouped import GroupedTensor
    from .hostmem import HostMemoryError
    from .marks import mark_activation_offload, mark_not_offload
    from .observe import Observer
    from .offloader import Offloader
    from .ops import select_modules
    from .plans import Opening, Plan
    from .quantized import QuantizedTensor, quantize
    from .settings import IMPLS, resolve_impl
    from .wrapping import WrapHandle, wrap
