"""Repository-wide pytest setup: runs before any test module imports triton or touches CUDA."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter; it reads this at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from actoffload.tools.determinism import use_deterministic  # noqa: E402  (imports triton)

# Bitwise comparisons need deterministic kernels; this also sets CUBLAS_WORKSPACE_CONFIG,
# which cuBLAS reads when CUDA's first matmul makes its handle, so it comes first.
use_deterministic(True)
