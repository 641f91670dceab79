"""Whether a step whose groups fast recomputes survives ``torch.cuda.memory._record_memory_history``
(a diagnostic, not a test). On an H200 (torch 2.11) ``benchmarks/fragmentation_probe.py``'s
recorded micro-batches raised ``SystemError`` ("... returned NULL without setting an exception")
in every fast plan that recomputes, and never in torch's own checkpoint (docs/semantics.md,
"Recomputed groups"). This narrows it down on a small model: one step of each case below, each
in a fresh wrap, under the recorder (Python stacks), and the outcome of each:

- ``checkpoint``: torch's non-reentrant checkpoint around each block, no offloader;
- ``fast recompute``: a memory budget forced to recompute every block;
- ``fast recompute, no early stop``: the same under ``torch.utils.checkpoint.set_checkpoint_early_stop(False)``
  (checkpoint stops a recomputation by raising an exception through the block's forward once
  everything backward needs is recomputed; with early stop off nothing is raised);
- ``fast keep``: a budget keeping everything (hooks, no recomputation);
- each of the fast cases again with the recorder's stacks at ``"all"`` (Python and C++).

    PYTHONPATH=. python benchmarks/record_history_probe.py > OUT-log.txt

It needs CUDA (the recorder is the CUDA allocator's).
"""

from __future__ import annotations

import sys
import traceback
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.utils.checkpoint

import actoffload as ao
from actoffload.budget.actions import Action
from actoffload.budget.controller import PROFILE_STEPS
from forced_llama import force_every_workload


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _step(blocks: torch.nn.ModuleList, x: torch.Tensor, checkpointed: bool) -> None:
    h = x
    for b in blocks:
        h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False) if checkpointed else b(h)
    h.float().square().mean().backward()
    for p in blocks.parameters():
        p.grad = None


def _case(name: str, run: Callable[[], None], stacks: str, context: Any = None) -> None:
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks=stacks)
    try:
        with context if context is not None else nullcontext():
            run()
        torch.cuda.synchronize()
        print(f"{name:42s} stacks={stacks:6s} ran")
    except Exception as e:  # noqa: BLE001  a diagnostic: the outcome is what it reports
        print(f"{name:42s} stacks={stacks:6s} raised {type(e).__name__}: {e}")
        traceback.print_exc(limit=-4, file=sys.stdout)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def main() -> int:
    if not torch.cuda.is_available():
        print("record_history_probe: the recorder is the CUDA allocator's; run it on a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    device = torch.device("cuda")
    blocks = torch.nn.ModuleList(Block(1024) for _ in range(4)).to(device, torch.bfloat16)
    x = torch.randn(8, 512, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")

    def fast(action: Action) -> Callable[[], None]:
        off = ao.Offloader(memory_budget=1 << 50, device=device)
        handle = ao.wrap(blocks, off)
        for _ in range(PROFILE_STEPS + 1):
            _step(blocks, x, False)
        force_every_workload(off, action)
        _step(blocks, x, False)  # the forced plan's first step, unrecorded
        handle.remove()

        def run() -> None:
            h = ao.wrap(blocks, off)
            try:
                _step(blocks, x, False)
            finally:
                h.remove()
        return run

    _step(blocks, x, True)
    for stacks in ("python", "all"):
        _case("checkpoint", lambda: _step(blocks, x, True), stacks)
        _case("fast recompute", fast(Action.RECOMPUTE), stacks)
        _case("fast recompute, no early stop", fast(Action.RECOMPUTE), stacks,
              torch.utils.checkpoint.set_checkpoint_early_stop(False))
        _case("fast keep", fast(Action.KEEP), stacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
