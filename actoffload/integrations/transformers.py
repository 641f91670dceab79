"""Hugging Face transformers: offload the activations of a ``PreTrainedModel``'s layers.

    from actoffload.integrations.transformers import offload, ActivationOffloadCallback

    handle = offload(model)                        # finds model.model.layers (or transformer.h, ...)
    handle = offload(model, memory_budget="20GiB")  # Offloader settings as keywords
    handle.remove()                                # the layers as they were

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ActivationOffloadCallback()])

See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from ..offloader import Offloader
from .layers import KNOWN_PATHS, LayersArg, ModelHandle, OffloadHandle, find_layers, handle_for

__all__ = ["ActivationOffloadCallback", "OffloadHandle", "find_layers", "offload", "KNOWN_PATHS"]

def offload(model: torch.nn.Module, offloader: Offloader | None = None, *, layers: LayersArg = None,
            **offloader_settings: Any) -> OffloadHandle:
    """Make each decoder layer of ``model`` an offload group; returns the attached handle.

    ``model``: any ``nn.Module`` holding a transformers model (a ``PreTrainedModel``, a PEFT
    model, a DDP module). Its layers are found without naming them
    (:func:`actoffload.integrations.layers.find_layers`: the ``ModuleList`` of the class the
    model lists in ``_no_split_modules``, else ``model.layers``, ``transformer.h``,
    ``gpt_neox.layers``, ...); ``layers=`` names them where that fails (a ``ModuleList``,
    modules, an attribute path such as ``"model.layers"``, or a function of the model).

    ``offloader``: an ``ao.Offloader``; or none, and ``offloader_settings`` (``memory_budget``,
    ``min_offload_bytes``, ...) make one for the layers' device (``impl="fast"`` when a
    ``memory_budget`` is given). ``handle.offloader.stats()`` tells what the latest forward
    moved, ``handle.remove()`` takes the wrap off (``handle.attach()`` puts it back).

    Call it after ``model.activation_checkpointing_enable()``, if at all: a checkpointed layer's
    group then opens around its checkpoint and its inputs move (:class:`OffloadHandle`).

    A wrapped model saves (``save_pretrained``, ``torch.save``, ``state_dict``), copies and
    pickles as the plain model; LoRA adapters added after wrapping are inside the groups.
    """
    return handle_for(model, layers, offloader, **offloader_settings).attach()


class ActivationOffloadCallback(TrainerCallback):
    """``Trainer`` callback: the model's layers are offload groups while it trains.

    The layers are found when the trainer is built (``layers=`` as for :func:`offload`); each
    optimizer step (all its gradient-accumulation micro-batches) runs with them wrapped, and
    the wrap is taken off after the step, so evaluation, logging and checkpoint saving see
    the plain model, and at train end. One offloader serves every step (a memory budget's
    plan carries over); give one, or its settings as keywords::

        Trainer(model, args, train_dataset=ds, callbacks=[ActivationOffloadCallback(memory_budget="20GiB")])

    Activation checkpointing (``activation_checkpointing=True``, formerly ``gradient_checkpointing``)
    composes, bitwise: a checkpointed layer's group is opened
    around its checkpoint, so what checkpoint keeps of it (its inputs) moves to host memory
    and the rest is recomputed as before; the layers it skips
    (``activation_checkpointing_kwargs={"every_n_layers": k}``) offload all they save. A
    ``memory_budget`` instead of gradient checkpointing lets actoffload choose which layers to
    recompute, offload or keep.
    """

    def __init__(self, offloader: Offloader | None = None, *, layers: LayersArg = None,
                 **offloader_settings: Any):
        self._handles = ModelHandle("ActivationOffloadCallback", offloader, layers, offloader_settings)

    @property
    def handle(self) -> OffloadHandle | None:
        """The handle of the model's layers (made at the first train begin)."""
        return self._handles.handle

    @property
    def offloader(self) -> Offloader | None:
        """The offloader the layers' groups use (made at the first train begin, if not given)."""
        return self._handles.offloader

    def _resolve(self, model: torch.nn.Module | None) -> OffloadHandle | None:
        return self.handle if model is None else self._handles.for_model(model)

    def on_init_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **kwargs: Any) -> None:
        from .layers import resolve_layers
        if model is not None:
            resolve_layers(model, self._handles.layers)  # a model whose layers cannot be found fails here, not in train()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        # (a step of an earlier train() that raised left the layers attached: the Trainer has no
        # event for an exception)
        self._handles.remove()
        self._resolve(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                      **kwargs: Any) -> None:
        self._handles.attach_for_step(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._handles.remove()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._handles.remove()
