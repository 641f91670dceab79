"""Repository-wide pytest setup: runs before any test module imports triton or touches CUDA."""

import os

# Bitwise comparisons on CUDA need deterministic cuBLAS (set before CUDA initializes).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter; it reads this at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.use_deterministic_algorithms(True)
