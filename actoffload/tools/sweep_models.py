"""The budget sweep's workloads: the models it trains and how one step of each is run.

Two sets. The ``default`` set is this repository's own models (a plain stack of blocks, the
GPT-MoE of the demo, a Llama-style decoder), each block given to a memory budget with its
three parts. The ``hf`` set is transformers' ``LlamaForCausalLM`` as users have it: built
from a ``LlamaConfig`` (random init, nothing downloaded), bf16, its own causal-LM loss on
random token ids, and wrapped whole, ``ao.wrap(model.model.layers, ao.Offloader(...))``:

- ``hf_llama_eager``: hidden 2048, 8 layers, 16 heads / 4 KV heads, intermediate 5632,
  4 x 2048 tokens, eager attention;
- ``hf_llama_sdpa``: the same with ``attn_implementation="sdpa"``;
- ``hf_8b_8k``: 8B-shaped layers (hidden 4096, intermediate 14336, 32 / 8 heads), 4 layers,
  1 x 8192 tokens, SDPA (vocabulary 32000: a 128k vocabulary's float32 logits at 32k tokens
  would not fit beside the layers);
- ``hf_8b_32k``: the same at 1 x 32768 tokens.

With ``small`` (the CPU) each is tiny (hidden 64, 2 layers, 2 x 64 tokens), so that every
code path runs in seconds. transformers is optional: :func:`have_transformers` says whether
these can be built.

A method calls each block through ``call(i, block, *args, **kwargs)`` (plainly, or under
checkpointing). transformers' decoder calls its layers itself, so for a call other than the
plain one :func:`routed` puts, for the step only, a small module in each layer's place that
hands the call on; the layers themselves are never changed.

Example::

    names = [name for name, _ in workloads(torch.device("cpu"), small=True, models="hf")]
    w = dict(workloads(torch.device("cpu"), small=True, models="hf"))["hf_llama_eager"]()
    w.loss(plain, 0).backward()              # one step, no offloading
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .models import GPT, Block, GPTConfig, Llama, LlamaConfig, block_parts, next_token_loss

Call = Callable[..., torch.Tensor]  # call(i, block, *args, **kwargs): block i's output

DEFAULT_WORKLOADS = ("llama", "d2048_L8", "gpt_moe", "d4096_L4", "d8192_L4")
SMALL_WORKLOADS = ("stack_small", "gpt_moe", "llama")
HF_WORKLOADS = ("hf_llama_eager", "hf_llama_sdpa", "hf_8b_8k", "hf_8b_32k")
MODEL_SETS = ("default", "hf", "all")


@dataclass
class Scale:
    """How long a workload is measured, where the sweep's defaults would take too long:
    ``steps`` measured and ``warmup`` before them per method, ``levels`` budget levels, and
    the alternating comparison's seconds (``paired_s``), rounds (fewest, most) and most seconds
    (``paired_max_s``)."""

    steps: int
    warmup: int
    levels: int
    paired_s: float
    paired_rounds: tuple[int, int]
    paired_max_s: float


@dataclass
class Workload:
    """A model with ``blocks``, and a step: loss of one batch, backward.

    Checkpointing and offloading everything work block by block, as users set them up; a
    memory budget gets each block with its ``parts`` (:func:`block_parts` for this
    repository's blocks), so that its plan can go below checkpointing every block (where
    backward holds a whole block's recomputed activations at once) and still recompute a
    whole block where that is faster; ``parts=None``: whole blocks, as users wrap a
    transformers model. ``scale``: measured for less long than the sweep's default;
    ``repeat_none``: no offloading is run twice, to tell whether the step's gradients are
    deterministic at all (SDPA's backward may not be); ``info``: what the results record of
    the model."""

    name: str
    model: torch.nn.Module
    blocks: torch.nn.ModuleList
    loss: Callable[[Call, int], torch.Tensor]
    trainable: list[torch.Tensor]  # what gradients are compared for (parameters and the input)
    parts: Callable[..., Any] | None = block_parts
    scale: Scale | None = None
    repeat_none: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def plain(i: int, b: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Block ``i`` called as it is."""
    return b(*args, **kwargs)


# ---------------------------------------------------------------- this repository's models
def _stack(name: str, d: int, layers: int, batch: int, seq: int, device: torch.device, dtype: torch.dtype) -> Workload:
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=d, n_heads=max(1, d // 128), n_layers=layers, seq_len=seq, attention="eager",
                    embedding=False)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(layers)).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    leaf = x.requires_grad_(True)

    def loss(call, step):
        h = leaf * 1  # the first block sees an activation
        for i, b in enumerate(blocks):
            h = call(i, b, h)
        return h.float().square().mean()

    return Workload(name, blocks, blocks, loss, [leaf, *blocks.parameters()])


def _tokens(vocab: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)


def _gpt_moe(device: torch.device, dtype: torch.dtype, small: bool) -> Workload:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512 if small else 8192, seq_len=32 if small else 1024, d_model=64 if small else 1024,
                    n_heads=4 if small else 16, n_layers=2 if small else 8, attention="eager",
                    n_experts=4 if small else 8, top_k=2)
    model = GPT(cfg).to(device=device, dtype=dtype)
    # 16 sequences: with 8, each expert's GEMMs were so short that the host (reading the
    # routing back every block) set the pace of nearly the whole step, which then drifted by
    # 10-20% within seconds on an H200's host; with 16 the steps hold within 3%
    batch = _tokens(cfg.vocab_size, 2 if small else 16, cfg.seq_len, device)

    def loss(call, step):
        x, y = batch[:, :-1], batch[:, 1:]
        h = model.embed(x) + model.pos[: x.shape[1]]
        for i, b in enumerate(model.blocks):
            h = call(i, b, h)
        return next_token_loss(model.head(model.ln_f(h)).float(), y)

    return Workload("gpt_moe", model, model.blocks, loss, list(model.parameters()))


def _llama(device: torch.device, dtype: torch.dtype, small: bool) -> Workload:
    torch.manual_seed(0)
    cfg = (LlamaConfig(seq_len=32, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn=172) if small else
           LlamaConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_kv_heads=4, n_layers=8, ffn=5632))
    model = Llama(cfg).to(device=device, dtype=dtype)
    batch = _tokens(cfg.vocab_size, 2 if small else 4, cfg.seq_len, device)

    def loss(call, step):
        x, y = batch[:, :-1], batch[:, 1:]
        h = model.embed(x)
        for i, b in enumerate(model.blocks):
            h = call(i, b, h)
        return next_token_loss(model.head(model.norm(h)).float(), y)

    return Workload("llama", model, model.blocks, loss, list(model.parameters()))


# ---------------------------------------------------------------- transformers' Llama
def have_transformers() -> bool:
    """Whether transformers is installed (the ``hf`` workloads need it)."""
    return importlib.util.find_spec("transformers") is not None


@dataclass(frozen=True)
class HFShape:
    """A ``LlamaForCausalLM``'s shape and its batch: ``batch`` sequences of ``seq`` tokens."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    seq: int
    attention: str  # attn_implementation
    vocab: int = 32000


_LLAMA_2048 = dict(hidden=2048, intermediate=5632, layers=8, heads=16, kv_heads=4, batch=4, seq=2048)
_LLAMA_8B = dict(hidden=4096, intermediate=14336, layers=4, heads=32, kv_heads=8, batch=1)
HF_SHAPES = {
    "hf_llama_eager": HFShape(**_LLAMA_2048, attention="eager"),
    "hf_llama_sdpa": HFShape(**_LLAMA_2048, attention="sdpa"),
    "hf_8b_8k": HFShape(**_LLAMA_8B, seq=8192, attention="sdpa"),
    "hf_8b_32k": HFShape(**_LLAMA_8B, seq=32768, attention="sdpa"),
}
# measured for less long than the sweep's default (8 steps after 2, five budget levels,
# alternating steps for 6 to 24 s a cell), so that the four run in about 9 minutes on an H100:
# three budget levels (plus the one under checkpointing every layer), alternating steps for
# 3 to 6 s a cell; 6 steps after 2 at d2048, 4 after 1 for the 8B-shaped layers at 8k tokens,
# 3 after 1 (and 2 to 5 s of alternating steps) at 32k, where a step takes about a second
HF_SCALES = {
    "hf_llama_eager": Scale(6, 2, 3, 3.0, (6, 16), 6.0),
    "hf_llama_sdpa": Scale(6, 2, 3, 3.0, (6, 16), 6.0),
    "hf_8b_8k": Scale(4, 1, 3, 3.0, (4, 12), 6.0),
    "hf_8b_32k": Scale(3, 1, 3, 2.0, (3, 8), 5.0),
}


def hf_shape(name: str, small: bool) -> HFShape:
    """``HF_SHAPES[name]``, or with ``small`` a tiny model of its attention."""
    shape = HF_SHAPES[name]
    return HFShape(hidden=64, intermediate=172, layers=2, heads=4, kv_heads=2, batch=2, seq=64,
                   attention=shape.attention, vocab=512) if small else shape


def llama_for_causal_lm(shape: HFShape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` of ``shape``, random init from a config (seeded: the same
    weights in every run), made on ``device`` in ``dtype``, in training mode. Raises
    ``ImportError`` without transformers."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=shape.seq, pad_token_id=0, bos_token_id=None, eos_token_id=1, use_cache=False,
        attn_implementation=shape.attention)
    torch.manual_seed(0)
    with torch.device(device):  # random init where it trains
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).train()


class _Routed(torch.nn.Module):
    """Stands in for layer ``index`` during one step: ``call(index, layer, *args, **kwargs)``."""

    def __init__(self, index: int, layer: torch.nn.Module, call: Call):
        super().__init__()
        self.index, self.layer, self.call = index, layer, call

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.call(self.index, self.layer, *args, **kwargs)


@contextlib.contextmanager
def routed(layers: torch.nn.ModuleList, call: Call) -> Iterator[None]:
    """Within it, ``layers[i](...)`` runs ``call(i, layers[i], ...)``; with the plain call the
    layers are left as they are (an offloader's hooks on them run as in the user's program).

    Example::

        with routed(model.model.layers, call):
            loss = model(input_ids=ids, labels=ids).loss
    """
    if call is plain:
        yield
        return
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _Routed(i, layer, call)
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


def hf_llama(name: str, device: torch.device, small: bool) -> Workload:
    """transformers' ``LlamaForCausalLM`` of ``HF_SHAPES[name]`` (tiny with ``small``), in bf16
    on CUDA (float32 on the CPU), in training mode; its loss is the model's own causal-LM loss
    on random token ids. Raises ``ImportError`` without transformers."""
    import transformers

    shape = hf_shape(name, small)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = llama_for_causal_lm(shape, device, dtype)
    layers = model.model.layers
    ids = torch.randint(2, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def loss(call, step):
        with routed(layers, call):
            return model(input_ids=ids, labels=ids).loss

    info = {"model": "transformers.LlamaForCausalLM", "transformers": transformers.__version__,
            "attn_implementation": getattr(model.config, "_attn_implementation", shape.attention),
            "dtype": str(dtype).replace("torch.", ""),
            **{k: getattr(shape, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab",
                                              "batch", "seq")}}
    return Workload(name, model, layers, loss, list(model.parameters()), parts=None,
                    scale=None if small else HF_SCALES[name], repeat_none=True, info=info)


# ---------------------------------------------------------------- the sets
def workloads(device: torch.device, small: bool, models: str = "default") -> list[tuple[str, Callable[[], Workload]]]:
    """The sweep's workloads of ``models`` (``default``, ``hf`` or ``all``), by name, each
    built when called (one at a time: each frees the last)."""
    if models not in MODEL_SETS:
        raise ValueError(f"models={models!r}: one of {', '.join(MODEL_SETS)}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: list[tuple[str, Callable[[], Workload]]] = []
    if models in ("default", "all"):
        if small:
            out += [("stack_small", lambda: _stack("stack_small", 64, 3, 2, 32, device, dtype)),
                    ("gpt_moe", lambda: _gpt_moe(device, dtype, True)), ("llama", lambda: _llama(device, dtype, True))]
        else:
            out += [  # the decoder first: its first-step figure matters most
                ("llama", lambda: _llama(device, dtype, False)),
                ("d2048_L8", lambda: _stack("d2048_L8", 2048, 8, 8, 2048, device, dtype)),
                ("gpt_moe", lambda: _gpt_moe(device, dtype, False)),
                ("d4096_L4", lambda: _stack("d4096_L4", 4096, 4, 4, 4096, device, dtype)),
                ("d8192_L4", lambda: _stack("d8192_L4", 8192, 4, 2, 4096, device, dtype)),
            ]
    if models in ("hf", "all"):
        out += [(name, lambda name=name: hf_llama(name, device, small)) for name in HF_WORKLOADS]
    return out


def workload_names(small: bool) -> tuple[str, ...]:
    """Every workload name ``--only`` accepts."""
    return (SMALL_WORKLOADS if small else DEFAULT_WORKLOADS) + HF_WORKLOADS
