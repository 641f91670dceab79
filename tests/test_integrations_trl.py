"""actoffload.integrations.trl with the real TRL on the CPU: SFT, DPO (its reference model a
copy of the policy) and GRPO for a few steps on a tiny random-init Llama, bitwise against the
same training without actoffload."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs trl (pip install -e '.[integrations]')")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "integrations"))
import tiny  # noqa: E402  (offline environment first)

from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402
from trl.experimental.utils import create_reference_model  # noqa: E402

from actoffload.integrations.layers import OffloadHandle  # noqa: E402
from actoffload.integrations.transformers import ActivationOffloadCallback  # noqa: E402
from actoffload.integrations.trl import offload  # noqa: E402

SETTINGS = dict(min_offload_bytes=0)  # the tiny model's activations are far under the 1 MiB default


def _sft(out, settings=None, **overrides):
    trainer = SFTTrainer(model=tiny.llama(), processing_class=tiny.tokenizer(), train_dataset=tiny.text_dataset(),
                         args=SFTConfig(output_dir=str(out), max_length=16, **tiny.trainer_args(**overrides)))
    handle = offload(trainer, **settings) if settings is not None else None
    trainer.train()
    return trainer, handle


@pytest.mark.parametrize("checkpointing", [True, False], ids=["trl-default-checkpointing", "no-checkpointing"])
def test_sft_is_bitwise(tmp_path, checkpointing):
    plain, _ = _sft(tmp_path, gradient_checkpointing=checkpointing)
    trainer, handle = _sft(tmp_path, SETTINGS, gradient_checkpointing=checkpointing)
    assert isinstance(trainer.maybe_activation_offload_context, OffloadHandle)
    assert tiny.losses(trainer) == tiny.losses(plain) and len(tiny.losses(plain)) == 3
    assert tiny.same_weights(trainer.model, plain.model)
    group = handle.stats()["groups"]["model.layers.0"]
    if checkpointing:  # the group is around the layer's checkpoint: its input moves
        assert group["offloaded"] == 1 and group["offloaded_bytes"] > 0
    else:
        assert group["offloaded"] > 1
    assert not handle.attached and type(trainer.model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_sft_under_a_memory_budget_is_bitwise(tmp_path):
    plain, _ = _sft(tmp_path, gradient_checkpointing=False, gradient_accumulation_steps=1)
    trainer, handle = _sft(tmp_path, dict(memory_budget="1GiB", **SETTINGS), gradient_checkpointing=False,
                           gradient_accumulation_steps=1)
    assert tiny.losses(trainer) == tiny.losses(plain) and tiny.same_weights(trainer.model, plain.model)
    assert handle.offloader.impl == "fast" and handle.stats()["plan"]["groups"]


def _dpo(out, on):
    model = tiny.llama()
    trainer = DPOTrainer(model=model, ref_model=create_reference_model(model), processing_class=tiny.tokenizer(),
                         train_dataset=tiny.preference_dataset(),
                         args=DPOConfig(output_dir=str(out), max_length=16, **tiny.trainer_args()))
    handle = offload(trainer, **SETTINGS) if on else None
    trainer.train()
    return trainer, handle


def test_dpo_with_a_copy_of_the_policy_as_reference_is_bitwise(tmp_path):
    plain, _ = _dpo(tmp_path, False)
    trainer, handle = _dpo(tmp_path, True)
    assert tiny.losses(trainer) == tiny.losses(plain) and len(tiny.losses(plain)) == 3
    assert tiny.same_weights(trainer.model, plain.model) and tiny.same_weights(trainer.ref_model, plain.ref_model)
    assert handle.stats()["groups"]["model.layers.0"]["offloaded_bytes"] > 0
    assert type(trainer.ref_model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # never wrapped


def _grpo(out, on):
    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]
    args = GRPOConfig(output_dir=str(out), num_generations=2, max_completion_length=4,
                      **tiny.trainer_args(max_steps=1, per_device_train_batch_size=2))
    trainer = GRPOTrainer(model=tiny.llama(), reward_funcs=reward, args=args, train_dataset=tiny.prompt_dataset(),
                          processing_class=tiny.tokenizer())
    handle = offload(trainer, **SETTINGS) if on else None
    trainer.train()
    return trainer, handle


def test_grpo_through_the_callback_is_bitwise(tmp_path):
    """GRPO has no activation-offload context: the callback wraps each step, generation
    included; GRPO turns checkpointing off around generation and on again, and the layers'
    new checkpoint functions are grouped too."""
    plain, _ = _grpo(tmp_path, False)
    trainer, handle = _grpo(tmp_path, True)
    assert any(isinstance(c, ActivationOffloadCallback) for c in trainer.callback_handler.callbacks)
    assert tiny.losses(trainer) == tiny.losses(plain) and tiny.same_weights(trainer.model, plain.model)
    assert handle.stats()["groups"]["model.layers.0"]["offloaded_bytes"] > 0


def test_trl_own_activation_offloading_is_refused(tmp_path):
    trainer = SFTTrainer(model=tiny.llama(), processing_class=tiny.tokenizer(), train_dataset=tiny.text_dataset(),
                         args=SFTConfig(output_dir=str(tmp_path), max_length=16, **tiny.trainer_args()))
    trainer.args.activation_offloading = True  # as if built with it (its hooks need a GPU to install)
    with pytest.raises(ValueError, match="activation_offloading=False"):
        offload(trainer)


def test_the_example_runs():
    import trl_sft_dpo
    torch.manual_seed(0)
    trl_sft_dpo.main()
