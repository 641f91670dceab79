"""Offload throughput alone and while NCCL all-reduces run on the same GPUs (2 GPUs, CUDA only).

Data parallelism all-reduces gradients during backward, exactly when an offloader
reloads activations; on some hosts GPU-to-GPU traffic and host copies share links. Each
rank measures, first alone, then while a stream of all-reduces (``--allreduce-mib`` each)
runs on both GPUs:

- pinned copies of a ``--mib`` buffer, device-to-host and host-to-device, on a side stream
  (GB/s from CUDA events, median of ``--reps``);
- fast's offload of one group (``--tensors`` saved tensors, ``--mib`` in all): the copy out
  at its commit and the reload in backward, timed on fast's copy streams (``ao.Observer``);
- the all-reduces' bus bandwidth (nccl-tests' count), alone and while pinned copies run
  both ways at once.

    torchrun --nproc-per-node 2 examples/bus_contention.py --out bus.json
    python examples/bus_contention.py                 # spawns 2 processes itself

On a machine without CUDA it says so and exits 0: it is a GPU measurement.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import actoffload as ao
from common import Context, MiB, describe, init_distributed, launch, results_json


class CopyTimes(ao.Observer):
    """The copy batches fast reports, with their CUDA events."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, int, Any, Any]] = []

    def on_copy(self, direction: str, nbytes: int, start: Any, end: Any) -> None:
        self.copies.append((direction, nbytes, start, end))

    def gbps(self, direction: str) -> float:
        done = [(n, s.elapsed_time(e)) for d, n, s, e in self.copies if d == direction]
        if not done:
            raise RuntimeError(f"fast reported no {direction} copy; nothing to time")
        return sum(n for n, _ in done) / (sum(ms for _, ms in done) / 1e3) / 1e9


def pinned_copy(dev: torch.Tensor, host: torch.Tensor, direction: str) -> Callable[[], float]:
    """One timed copy on a side stream; returns its GB/s."""
    stream = torch.cuda.Stream()

    def run() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start.record()
            (host.copy_(dev, non_blocking=True) if direction == "d2h" else dev.copy_(host, non_blocking=True))
            end.record()
        end.synchronize()
        return dev.numel() * dev.element_size() / (start.elapsed_time(end) / 1e3) / 1e9

    return run


def fast_group(ctx: Context, args: argparse.Namespace, direction: str) -> Callable[[], float]:
    """One group offloaded by fast (committed at its exit, ``keep_last=0``) and reloaded by
    backward; returns the GB/s of the copy in ``direction`` on fast's copy stream."""
    off = ao.Offloader(impl="fast", device=ctx.device, keep_last=0, min_offload_bytes=0)
    n = args.mib * MiB // 4 // args.tensors
    x = torch.randn(n, device=ctx.device, requires_grad=True)

    def run() -> float:
        times = CopyTimes()
        with off.add_observer(times):
            with off.group("g"):
                # sin saves its input: args.tensors activations of n floats each
                y = torch.stack([(x + i).sin().sum() for i in range(args.tensors)]).sum()
            # Let the copy out finish first: backward would otherwise use the group in place
            # (its sources still live) and nothing would be reloaded.
            off.synchronize()
            y.backward()
            torch.cuda.synchronize()
        x.grad = None
        return times.gbps(direction)

    return run


class AllReduces:
    """All-reduces of one tensor on a stream of their own, beside compute and copies."""

    def __init__(self, size_mib: int, device: torch.device, world: int):
        self.t = torch.ones(size_mib * MiB // 4, device=device)
        self.stream = torch.cuda.Stream(device)
        self.world = world
        self.bus_bytes = self.t.numel() * 4 * 2 * (world - 1) / world  # per all-reduce, as nccl-tests count

    def start(self, count: int) -> Callable[[], float]:
        """Enqueue ``count`` all-reduces; returns a function that waits and gives their bus GB/s."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(count):
                dist.all_reduce(self.t)
            end.record()

        def result() -> float:
            end.synchronize()
            return self.bus_bytes * count / (start.elapsed_time(end) / 1e3) / 1e9

        return result


def busy_copies(dev: torch.Tensor, host: torch.Tensor, count: int) -> list[torch.cuda.Stream]:
    """Enqueue ``count`` copies each way at once, on two streams (the bus is full duplex)."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    half = dev.numel() // 2  # each direction its own half: the two never touch the same bytes
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(count):
        with torch.cuda.stream(streams[0]):
            host[:half].copy_(dev[:half], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            dev[half:].copy_(host[half:], non_blocking=True)
    return streams


def agree(count: int, device: torch.device) -> int:
    """The largest ``count`` of all ranks: every rank must enqueue as many all-reduces."""
    t = torch.tensor([count], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.empty(args.mib * MiB, dtype=torch.uint8, device=ctx.device)
    host = torch.empty(args.mib * MiB, dtype=torch.uint8, pin_memory=True)
    reduces = AllReduces(args.allreduce_mib, ctx.device, ctx.world)
    tests = {
        "pinned D2H": pinned_copy(dev, host, "d2h"),
        "pinned H2D": pinned_copy(dev, host, "h2d"),
        "fast offload (D2H)": fast_group(ctx, args, "d2h"),
        "fast reload (H2D)": fast_group(ctx, args, "h2d"),
    }
    for run in tests.values():  # warm up: pinned pool, NCCL communicator, kernels
        run()
    reduces.start(2)()
    ar_alone = statistics.median(reduces.start(8)() for _ in range(args.reps))
    ar_ms = reduces.bus_bytes / (ar_alone * 1e9) * 1e3  # one all-reduce
    results: dict[str, Any] = {}
    for name, run in tests.items():
        alone, busy = [], []
        for _ in range(args.reps):
            dist.barrier()
            torch.cuda.synchronize()
            alone.append(run())
        copy_ms = args.mib * MiB / (statistics.median(alone) * 1e9) * 1e3
        for _ in range(args.reps):
            dist.barrier()
            torch.cuda.synchronize()
            # All-reduces enqueued first, enough to outlast the copy (its time alone, twice)
            wait = reduces.start(agree(max(4, math.ceil(2 * copy_ms / ar_ms)), ctx.device))
            busy.append(run())
            wait()
        results[name] = {"alone": statistics.median(alone), "with the other": statistics.median(busy)}
    # And the other way round: all-reduces while pinned copies run both ways, long enough to outlast them.
    ar_busy = []
    half_ms = args.mib * MiB / 2 / (results["pinned D2H"]["alone"] * 1e9) * 1e3  # one copy of busy_copies
    for _ in range(args.reps):
        dist.barrier()
        torch.cuda.synchronize()
        streams = busy_copies(dev, host, max(2, math.ceil(2 * 8 * ar_ms / half_ms)))  # local: may differ
        ar_busy.append(reduces.start(8)())
        for s in streams:
            s.synchronize()
    results["all-reduce (bus GB/s)"] = {"alone": ar_alone, "with the other": statistics.median(ar_busy)}
    return results


def rank_main(args: argparse.Namespace) -> int:
    ctx = init_distributed("cuda")
    results = measure(ctx, args)
    gathered: list[Any] = [None] * ctx.world
    dist.all_gather_object(gathered, {"rank": ctx.rank, "gpu": torch.cuda.get_device_name(ctx.device), "GB/s": results})
    if ctx.rank == 0:
        prov = describe(ctx.device)
        print(f"\nbus contention: {ctx.world} x {prov['gpu']}, {args.mib} MiB copies, {args.allreduce_mib} MiB "
              f"all-reduces, median of {args.reps}, torch {prov['torch']}, commit {prov['commit']}")
        print(f"{'rank':<5} {'GB/s':<22} {'alone':>8} {'with the other':>15} {'ratio':>6}")
        for r in gathered:
            for name, v in r["GB/s"].items():
                other = v["with the other"]
                print(f"{r['rank']:<5} {name:<22} {v['alone']:>8.1f} {other:>15.1f} {other / v['alone']:>6.2f}")
        if args.out:
            Path(args.out).write_text(results_json({"example": "bus_contention", "config": vars(args),
                                                    "provenance": prov, "ranks": gathered}))
            print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


def run(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv``); returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not run by torchrun (2)")
    p.add_argument("--mib", type=int, default=1024, help="MiB per copy and per offloaded group (1024)")
    p.add_argument("--tensors", type=int, default=8, help="saved tensors in the offloaded group (8)")
    p.add_argument("--allreduce-mib", type=int, default=256, help="MiB per all-reduce (256)")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported (5)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bus_contention measures copies over a GPU's bus and NCCL traffic: it needs CUDA (and 2 GPUs); "
              "nothing to measure here")
        return 0
    from functools import partial

    return launch(partial(rank_main, args), args.nproc)


if __name__ == "__main__":
    raise SystemExit(run())
