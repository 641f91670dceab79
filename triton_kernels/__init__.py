"""actoffload.triton_kernels: Triton kernels used by actoffload.fast (multi-tensor pack/unpack)."""
