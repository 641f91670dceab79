"""transformers' Trainer with actoffload: a tiny random-init Llama trains a few steps on the CPU,
with and without ActivationOffloadCallback, and the two runs end bitwise equal.

    python examples/integrations/transformers_trainer.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402  (sets the offline environment before transformers is imported)

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from actoffload.integrations.transformers import ActivationOffloadCallback  # noqa: E402


def train(callbacks: list, out: str) -> Trainer:
    model = tiny.llama()
    args = TrainingArguments(output_dir=out, **tiny.trainer_args(max_steps=4))
    trainer = Trainer(model=model, args=args, train_dataset=tiny.TokenDataset(), callbacks=callbacks)
    trainer.train()
    return trainer


def main() -> None:
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as out:
        plain = train([], out)
        # min_offload_bytes=0: the tiny model's activations are far under the 1 MiB default
        offload = ActivationOffloadCallback(min_offload_bytes=0)
        offloaded = train([offload], out)
    moved = offload.offloader.stats()["offloaded_bytes"] if offload.offloader else 0
    same = tiny.same_weights(plain.model, offloaded.model) and tiny.losses(plain) == tiny.losses(offloaded)
    print(f"layers {offload.handle.names}, {moved} bytes offloaded by the latest forward; "
          f"losses and weights bitwise equal: {same}")
    if not same or moved == 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
