"""FSDP2 (``fully_shard`` per decoder block and at the root) with activation offloading.

Each rank trains the GPT of ``actoffload.tools.models`` on its own data; ``ao.wrap`` makes
every block's forward an offload group, applied after ``fully_shard`` so the group runs
inside FSDP's hooks: when a block's forward runs its parameters are unsharded (all-gathered)
plain tensors, and afterwards they are resharded (their storage freed). Autograd saves
views of them (``F.linear`` saves ``weight.t()``); the offloader must keep those (reason
``parameter``): moving one would copy a storage FSDP is about to free and re-gather. The
audit checks, group by group, that the bytes moved are exactly the activations, and the
local gradient shards are compared bit for bit with the same run without offloading.

    python examples/fsdp2.py --device cpu                      # 2 processes, gloo
    torchrun --nproc-per-node 2 examples/fsdp2.py              # 2 GPUs, NCCL
    python examples/fsdp2.py --d-model 1024 --layers 8 --seq-len 1024 --batch 8 --dtype bfloat16 --out fsdp2.json
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import Context, Trainee, gpt_config, language_model, main, parser

from actoffload.tools.models import GPT


def build(ctx: Context, args: argparse.Namespace, mode: str) -> Trainee:
    torch.manual_seed(args.seed)  # every mode and every rank starts from the same weights
    model = GPT(gpt_config(args)).to(device=ctx.device, dtype=getattr(torch, args.dtype))
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return language_model(args, ctx, model, model, opt, data_stream=ctx.rank)  # each rank its own data


def run(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv``); returns the exit code."""
    return main("fsdp2", build, parser(__doc__), argv)


if __name__ == "__main__":
    raise SystemExit(run())
