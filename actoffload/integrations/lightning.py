"""Lightning: a ``Callback`` that makes the layers of the ``LightningModule`` offload groups
while it trains.

    from actoffload.integrations.lightning import ActivationOffload

    trainer = L.Trainer(callbacks=[ActivationOffload(layers="model.layers", memory_budget="20GiB")])

See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from ..offloader import Offloader
from .layers import LayersArg, ModelHandle, OffloadHandle

__all__ = ["ActivationOffload", "OffloadHandle"]


class ActivationOffload(pl.Callback):
    """The module's layers are offload groups for each training batch (its forward and
    backward), and plain modules otherwise: validation, testing, prediction, checkpoint saving.

    ``layers``: which modules are groups, given as a ``ModuleList`` (or any modules), an
    attribute path of the ``LightningModule`` (``"model.layers"``), or a function of it; by
    default they are found as for transformers' models
    (:func:`actoffload.integrations.layers.find_layers`: ``_no_split_modules``, the known paths,
    else the one largest ``ModuleList`` of one layer class). ``offloader``: an ``ao.Offloader``,
    or none and its settings as keywords (``memory_budget=``, ...): one is made for the module's
    device at the start of fitting and serves every batch after (a budget's plan carries over).

    Strategies: single device and DDP wrap the layers inside the ``LightningModule`` (which DDP
    holds); under FSDP2 (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``) the
    layers are found after sharding, and their class swap composes with actoffload's. Each rank
    makes its own offloader.
    """

    def __init__(self, offloader: Offloader | None = None, *, layers: LayersArg = None,
                 **offloader_settings: Any):
        self._handles = ModelHandle("ActivationOffload", offloader, layers, offloader_settings)

    @property
    def handle(self) -> OffloadHandle | None:
        """The handle of the module's layers (made at the start of fitting)."""
        return self._handles.handle

    @property
    def offloader(self) -> Offloader | None:
        """The offloader the layers' groups use (made at the start of fitting, if not given)."""
        return self._handles.offloader

    def _resolve(self, pl_module: torch.nn.Module) -> OffloadHandle:
        return self._handles.for_model(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve(pl_module)  # after configure_model and the strategy's setup: on the device, sharded

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._handles.attach_for_step(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._detach()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        self._handles.remove()
