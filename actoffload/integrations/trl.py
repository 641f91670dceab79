"""TRL: actoffload as the activation offloading of TRL's trainers (SFT, DPO, KTO, reward; GRPO
and the others through the transformers callback).

    from actoffload.integrations.trl import offload

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok)
    offload(trainer, memory_budget="20GiB")    # before trainer.train()
    trainer.train()

See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

import torch
import trl  # noqa: F401  (this integration is for TRL: fail here, plainly, where it is not installed)

from ..offloader import Offloader
from .layers import LayersArg, OffloadHandle, handle_for
from .transformers import ActivationOffloadCallback

__all__ = ["ActivationOffloadCallback", "OffloadHandle", "offload", "offload_context"]

_CONTEXT = "maybe_activation_offload_context"  # what TRL's trainers enter around each training step


def offload_context(model: torch.nn.Module, offloader: Offloader | None = None, *, layers: LayersArg = None,
                    **offloader_settings: Any) -> OffloadHandle:
    """A detached handle on ``model``'s layers that is a reusable context manager: entering
    wraps the layers, leaving takes the wrap off. TRL's SFT, DPO, KTO and reward trainers enter
    ``trainer.maybe_activation_offload_context`` around each training step (forward and
    backward of one micro-batch); :func:`offload` sets it to this."""
    return handle_for(model, layers, offloader, **offloader_settings)


def offload(trainer: Any, offloader: Offloader | None = None, *, layers: LayersArg = None,
            **offloader_settings: Any) -> OffloadHandle:
    """Offload the activations of ``trainer.model``'s layers in each training step; call it
    after building the trainer and before ``trainer.train()``. Returns the handle
    (``handle.offloader.stats()``).

    Trainers that enter ``maybe_activation_offload_context`` around their training step (SFT,
    DPO, KTO, reward) get it replaced by :func:`offload_context`: the layers are wrapped for
    that step only, so evaluation, generation outside the step, a reference model (DPO's, a
    separate copy of the policy) and checkpoint saving see plain modules. Any other trainer
    (GRPO, RLOO, ...) gets :class:`ActivationOffloadCallback`, which wraps the layers for each
    optimizer step. Layers, offloader and its settings (``memory_budget=``, ...) as for
    :func:`actoffload.integrations.transformers.offload`.

    TRL's own ``activation_offloading=True`` is refused: it would register hooks of its own on
    the model; set it to ``False`` and let this replace it.
    """
    args = getattr(trainer, "args", None)
    if getattr(args, "activation_offloading", False):
        raise ValueError(
            f"{type(trainer).__name__} was built with activation_offloading=True, TRL's own offloading, whose hooks "
            "are now on the model: build it with activation_offloading=False and let actoffload offload instead")
    model = getattr(trainer, "model", None)
    if isinstance(trainer, torch.nn.Module) or not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload takes a transformers/TRL Trainer with a model; got {type(trainer).__name__} "
                        "(for a model itself, use actoffload.integrations.transformers.offload)")
    if hasattr(trainer, _CONTEXT):
        handle = offload_context(model, offloader, layers=layers, **offloader_settings)
        setattr(trainer, _CONTEXT, handle)
        return handle
    callback = ActivationOffloadCallback(offloader, layers=layers, **offloader_settings)
    found = callback._resolve(model)
    assert found is not None
    trainer.add_callback(callback)
    return found
