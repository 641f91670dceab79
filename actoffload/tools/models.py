"""A small GPT-like model for the demo, the tests and the benchmarks.

Reads top to bottom: config, attention, MLP (dense, or mixture of experts), block,
model. ``model.blocks`` is the list to hand to :func:`actoffload.wrap` (one offload
group per block); :func:`block_parts` gives a block's three parts (Q/K/V projection,
attention, MLP) for smaller groups. Modules carry offload roles (``attn_norm``, ``qkv``
on the projection; ``core_attn``, ``attn_proj`` on the attention; ``mlp_norm``; the
experts ``expert_fc1``, ``moe_act``, ``expert_fc2``) for :func:`actoffload.select_modules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import GroupedMLP
from ..roles import select_in_forward, selects


@dataclass
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    # "sdpa" uses F.scaled_dot_product_attention; "eager" the plain softmax(QK^T)V, which
    # is deterministic on CUDA (SDPA's fused kernels are not, even without an offloader).
    attention: str = "sdpa"
    embedding: bool = True  # False: inputs are already [B, T, d_model] activations
    n_experts: int = 0  # > 0: a mixture-of-experts MLP (router + GroupedMLP) in every block
    top_k: int = 2
    expert_activation: str = "swiglu"
    expert_fp8: bool = False


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``[B, T, vocab]`` logits against ``[B, T]`` target ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class QKV(nn.Module):
    """LayerNorm -> the query, key and value projection, split into heads ``[B, H, T, D]``."""

    offload_roles = ("attn_norm", "qkv")

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)

    @selects
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        normed = self.norm(x)
        select_in_forward(self, {"attn_norm": x, "qkv": normed})
        q, k, v = self.qkv(normed).split(C, dim=2)
        heads = (B, T, self.n_heads, C // self.n_heads)
        return q.view(heads).transpose(1, 2), k.view(heads).transpose(1, 2), v.view(heads).transpose(1, 2)


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager causal attention ``softmax(QK^T / sqrt(D)) V``: the output and the probabilities
    (deterministic on CUDA, unlike SDPA's fused kernels)."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / (k.shape[-1] ** 0.5)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return probs @ v, probs


class CoreAttention(nn.Module):
    """Causal attention over heads ``[B, H, T, D]`` -> the output projection."""

    offload_roles = ("core_attn", "attn_proj")

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = cfg.attention
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    @selects
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, T, D = q.shape
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            core = (q, k, v, y)
        else:  # (contiguous: matmul would save copies of its own, which no role could name)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            y, probs = causal_softmax_attention(q, k, v)
            core = (q, k, v, probs)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        select_in_forward(self, {"core_attn": core, "attn_proj": y})
        return self.proj(y)


class Attention(nn.Module):
    """LayerNorm -> causal self-attention (the block adds the residual), in two modules:
    ``project`` (norm, Q/K/V) and ``core`` (attention, output projection)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.project = QKV(cfg)
        self.core = CoreAttention(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core(*self.project(x))


class MLP(nn.Module):
    """LayerNorm -> fc1 -> GELU -> fc2."""

    offload_roles = ("mlp_norm",)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    @selects
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        select_in_forward(self, {"mlp_norm": x})  # what the norm saves
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class MoE(nn.Module):
    """LayerNorm -> router (top-k, softmax weights) -> tokens sorted by expert -> GroupedMLP
    -> combine."""

    offload_roles = ("mlp_norm",)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm = nn.LayerNorm(cfg.d_model)
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedMLP(cfg.n_experts, cfg.d_model, cfg.mlp_ratio * cfg.d_model,
                                  activation=cfg.expert_activation, fp8=cfg.expert_fp8)

    @selects
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        select_in_forward(self, {"mlp_norm": x})  # what the norm saves
        flat = self.norm(x).reshape(B * T, C)
        weights, experts = self.router(flat).topk(self.top_k, dim=-1)
        weights = weights.softmax(dim=-1)
        expert_of = experts.flatten()  # [N * k], slot i belongs to token i // k
        order = torch.argsort(expert_of, stable=True)
        sizes = torch.bincount(expert_of, minlength=self.experts.w1.shape[0]).tolist()
        out_sorted = self.experts(flat[order // self.top_k], sizes)
        out = out_sorted[torch.argsort(order)]  # back to slot order (a gather: deterministic on CUDA too)
        return (out.view(B * T, self.top_k, C) * weights.unsqueeze(-1)).sum(1).view(B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(x)``, then ``+ mlp(...)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mid = x + self.attn(x)
        return mid + self.mlp(mid)


def block_parts(block: nn.Module) -> list[nn.Module]:
    """A block's three parts in forward order: the attention's projection to queries, keys
    and values (with its norm), the attention itself with its output projection, and the
    MLP (with its norm); for a GPT or a Llama block. Given to :func:`actoffload.wrap` as
    ``parts``, each is a group, so that a memory plan can recompute or offload one part and
    keep the others (backward then holds one part's activations at a time), or still
    recompute the whole block.

    Example::

        ao.wrap(model.blocks, off, parts=block_parts)   # groups "0.0" (block 0's Q/K/V), "0.1", "0.2", "1.0", ...
    """
    return [block.attn.project, block.attn.core, block.mlp]


class GPT(nn.Module):
    """Token ids ``[B, T]`` (or activations ``[B, T, C]`` without embedding) -> logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if cfg.embedding else None
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        h = h + self.pos[: h.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(x), targets)


# ---------------------------------------------------------------------------- Llama-style
@dataclass
class LlamaConfig:
    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each K/V head serves n_heads / n_kv_heads queries
    n_layers: int = 4
    ffn: int = 344  # SwiGLU hidden size (about 8/3 of d_model, rounded)
    rope_base: float = 10000.0
    eps: float = 1e-6


def rope_tables(cfg: LlamaConfig, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary embedding, ``[seq_len, head_dim / 2]``."""
    half = cfg.d_model // cfg.n_heads // 2
    inv = 1.0 / cfg.rope_base ** (torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.arange(cfg.seq_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dimension of ``x`` ``[B, H, T, D]``."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class LlamaQKV(nn.Module):
    """RMSNorm -> queries ``[B, H, T, D]`` and keys, values ``[B, H_kv, T, D]``, queries and
    keys rotated (rotary embeddings)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * self.n_kv * self.head_dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        x = self.norm(x)
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.n_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class LlamaCoreAttention(nn.Module):
    """Grouped-query causal attention (each key/value head serves ``n_heads / n_kv_heads``
    queries) -> the output projection."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.rep = cfg.n_heads // cfg.n_kv_heads
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, T, D = q.shape
        y, _ = causal_softmax_attention(q, k.repeat_interleave(self.rep, dim=1), v.repeat_interleave(self.rep, dim=1))
        return self.o(y.transpose(1, 2).reshape(B, T, H * D))


class LlamaAttention(nn.Module):
    """RMSNorm -> grouped-query attention with rotary embeddings, eager softmax; in two
    modules: ``project`` (norm, Q/K/V, rotation) and ``core`` (attention, output projection)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.project = LlamaQKV(cfg)
        self.core = LlamaCoreAttention(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.core(*self.project(x, cos, sin))


class SwiGLU(nn.Module):
    """RMSNorm -> SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    """``x + attn(x)``, then ``+ mlp(...)``; the attention and the MLP each normalise their own input."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn = LlamaAttention(cfg)
        self.mlp = SwiGLU(cfg)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, x.device, x.dtype)
        h = x + self.attn(x, cos, sin)
        return h + self.mlp(h)


class Llama(nn.Module):
    """Token ids ``[B, T]`` -> logits; ``model.blocks`` is the list to wrap."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(x), targets)
