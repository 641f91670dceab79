"""Integrations with the frameworks people train with; each imports its framework only
when imported itself (``actoffload.integrations.transformers``, ``.trl``, ``.lightning``).

- :mod:`actoffload.integrations.transformers`: ``offload(model)`` finds a ``PreTrainedModel``'s
  decoder layers and wraps them; ``ActivationOffloadCallback`` does it for ``Trainer``.
- :mod:`actoffload.integrations.trl`: TRL's trainers (SFT, DPO, ...) through the context they
  enter around each training step.
- :mod:`actoffload.integrations.lightning`: a Lightning ``Callback``.

Layer finding without any framework: :func:`actoffload.integrations.layers.find_layers`.
See docs/integrations.md.
"""
