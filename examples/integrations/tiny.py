"""Tiny models, a tokenizer and data sets built in memory, for the integration examples and
their tests: nothing is downloaded (every model is random-init from a config)."""

from __future__ import annotations

import os

# before transformers or TRL are imported: no hub access, no telemetry
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from typing import Any  # noqa: E402

import torch  # noqa: E402

VOCAB = 128
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]


def llama(layers: int = 2, seed: int = 0) -> Any:
    """A random-init Llama: 32 wide, ``layers`` decoder layers, 4 heads (2 KV), eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, attn_implementation="eager")
    return LlamaForCausalLM(config)


def tokenizer() -> Any:
    """A word-level tokenizer over :data:`WORDS` (``"w7 w3"`` -> two tokens), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(3, VOCAB, (n,), generator=g))


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random sequences of ``length`` tokens, as causal-LM examples (labels = inputs)."""

    def __init__(self, n: int = 16, length: int = 16, seed: int = 0):
        self.ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def text_dataset(n: int = 16, words: int = 12, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` with a ``text`` column (for SFT)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"text": [_words(g, words) for _ in range(n)]})


def preference_dataset(n: int = 16, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` of ``prompt``, ``chosen``, ``rejected`` (for DPO); completions
    begin with a space, so a prompt ends on a token boundary."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"prompt": [_words(g, 6) for _ in range(n)],
                              "chosen": [" " + _words(g, 4) for _ in range(n)],
                              "rejected": [" " + _words(g, 4) for _ in range(n)]})


def prompt_dataset(n: int = 8, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` with a ``prompt`` column (for GRPO)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(n)]})


def trainer_args(**overrides: Any) -> dict[str, Any]:
    """``TrainingArguments`` (or TRL config) settings for a few CPU steps: no reports, no
    workers, no saving, fixed seeds."""
    args: dict[str, Any] = dict(max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                learning_rate=1e-2, report_to="none", use_cpu=True, dataloader_num_workers=0,
                                save_strategy="no", seed=0, data_seed=0, logging_steps=1, disable_tqdm=True)
    args.update(overrides)
    return args


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models hold bitwise equal weights (``torch.equal``), by name."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def losses(trainer: Any) -> list[float]:
    """The training losses a ``Trainer`` logged, step by step."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
