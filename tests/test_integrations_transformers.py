"""actoffload.integrations.transformers with the real library on the CPU: tiny random-init
models from configs, data in memory, bitwise against the same training without actoffload."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs transformers "
                    "(pip install -e '.[integrations]')")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "integrations"))
import tiny  # noqa: E402  (offline environment first)

from transformers import Trainer, TrainingArguments  # noqa: E402

import actoffload as ao  # noqa: E402
from actoffload.integrations.layers import find_layers  # noqa: E402
from actoffload.integrations.transformers import ActivationOffloadCallback, offload  # noqa: E402

SETTINGS = dict(min_offload_bytes=0)  # the tiny model's activations are far under the 1 MiB default


def _train(out, callbacks=(), model=None, resume=None, **overrides):
    model = model if model is not None else tiny.llama()
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                    per_device_eval_batch_size=4)
    settings.update(overrides)
    args = TrainingArguments(output_dir=str(out), **tiny.trainer_args(**settings))
    trainer = Trainer(model=model, args=args, train_dataset=tiny.TokenDataset(),
                      eval_dataset=tiny.TokenDataset(n=8, seed=1), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    callback = ActivationOffloadCallback(**SETTINGS)
    return _train(out, [callback]), callback, out


def test_trainer_with_the_callback_is_bitwise_with_accumulation_evaluation_and_saving(plain_run, offload_run):
    trainer, callback, out = offload_run
    assert tiny.losses(trainer) == tiny.losses(plain_run) and len(tiny.losses(trainer)) == 4
    assert tiny.same_weights(trainer.model, plain_run.model)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert evals == [h["eval_loss"] for h in plain_run.state.log_history if "eval_loss" in h] and len(evals) == 2
    assert callback.handle.names == ["model.layers.0", "model.layers.1"]
    stats = callback.offloader.stats()
    assert stats["groups"]["model.layers.0"]["offloaded_bytes"] > 0  # the last layer stays (keep_last=1)
    # taken off after each step and at the end: the checkpoints and the model are plain
    assert not callback.handle.attached and type(trainer.model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert (out / "checkpoint-2" / "model.safetensors").is_file()


def test_a_step_that_raised_leaves_no_wrap_in_the_way_of_the_next_training(tmp_path):
    """An exception inside a training step (Ctrl-C) skips the step's end, and transformers tells
    callbacks nothing of it: the layers stayed wrapped, and a new Trainer's callback or offload()
    on the same model raised "already wrapped". The next attach removes that step's wrap."""
    from transformers import TrainerCallback

    class InterruptOnce(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # inside a step, after backward
            if state.global_step == 1:
                raise KeyboardInterrupt

    model = tiny.llama()
    callback = ActivationOffloadCallback(**SETTINGS)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "a", [callback, InterruptOnce()], model=model, eval_strategy="no", save_strategy="no")
    assert callback.handle.attached  # (transformers said nothing)
    with pytest.warns(UserWarning, match="a training step that raised left it so"):
        _train(tmp_path / "b", [ActivationOffloadCallback(**SETTINGS)], model=model, eval_strategy="no",
               save_strategy="no")
    assert not callback.handle.attached and type(model.model.layers[0]) is type(tiny.llama().model.layers[0])
    offload(model, **SETTINGS).remove()  # nothing in the way


def test_resuming_from_its_own_checkpoint_is_bitwise_equal_to_the_uninterrupted_run(offload_run, tmp_path):
    uninterrupted, _, out = offload_run
    resumed = _train(out, [ActivationOffloadCallback(**SETTINGS)], resume=str(out / "checkpoint-2"))
    assert tiny.same_weights(resumed.model, uninterrupted.model)
    assert tiny.losses(resumed)[-2:] == tiny.losses(uninterrupted)[-2:]


def test_gradient_checkpointing_composes_and_moves_the_checkpointed_inputs(tmp_path):
    """A checkpointed layer's group opens around its checkpoint: its inputs move."""
    # transformers 5.24 names it activation_checkpointing; 5.17 (the GPU machines') gradient_checkpointing
    name = ("activation_checkpointing" if "activation_checkpointing" in inspect.signature(TrainingArguments).parameters
            else "gradient_checkpointing")
    over = dict(max_steps=2, eval_strategy="no", save_strategy="no", **{name: True})
    plain = _train(tmp_path, **over)
    callback = ActivationOffloadCallback(**SETTINGS)
    offloaded = _train(tmp_path, [callback], **over)
    assert tiny.losses(offloaded) == tiny.losses(plain) and tiny.same_weights(offloaded.model, plain.model)
    group = callback.offloader.stats()["groups"]["model.layers.0"]
    assert group["offloaded"] == 1 and group["offloaded_bytes"] == 4 * 16 * 32 * 4  # the layer's input


def test_a_memory_budget_is_bitwise(tmp_path):
    over = dict(max_steps=3, eval_strategy="no", save_strategy="no", gradient_accumulation_steps=1)
    plain = _train(tmp_path, **over)
    callback = ActivationOffloadCallback(memory_budget="1GiB", **SETTINGS)
    offloaded = _train(tmp_path, [callback], **over)
    assert tiny.losses(offloaded) == tiny.losses(plain) and tiny.same_weights(offloaded.model, plain.model)
    assert callback.offloader.impl == "fast" and callback.offloader.stats()["plan"]["groups"]


def _step(model, seed=0):
    ids = torch.randint(3, tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def test_offload_finds_the_layers_and_remove_gives_the_model_back():
    plain, model = tiny.llama(), tiny.llama()
    handle = offload(model, **SETTINGS)
    assert handle.attached and handle.names == ["model.layers.0", "model.layers.1"]
    assert isinstance(model.model.layers[0], type(plain.model.layers[0]))
    assert torch.equal(_step(model), _step(plain))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
    assert handle.stats()["offloaded_bytes"] > 0
    handle.remove()
    assert type(model.model.layers[0]) is type(plain.model.layers[0])


def test_save_pretrained_and_from_pretrained_of_a_wrapped_model(tmp_path):
    from transformers import LlamaForCausalLM
    model = tiny.llama()
    handle = offload(model, **SETTINGS)
    _step(model)
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(loaded.model.layers[0]).__name__ == "LlamaDecoderLayer"  # plain: not wrapped
    assert tiny.same_weights(loaded, model)
    handle.remove()
    model.zero_grad()
    assert torch.equal(_step(loaded), _step(model))


def test_a_copy_of_a_wrapped_model_is_plain_and_equal():
    """What a reference model made by deepcopy (TRL's create_reference_model) gets."""
    model = tiny.llama()
    with offload(model, **SETTINGS):
        ref = copy.deepcopy(model)
        assert type(ref.model.layers[0]).__name__ == "LlamaDecoderLayer" and tiny.same_weights(ref, model)
        assert torch.equal(_step(ref), _step(model))


def test_a_copy_or_a_pickle_of_an_attached_model_carries_nothing_of_actoffload():
    """(The copy kept the attachment's forward pre-hook, and a pickle named actoffload: loading
    it needed actoffload installed.)"""
    import pickle
    model = tiny.llama()
    with offload(model, **SETTINGS):
        copied, pickled = copy.deepcopy(model), pickle.dumps(model)
    assert not copied.model.layers[0]._forward_pre_hooks
    assert b"actoffload" not in pickled
    assert not pickle.loads(pickled).model.layers[0]._forward_pre_hooks


def test_a_copy_of_a_checkpointed_attached_model_gets_transformers_own_checkpoint_and_is_equal():
    """A layer transformers checkpoints is attached through its checkpoint function: a deep
    copy of the model (TRL's reference model) gets transformers' own function, with no
    offloader in it (which holds locks: the copy failed), and trains as the original does."""
    model = tiny.llama()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with offload(model, **SETTINGS) as handle:
        assert handle.checkpointed
        ref = copy.deepcopy(model)
        layer = ref.model.layers[0]
        assert type(vars(layer)["_gradient_checkpointing_func"]).__name__ != "_GroupedCheckpoint"
        assert torch.equal(_step(ref), _step(model)) and handle.stats()["offloaded_bytes"] > 0
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_lora_adapters_added_after_wrapping_train_bitwise():
    from peft import LoraConfig, get_peft_model

    def lora(model):
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0, init_lora_weights="gaussian"))
    plain = lora(tiny.llama())
    model = tiny.llama()
    handle = offload(model, **SETTINGS)
    model = lora(model)
    for seed in range(2):
        assert torch.equal(_step(model, seed), _step(plain, seed))
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n and g is not None for n, g in grads.items())
    assert all(torch.equal(g, dict(plain.named_parameters())[n].grad) for n, g in grads.items())
    assert handle.stats()["offloaded_bytes"] > 0
    handle.remove()


def _tiny(name, **extra):
    import transformers
    config = getattr(transformers, f"{name}Config")(**extra)
    return transformers.AutoModelForCausalLM.from_config(config)


SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64, head_dim=8)
ARCHITECTURES = {
    "Llama": (SMALL, "model.layers"),
    "Mistral": (SMALL, "model.layers"),
    "Qwen2": (SMALL, "model.layers"),
    "Qwen3": (SMALL, "model.layers"),
    "Gemma": (SMALL, "model.layers"),
    "GPT2": (dict(n_embd=16, n_layer=2, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0), "transformer.h"),
    "GPTNeoX": (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     vocab_size=64), "gpt_neox.layers"),
    # a hybrid: Mamba and attention layers alternate in one ModuleList, both classes listed
    "Jamba": (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=64, num_experts=1, attn_layer_period=2, attn_layer_offset=1,
                   mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False),
              "model.layers"),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_layers_of_common_architectures_are_found(name):
    config, path = ARCHITECTURES[name]
    model = _tiny(name, **config)
    [(found, layers)] = find_layers(model)
    assert found == path and len(layers) == 2


PREFETCHED = ["Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "GPT2", "GPTNeoX"]


@pytest.mark.parametrize("name", PREFETCHED)
def test_every_layer_wrapped_whole_is_reloaded_ahead_of_backward(name):
    """Each layer's group knows the layer before from the hidden states it is called with, so
    backward reloads ahead into every moved layer (a norm casting its input to float32 first
    left the first saves no link to the layer before: no reload ran ahead), and bitwise."""
    config, _ = ARCHITECTURES[name]
    layers = {"GPT2": "n_layer"}.get(name, "num_hidden_layers")
    config = {**config, layers: 4, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if name == "GPT2" else {})}
    torch.manual_seed(0)
    plain = _tiny(name, **config).to(torch.bfloat16)  # (in float32 the norms' cast to it makes no node)
    model = copy.deepcopy(plain)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    plain(input_ids=ids, labels=ids).loss.backward()
    handle = offload(model, impl="fast", min_offload_bytes=0, keep_last=1, prefetch=1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None)
    assert handle.stats()["copies"]["prefetched_groups"] == 3  # layers 0..2 moved; 3 stayed (keep_last)
    handle.remove()


def test_a_model_whose_layers_cannot_be_told_apart_asks_for_layers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ValueError, match="pass layers="):
        offload(model)
    handle = offload(model, layers=[model[0]], **SETTINGS)  # named: works
    assert handle.names == ["0"]
    handle.remove()
    with pytest.raises(ValueError, match="no such submodule"):
        offload(tiny.llama(), layers="model.blocks")
    with pytest.raises(TypeError, match="either an offloader or its settings"):
        offload(tiny.llama(), ao.Offloader(impl="ref"), min_offload_bytes=0)


def test_layers_given_as_a_path_and_the_callback_fails_when_the_trainer_is_built(tmp_path):
    handle = offload(tiny.llama(), layers="model.layers", **SETTINGS)
    assert handle.names == ["model.layers.0", "model.layers.1"]
    handle.remove()
    with pytest.raises(ValueError, match="no such submodule"):
        Trainer(model=tiny.llama(), args=TrainingArguments(output_dir=str(tmp_path), **tiny.trainer_args()),
                train_dataset=tiny.TokenDataset(), callbacks=[ActivationOffloadCallback(layers="model.blocks")])


def test_the_example_runs():
    import transformers_trainer
    transformers_trainer.main()


def test_layers_given_as_a_moduledict_are_named_by_their_keys():
    """torchtitan keeps its layers in a ModuleDict."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4), "1": torch.nn.Linear(4, 4)})
    handle = offload(model, layers="layers", **SETTINGS)
    assert handle.names == ["layers.0", "layers.1"] and handle.attached
    handle.remove()


def _said_once_until_attached_again(handle, step, change):
    """Checkpointing ``change``d ("enabled", "disabled") after attaching: the next two steps
    (``step(seed)`` says what moved) move nothing and the warning comes once; attached again,
    the layers move, grouped through their checkpoint where it is on."""
    with pytest.warns(UserWarning, match=f"gradient checkpointing was {change} on the model after its layers were "
                                         "attached") as caught:
        assert step(1) == 0
        step(2)
    assert sum(f"{change} on the model after" in str(w.message) for w in caught) == 1
    handle.remove()
    handle.attach()
    assert step(3) > 0 and bool(handle.checkpointed) == (change == "enabled")
    handle.remove()


def test_checkpointing_enabled_after_offload_is_said_once_and_attaching_again_moves_the_inputs():
    """offload() before gradient_checkpointing_enable(): each layer's group runs inside the
    checkpoint, which takes its saves, so nothing moves; a warning says so, once, and attaching
    again groups the checkpoint function instead."""
    model = tiny.llama(layers=2)
    model.train()
    handle = offload(model, **SETTINGS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(seed):
        ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return handle.stats()["offloaded_bytes"]

    _said_once_until_attached_again(handle, step, "enabled")


def test_checkpointing_disabled_after_offload_is_said_once_and_attaching_again_offloads_the_layers():
    """offload() after gradient_checkpointing_enable() groups each layer's checkpoint function;
    with checkpointing disabled after, the layers run plainly and no group opens: a warning says
    so, once (not in an evaluation forward), and attaching again wraps the layers themselves."""
    model = tiny.llama(layers=2)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    handle = offload(model, **SETTINGS)

    def held_in_step(seed):  # host memory the step's groups hold before its backward
        ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        held = handle.stats()["host_bytes_in_use"]
        loss.backward()
        return held

    assert held_in_step(0) > 0 and handle.checkpointed
    model.gradient_checkpointing_disable()
    with torch.no_grad():
        model(input_ids=torch.ones(1, 4, dtype=torch.long))  # said nothing: no step's
    _said_once_until_attached_again(handle, held_in_step, "disabled")


def test_a_model_attached_and_let_go_without_remove_is_freed():
    """The registry the warning's hook looks a layer up in holds its layers and handles weakly."""
    import gc
    import weakref

    model = tiny.llama(layers=2)
    handle = offload(model, **SETTINGS)
    _step(model)
    layer, off = weakref.ref(model.model.layers[0]), weakref.ref(handle.offloader)
    del model, handle
    gc.collect()
    assert layer() is None and off() is None


# ---------------------------------------------------------------- bad input, said at once (R10)
@pytest.mark.parametrize("settings", [dict(memory_budget="lots"), dict(keep_last=-1), dict(foo=1),
                                      dict(offloader="an offloader"), dict(impl="fast", packer="bogus"),
                                      dict(impl="fast", packer=None), dict(device="bogus"), dict(device="meta")])
def test_a_callbacks_bad_setting_is_refused_when_it_is_built_not_in_training(settings):
    """The callbacks check every setting as they are built: before the trainer makes its
    dataloaders and optimizer, not from inside ``train()``."""
    with pytest.raises((TypeError, ValueError)):
        ActivationOffloadCallback(**settings)
    lightning = pytest.importorskip("actoffload.integrations.lightning", exc_type=ImportError)
    with pytest.raises((TypeError, ValueError)):
        lightning.ActivationOffload(**settings)


def test_what_is_not_a_model_is_refused_by_name():
    from actoffload.integrations import trl

    with pytest.raises(TypeError, match="takes the model .*got NoneType"):
        offload(None)
    with pytest.raises(TypeError, match="got str"):
        trl.offload_context("model")
    with pytest.raises(TypeError, match="for a model itself, use actoffload.integrations.transformers.offload"):
        trl.offload(tiny.llama())


def test_layers_must_be_the_models_own_and_a_path_names_them():
    model = tiny.llama()
    with pytest.raises(ValueError, match="not LlamaForCausalLM's"):
        offload(model, layers=tiny.llama().model.layers)
    with pytest.raises(ValueError, match="names the model itself"):
        offload(model, layers="")
    handle = offload(model, layers="model.layers.0")
    try:
        assert handle.names == ["model.layers.0"]
    finally:
        handle.remove()
