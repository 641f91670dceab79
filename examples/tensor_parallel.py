"""Tensor parallelism with sequence parallelism (DTensor) and activation offloading.

A small decoder, written here so its tensor-parallel plan reads beside it, is split over the
ranks with ``parallelize_module``: the attention's q/k/v and the MLP's first projection
column-wise, their output projections row-wise, and the norms sequence-parallel. The
row-wise layers return DTensors sharded along the sequence (``Shard(1)``, the
``use_local_output=False`` of the plan), so the residual stream between blocks is a
DTensor; every rank holds its slice of the sequence. Inside a block, autograd saves DTensors
(the norms' and linears' inputs) as well as plain local tensors (the attention of the
heads this rank owns). ``ao.wrap`` on the blocks offloads them; a DTensor moves by its local
shard (DTensor speaks ``__tensor_flatten__``, rule R7). Every rank sees the same batch.
Local gradient shards are compared bit for bit with the same run without offloading.

    python examples/tensor_parallel.py --device cpu            # 2 processes, gloo
    torchrun --nproc-per-node 2 examples/tensor_parallel.py    # 2 GPUs, NCCL
    python examples/tensor_parallel.py --d-model 2048 --heads 16 --layers 8 --seq-len 2048 --batch 4 --dtype bfloat16

``--heads`` and ``--seq-len`` must be multiples of the number of ranks.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from common import Context, Trainee, language_model, main, parser, world_size


# ---------------------------------------------------------------- the model (no parallelism in it)
class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tensor parallelism q, k, v hold this rank's heads only: -1 is the local head count.
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1)) / self.head_dim**0.5  # eager: deterministic on CUDA
        mask = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
        y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, 4 * d_model)
        self.w2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token ids ``[B, T]`` -> logits. No position embedding, for brevity (RoPE would act on
    the local heads inside the attention)."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


# ---------------------------------------------------------------- the tensor-parallel plan
def parallelize(model: Decoder, mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with sequence-parallel norms; the residual stream
    stays a DTensor sharded along the sequence (``Shard(1)``)."""
    seq_sharded = Shard(1)
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_sharded, use_local_output=False),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq_sharded, output_layouts=Replicate()),  # full logits on every rank
    })
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq_sharded,), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq_sharded, use_local_output=False),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(seq_sharded,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=seq_sharded, use_local_output=False),
        })


def describe_tensor(t: Any) -> str:
    if isinstance(t, DTensor):
        return f"DTensor{tuple(t.placements)} local {list(t.to_local().shape)} of {list(t.shape)}"
    return f"{type(t).__name__} {list(t.shape)}"


def check(args: argparse.Namespace) -> None:
    """Heads and tokens split evenly among the ranks (before any process starts)."""
    world = world_size(args)
    if args.heads % world or args.seq_len % world:
        raise SystemExit(f"--heads ({args.heads}) and --seq-len ({args.seq_len}) must be multiples of {world} ranks")


def build(ctx: Context, args: argparse.Namespace, mode: str) -> Trainee:
    torch.manual_seed(args.seed)
    model = Decoder(args.vocab, args.d_model, args.heads, args.layers).to(device=ctx.device, dtype=getattr(torch, args.dtype))
    parallelize(model, init_device_mesh(ctx.device.type, (ctx.world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # What enters each block (step 0): the DTensors the offloader must move by their shards.
    block_inputs: dict[str, str] = {}

    def record_input(name: str, inputs: tuple[Any, ...]) -> None:
        block_inputs.setdefault(name, describe_tensor(inputs[0]))

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, name=f"block{i}": record_input(name, a))

    # tensor parallel: every rank the same batch
    return language_model(args, ctx, model, model, opt, data_stream=0,
                          report=lambda off: {"block_inputs": block_inputs})


def run(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv``); returns the exit code."""
    return main("tensor_parallel", build, parser(__doc__), argv, check)


if __name__ == "__main__":
    raise SystemExit(run())
