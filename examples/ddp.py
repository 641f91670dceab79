"""DistributedDataParallel with activation offloading.

Each rank holds the whole GPT of ``actoffload.tools.models`` and trains it on its own data;
DDP all-reduces the gradients in buckets during backward. ``ao.wrap`` goes on the blocks of
the module DDP wraps (``ddp.module.blocks``): the groups run inside DDP's forward, and the
reloads in backward interleave with DDP's all-reduces. The audit checks that only
activations move (the weights autograd saves stay, reason ``parameter``), and each rank's
gradients are compared bit for bit with the same run without offloading.

    python examples/ddp.py --device cpu                        # 2 processes, gloo
    torchrun --nproc-per-node 2 examples/ddp.py                # 2 GPUs, NCCL
    python examples/ddp.py --d-model 1024 --layers 8 --seq-len 1024 --batch 8 --dtype bfloat16 --out ddp.json
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common import Context, Trainee, gpt_config, language_model, main, parser

from actoffload.tools.models import GPT


def build(ctx: Context, args: argparse.Namespace, mode: str) -> Trainee:
    torch.manual_seed(args.seed)  # every mode starts from the same weights (DDP also broadcasts rank 0's)
    model = GPT(gpt_config(args)).to(device=ctx.device, dtype=getattr(torch, args.dtype))
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    return language_model(args, ctx, model, ddp, opt, data_stream=ctx.rank)  # each rank its own data


def run(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv``); returns the exit code."""
    return main("ddp", build, parser(__doc__), argv)


if __name__ == "__main__":
    raise SystemExit(run())
