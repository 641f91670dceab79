"""Whether fast, recomputing every block whole with its inputs kept, runs as fast as torch's
checkpoint around each block, on the loop sweep's decoder at three lengths (a diagnostic, not
a test): the host's ms to issue a step and its full ms, median of ``--steps``, for no
offloading, torch's checkpoint, fast keeping everything, fast recomputing every block whole,
and fast recomputing every part; then torch's checkpoint, fast's whole blocks and fast keeping
everything, five steps each, the host's part under cProfile (``--cprofile N`` functions, at
``--profile-length``); with ``--trace``, three steps of torch's checkpoint, whole blocks and every
part under ``torch.profiler`` (the ops and CUDA calls by device time and by count).

    PYTHONPATH=.:benchmarks python benchmarks/whole_vs_checkpoint_probe.py [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import actoffload as ao
from actoffload.budget.actions import Action
from actoffload.budget.controller import PROFILE_STEPS
from actoffload.tools import loop_sweep
from actoffload.tools.models import block_parts
from forced_llama import force_every_workload, loop_decoder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cprofile", type=int, default=20)
    p.add_argument("--profile-length", type=int, default=0, help="the length profiled (default: the full one)")
    p.add_argument("--trace", action="store_true",
                   help="also three steps of each under torch.profiler: the ops and CUDA calls of most device and host time")
    p.add_argument("--skip-timing", action="store_true", help="only what --cprofile and --trace ask")
    a = p.parse_args(argv)
    w = loop_decoder(a.device, "whole_vs_checkpoint_probe")
    device = w.device
    lengths = [w.seq_len // 2, 3 * w.seq_len // 4, w.seq_len]
    loop = loop_sweep._Loop(w, print)
    loop_sweep._warm_up(loop, lengths)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(call, length: int, i: int) -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        w.loss(call, w.tokens(i, length)).backward()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        for q in w.model.parameters():
            q.grad = None
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    def timed(call, length: int) -> str:
        runs = [step(call, length, i) for i in range(a.steps + 2)][2:]
        return (f"host {statistics.median(r[0] for r in runs):6.1f} ms, full "
                f"{statistics.median(r[1] for r in runs):6.1f} ms")

    off = ao.Offloader(impl="fast", device=device, memory_budget=1 << 40)
    handle = ao.wrap(w.blocks, off, parts=block_parts)
    for length in lengths:  # a profile per length
        for i in range(PROFILE_STEPS + 1):
            step(loop_sweep.plain, length, i)
    handle.remove()
    for length in [] if a.skip_timing else lengths:
        print(f"length {length}:")
        print(f"  no offloading          {timed(loop_sweep.plain, length)}")
        print(f"  torch checkpoint       {timed(loop_sweep._checkpointed, length)}")
        handle = ao.wrap(w.blocks, off, parts=block_parts)
        for name, action in (("fast keep", Action.KEEP), ("fast whole blocks", Action.RECOMPUTE_WHOLE),
                             ("fast every part", Action.RECOMPUTE)):
            force_every_workload(off, action)
            print(f"  {name:22s} {timed(loop_sweep.plain, length)}")
        handle.remove()
    def method(action: Action | None) -> tuple[Any, Any]:
        """The wrap's handle (``None``: torch's checkpoint, nothing wrapped) and the layers' call,
        fast forced to ``action`` on every group."""
        if action is None:
            return None, loop_sweep._checkpointed
        handle = ao.wrap(w.blocks, off, parts=block_parts)
        force_every_workload(off, action)
        return handle, loop_sweep.plain

    if a.trace:
        length = a.profile_length or w.seq_len
        traced: tuple[tuple[str, Action | None], ...] = (
            ("torch checkpoint", None), ("fast whole blocks", Action.RECOMPUTE_WHOLE), ("fast every part", Action.RECOMPUTE))
        for name, chosen in traced:
            handle, call = method(chosen)
            for i in range(3):
                step(call, length, i)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                for i in range(3):
                    step(call, length, i)
            by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            print(f"{name}, three steps at {length} under torch.profiler, by {by}:")
            print(prof.key_averages().table(sort_by=by, row_limit=25))
            print(f"{name}, the same by calls (CUDA API calls and ops):")
            print(prof.key_averages().table(sort_by="count", row_limit=25))
            if handle is not None:
                handle.remove()
    if a.cprofile:
        length = a.profile_length or w.seq_len
        profiled: tuple[tuple[str, Action | None], ...] = (
            ("torch checkpoint", None), ("fast whole blocks", Action.RECOMPUTE_WHOLE), ("fast keep", Action.KEEP))
        for name, chosen in profiled:
            handle, call = method(chosen)
            if chosen is not None:
                step(call, length, 0)
            prof = cProfile.Profile()
            sync()
            prof.enable()  # the host's part only: it stops where backward() returns
            for i in range(5):
                w.loss(call, w.tokens(i, length)).backward()
                for q in w.model.parameters():
                    q.grad = None
            prof.disable()
            sync()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
            stats.print_stats(a.cprofile)
            stats.print_stats("actoffload|fast/|torch/cuda|autograd/graph", a.cprofile)  # the offloader's own
            print(f"{name}, five steps at {length} under cProfile (the host's part):\n{out.getvalue()}")
            if handle is not None:
                handle.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
