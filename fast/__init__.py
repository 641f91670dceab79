"""actoffload.fast: the CUDA offloader (not built yet)."""

raise NotImplementedError("actoffload.fast is not built yet; use impl='ref'")
