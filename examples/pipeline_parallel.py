"""Pipeline parallelism (``torch.distributed.pipelining``) with activation offloading.

The GPT of ``actoffload.tools.models`` is cut into stages (embedding with the first blocks,
..., the last blocks with the norm and head), one per rank for ``--schedule 1f1b`` or
``gpipe``, two per rank for ``interleaved`` (``ScheduleInterleaved1F1B``). Each step the
schedule splits the batch into ``--microbatches`` micro-batches; 1F1B keeps several of
them in flight on the early stages (forwarded, backward still to come). ``ao.wrap`` on each
stage's blocks makes every micro-batch's forward of a block a group of its own; one
offloader per rank serves all its stages and micro-batches.

What it shows, besides gradients bitwise equal to the same schedule without offloading:

- the order of forwards and backwards per stage and micro-batch (``F0 F1 B0 F2 B1 ...``),
  the same with and without offloading, and how many micro-batches were in flight;
- per stage and micro-batch: groups committed and bytes offloaded, and (``--impl fast``,
  whose ``stats()`` counts copies) the bytes reloaded while that micro-batch's backward
  ran: never more than it offloaded, so no group of another micro-batch was reloaded;
- peak memory per rank, that is per stage for ``1f1b`` (on CUDA).

With ``keep_last=1`` a micro-batch's last group is committed when the *next* micro-batch's
forward opens its first group, if that comes before its backward (warm-up on the early
stages), and kept otherwise: rule R4 counts groups across micro-batches.

    python examples/pipeline_parallel.py --device cpu                   # 2 processes, gloo, 1F1B
    python examples/pipeline_parallel.py --device cpu --impl fast --schedule interleaved
    torchrun --nproc-per-node 2 examples/pipeline_parallel.py           # 2 GPUs, NCCL
    python examples/pipeline_parallel.py --d-model 1024 --layers 8 --seq-len 1024 --batch 16 --microbatches 8 --dtype bfloat16

``--layers`` must be a multiple of the number of stages, ``--batch`` of ``--microbatches``.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import actoffload as ao
from common import Context, Trainee, batch, gpt_config, main, parser, world_size

from actoffload.tools.models import GPT

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved": ScheduleInterleaved1F1B}


class ScheduleTrace(ao.Observer):
    """Forwards and backwards per stage and micro-batch, in the order they ran (last step).

    With an offloader it is also its observer: each group belongs to the micro-batch whose
    forward saved into it (a name seen again after a backward began is a new group: the
    latest save decides), and the bytes fast reloads between a backward's start and the next
    event belong to that backward. Exact when a group is committed, or kept for good, before a
    group of the same name opens again: with at least ``keep_last`` blocks a stage.
    """

    def __init__(self, n_microbatches: int):
        self.n = n_microbatches
        self.off: ao.Offloader | None = None
        self.start_step()

    def start_step(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.calls: collections.Counter[int] = collections.Counter()
        self.current: tuple[int, int] | None = None  # (stage, micro-batch) whose forward runs
        self.group_of: dict[str, tuple[int, int] | None] = {}
        self.committed: collections.Counter[tuple[int, int]] = collections.Counter()
        self.offloaded: collections.Counter[tuple[int, int]] = collections.Counter()
        self.reloaded: collections.Counter[tuple[int, int]] = collections.Counter()
        self._backward: tuple[int, int] | None = None
        self._h2d_at = self._h2d()

    def end_step(self) -> None:
        self._close_backward()

    # called by the stages
    def forward(self, stage: int) -> int:
        self._close_backward()
        mb = self.calls[stage] % self.n  # a stage runs its micro-batches' forwards in order
        self.calls[stage] += 1
        self.events.append(("F", stage, mb))
        self.current = (stage, mb)
        return mb

    def backward(self, stage: int, mb: int) -> None:
        self._close_backward()
        self.events.append(("B", stage, mb))
        self._backward = (stage, mb)

    # called by the offloader
    def on_save(self, group: str, tensor: torch.Tensor) -> None:
        self.group_of[group] = self.current  # saves happen only in the group's own forward

    def on_commit(self, group: str, summary: dict[str, Any]) -> None:
        key = self.group_of.pop(group, None)
        if summary.get("kept", {}).get("keep_last") and not summary["offloaded"]:
            return  # decided without a commit: backward reached it first (keep_last)
        if key is not None:
            self.committed[key] += 1
            self.offloaded[key] += summary["offloaded_bytes"]

    def _h2d(self) -> int | None:
        """Bytes reloaded so far (fast counts them in ``stats()["copies"]``; ref does not)."""
        copies = self.off.stats().get("copies") if self.off is not None else None
        return None if copies is None else copies.get("h2d_bytes", 0)

    def _close_backward(self) -> None:
        now = self._h2d()
        if self._backward is not None and now is not None:
            self.reloaded[self._backward] += now - (self._h2d_at or 0)
        self._h2d_at, self._backward = now, None

    def report(self, stages: list[int]) -> dict[str, Any]:
        """The last step: order per stage, micro-batches in flight, bytes per micro-batch."""
        order = {s: " ".join(f"{kind}{mb}" for kind, st, mb in self.events if st == s) for s in stages}
        in_flight = {}
        for s in stages:
            live = most = 0
            for kind, st, _ in self.events:
                if st == s:
                    live += 1 if kind == "F" else -1
                    most = max(most, live)
            in_flight[s] = most
        counted = self._h2d() is not None
        per_mb: list[dict[str, Any]] = [
            {"stage": s, "microbatch": mb, "groups_committed": self.committed[(s, mb)],
             "offloaded_bytes": self.offloaded[(s, mb)], "reloaded_bytes": self.reloaded[(s, mb)] if counted else None}
            for s in stages for mb in range(self.n)]
        summary = [f"stage {s}: {order[s]}  (up to {in_flight[s]} micro-batches in flight)" for s in stages]
        out: dict[str, Any] = {"order": order, "max_microbatches_in_flight": in_flight, "microbatches": per_mb,
                               "invariants": {"order": order}, "summary": summary}
        if self.off is None:
            return out

        def kib(key: str, s: int) -> str:
            return " ".join(f"{m[key] / 1024:.0f}" for m in per_mb if m["stage"] == s)

        for s in stages:
            summary.append(f"stage {s}: offloaded KiB per micro-batch {kib('offloaded_bytes', s)}"
                           + (f", reloaded in its backward {kib('reloaded_bytes', s)}" if counted else ""))
        if counted:
            # A reload for another micro-batch would show as more bytes back than out.
            out["checks"] = {"no reload for another micro-batch":
                             all(m["reloaded_bytes"] <= m["offloaded_bytes"] for m in per_mb)}
        return out


class Stage(nn.Module):
    """Stage ``index`` of ``n_stages`` of a GPT: blocks ``lo:hi``; the embedding on the first
    stage, the final norm and head on the last."""

    def __init__(self, gpt: GPT, index: int, n_stages: int, lo: int, hi: int, trace: ScheduleTrace):
        super().__init__()
        self.index = index
        first, last = index == 0, index == n_stages - 1
        self.embed = gpt.embed if first else None
        self.pos = gpt.pos if first else None
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None
        self.trace = trace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self.trace.forward(self.index)
        h = x
        if self.embed is not None and self.pos is not None:
            h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        out = h
        if self.ln_f is not None and self.head is not None:
            out = self.head(self.ln_f(h))
        # Fires when this micro-batch's backward reaches this stage.
        out.register_hook(lambda grad: self.trace.backward(self.index, mb))
        return out


def check(args: argparse.Namespace) -> None:
    """Layers split evenly among the stages, the batch among the micro-batches (before any
    process starts)."""
    if args.microbatches < 1:
        raise SystemExit(f"--microbatches: at least 1, got {args.microbatches}")
    n_stages = (2 if args.schedule == "interleaved" else 1) * world_size(args)
    if args.layers % n_stages or args.batch % args.microbatches:
        raise SystemExit(f"--layers ({args.layers}) must be a multiple of {n_stages} stages and --batch "
                         f"({args.batch}) of --microbatches ({args.microbatches})")


def build(ctx: Context, args: argparse.Namespace, mode: str) -> Trainee:
    per_rank = 2 if args.schedule == "interleaved" else 1
    n_stages = per_rank * ctx.world
    torch.manual_seed(args.seed)  # every rank builds the same whole model and keeps its stages
    dtype = getattr(torch, args.dtype)
    gpt = GPT(gpt_config(args)).to(device=ctx.device, dtype=dtype)
    trace = ScheduleTrace(args.microbatches)
    per_stage = args.layers // n_stages
    mine = [ctx.rank + k * ctx.world for k in range(per_rank)]  # interleaved: rank r holds r, r + world
    modules = [Stage(gpt, s, n_stages, s * per_stage, (s + 1) * per_stage, trace) for s in mine]
    del gpt  # the parts of other stages go with it

    mb = args.batch // args.microbatches
    hidden = torch.zeros(mb, args.seq_len, args.d_model, dtype=dtype, device=ctx.device, requires_grad=True)
    tokens = torch.zeros(mb, args.seq_len, dtype=torch.long, device=ctx.device)
    logits = torch.zeros(mb, args.seq_len, args.vocab, dtype=dtype, device=ctx.device)
    stages = [PipelineStage(m, m.index, n_stages, ctx.device,  # shapes given: no inference run
                            input_args=(tokens if m.index == 0 else hidden,),
                            output_args=(logits if m.index == n_stages - 1 else hidden,))
              for m in modules]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))

    cls = SCHEDULES[args.schedule]
    schedule = cls(stages if per_rank > 1 else stages[0], args.microbatches, loss_fn=loss_fn)
    has_first, has_last = 0 in mine, n_stages - 1 in mine
    params = [(f"stage{m.index}.{n}", p) for m in modules for n, p in m.named_parameters()]
    opt = torch.optim.AdamW([p for _, p in params], lr=args.lr)

    def step(i: int) -> torch.Tensor | None:
        x, y = batch(args, i, 0, ctx.device)  # the whole batch; the schedule splits it
        losses: list[torch.Tensor] = []
        trace.start_step()
        schedule.step(*([x] if has_first else []), **({"target": y, "losses": losses} if has_last else {}))
        trace.end_step()
        return torch.stack(losses) if losses else None

    def attach(off: ao.Offloader) -> None:
        trace.off = off
        off.add_observer(trace)

    return Trainee(
        blocks=[b for m in modules for b in m.blocks],
        block_names=[f"stage{m.index}.block{j}" for m in modules for j in range(len(m.blocks))],
        step=step,
        named_params=params,
        optimizer=opt,
        held=lambda: (p for _, p in params),
        report=lambda off: trace.report(mine),
        on_offloader=attach,
    )


def run(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv``); returns the exit code."""
    p = parser(__doc__)
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="interleaved: 2 stages per rank")
    p.add_argument("--microbatches", type=int, default=4, help="per step")
    p.set_defaults(batch=8)
    return main("pipeline_parallel", build, p, argv, check)


if __name__ == "__main__":
    raise SystemExit(run())
