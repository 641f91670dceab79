"""TRL with actoffload: SFT, then DPO from the SFT model against a copy of it as the reference,
on a tiny random-init Llama on the CPU (a tokenizer and data sets built in memory).

TRL's trainers checkpoint each layer by default (gradient_checkpointing=True); actoffload then
moves what checkpoint keeps of each layer, its input, to host memory. A memory budget is one
keyword more: offload(trainer, memory_budget="20GiB").

    python examples/integrations/trl_sft_dpo.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402  (sets the offline environment before transformers is imported)

import torch  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402
from trl.experimental.utils import create_reference_model  # noqa: E402

from actoffload.integrations.trl import offload  # noqa: E402


def main() -> None:
    torch.use_deterministic_algorithms(True)
    model, tok = tiny.llama(), tiny.tokenizer()
    with tempfile.TemporaryDirectory() as out:
        sft = SFTTrainer(model=model, processing_class=tok, train_dataset=tiny.text_dataset(),
                         args=SFTConfig(output_dir=out, max_length=16, **tiny.trainer_args()))
        handle = offload(sft, min_offload_bytes=0)  # the tiny model's activations are far under 1 MiB
        sft.train()
        with handle:  # attached, as in each training step: what it checkpoints is listed then
            print(f"SFT: losses {tiny.losses(sft)}; the latest forward offloaded "
                  f"{handle.stats()['offloaded_bytes']} bytes ({', '.join(handle.checkpointed)} checkpointed)")

        dpo = DPOTrainer(model=model, ref_model=create_reference_model(model), processing_class=tok,
                         train_dataset=tiny.preference_dataset(),
                         args=DPOConfig(output_dir=out, max_length=16, **tiny.trainer_args()))
        handle = offload(dpo, min_offload_bytes=0)
        dpo.train()
        print(f"DPO: losses {tiny.losses(dpo)}; the latest forward offloaded {handle.stats()['offloaded_bytes']} bytes")
    if handle.stats()["offloaded_bytes"] == 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
