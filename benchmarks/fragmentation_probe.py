"""Where the caching allocator's cache grows in gradient accumulation on the loop sweep's
decoder (a diagnostic, not a test): the loop sweep's accumulation (4 micro-batches of 4 x 2048
tokens, gradients accumulating, then AdamW), run by checkpointing every block and by ``fast``
under a memory budget forced to recompute every part with its inputs moved out (the
least-memory plan), to recompute every part with its inputs kept, and to recompute every
block whole with its inputs moved out, with no copy out in flight (windows 0/0 and 0/1: the
least memory where no plan fits since e4bd470). For each: every
micro-batch's reserved and allocated peaks (the plan forced, and the cache given back, after
each optimizer step but the last two, so that those run on the cache the forced plan built), and
for the second micro-batch of the last optimizer step of checkpointing (and of fast's plans with
``--record-fast``), recorded with ``torch.cuda.memory._record_memory_history`` (Python stacks), each allocation that
made the allocator take a new segment from the device (its size and where the program asked for it), and the cache at the
end: segments by size, what of them is allocated, and what lies free inside segments in use.

    PYTHONPATH=.:benchmarks python benchmarks/fragmentation_probe.py [--steps 5] [--record-fast] > OUT-log.txt

Why: the loop sweep's accumulation at checkpointing's peak goes over the budget in most
micro-batches, the least-memory plan reserving 9.1-9.6 GiB for 6.76 allocated where
checkpointing reserves 8.13 for 7.00; this says what fills the difference. On the CPU it runs
the tiny decoder and reports times and plans only (the CPU has no caching allocator).

On an H200 at 1a160d8 (``benchmarks/results/*-1a160d8-fragmentation-probe-log.txt``): on its
own cache the least-memory plan reserved 8.48 GiB for 6.76 allocated, checkpointing 8.57 for
7.00; the recorded micro-batch of either fast plan raised ``SystemError`` in its recomputation
while the allocator recorded Python stacks (docs/semantics.md, "Recomputed groups"), so which
allocations grew the cache under fast is still to be seen.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import torch

from actoffload.budget.actions import Action
from actoffload.tools import loop_sweep
from forced_llama import force_every_workload

GiB = float(1 << 30)
MiB = float(1 << 20)
MICRO = loop_sweep.MICRO_BATCHES
# frames of these files say where in the program a block was asked for
OURS = ("actoffload/", "loop_sweep.py", "models.py", "torch/utils/checkpoint.py", "torch/optim/")


def _where(frames: list[dict[str, Any]]) -> str:
    mine = [f for f in frames if any(k in f.get("filename", "") for k in OURS)]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in mine[:4]) or "?"


def _growth(snapshot: dict[str, Any]) -> list[str]:
    """Each new segment of the recorded events: its size and the allocation that asked for it."""
    out: list[str] = []
    events = [e for trace in snapshot["device_traces"] for e in trace]
    last_alloc: dict[str, Any] | None = None
    sizes: collections.Counter[str] = collections.Counter()
    for e in events:
        if e["action"] == "segment_alloc":
            last_alloc = e
        elif e["action"] == "alloc" and last_alloc is not None:
            where = _where(e.get("frames", []))
            out.append(f"    segment {last_alloc['size'] / MiB:8.1f} MiB for a request of {e['size'] / MiB:8.2f} MiB at {where}")
            sizes[where] += last_alloc["size"]
            last_alloc = None
    if sizes:
        out.append("    new segments' bytes by where asked: " + "; ".join(
            f"{v / MiB:.0f} MiB at {k}" for k, v in sizes.most_common(6)))
    return out


def _cache(snapshot: dict[str, Any]) -> list[str]:
    """The cache's segments at the end, by size class: held, allocated, and free inside
    segments with something allocated (what no release can give back)."""
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for s in snapshot["segments"]:
        total, allocated = s["total_size"], s["allocated_size"]
        kind = "small (2 MiB)" if s["segment_type"] == "small" else (
            "20 MiB" if total == 20 * (1 << 20) else f"{'<' if total < 256 * (1 << 20) else '>='} 256 MiB")
        r = rows[kind]
        r[0] += 1
        r[1] += total
        r[2] += allocated
        r[3] += total - allocated if allocated else 0
    return [f"    {k:14s} {int(r[0]):4d} segments {r[1] / GiB:6.2f} GiB held {r[2] / GiB:6.2f} allocated "
            f"{r[3] / GiB:6.2f} free inside used ones" for k, r in sorted(rows.items())]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per method; the last is recorded")
    p.add_argument("--record-fast", action="store_true",
                   help="record fast's micro-batch too (on torch 2.11 its recomputation raised SystemError so)")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps: at least 3 (a plan is forced after the first, and the last two run it on its own cache)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    w = loop_sweep.llama(device, small=not cuda)
    loop = loop_sweep._Loop(w, log=print)
    print(f"decoder on {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
    for name, action, window in (
            ("checkpoint_all", None, (0, 0)), ("fast recompute_offload", Action.RECOMPUTE_OFFLOAD, (0, 0)),
            ("fast recompute", Action.RECOMPUTE, (0, 0)),
            ("fast whole recompute_offload 0/0", Action.RECOMPUTE_WHOLE_OFFLOAD, (0, 0)),
            ("fast whole recompute_offload 0/1", Action.RECOMPUTE_WHOLE_OFFLOAD, (0, 1))):
        m = loop_sweep.Method(name, checkpoint=action is None, budget=None if action is None else 1 << 50,
                              level="probe")
        print(f"== {name}")
        try:
            _run(loop, w, m, action, window, args.steps, cuda, cuda and (action is None or args.record_fast))
        except Exception as e:  # noqa: BLE001  a diagnostic: report it and go on to the next method
            if cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
            print(f"  {name} raised {type(e).__name__}: {e}")
    return 0


def _run(loop: Any, w: Any, m: Any, action: Action | None, window: tuple[int, int], steps: int, cuda: bool,
         record: bool) -> None:
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    with loop.method(m) as off:
        opt = torch.optim.AdamW(loop.params, lr=1e-4)
        for k in range(steps):
            peaks = []
            for j in range(MICRO):
                recording = record and k == steps - 1 and j == 1  # a micro-batch with gradients there
                if recording:
                    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
                tokens = w.tokens(100_000 + MICRO * k + j, w.seq_len)
                _, seconds, reserved, allocated = loop.timed(lambda: (w.loss(m.call(), tokens) / MICRO).backward())
                sizes = "-" if reserved is None else f"{reserved / GiB:.2f}/{(allocated or 0) / GiB:.2f}"
                peaks.append(f"{sizes} ({seconds * 1e3:.0f} ms)")
                if recording:
                    snapshot = torch.cuda.memory._snapshot()
                    torch.cuda.memory._record_memory_history(enabled=None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ran = "" if off is None else str(dict(collections.Counter(
                g["action"] for g in off.stats()["plan"].get("groups", []))))
            print(f"  step {k}: reserved/allocated GiB per micro-batch {', '.join(peaks)} {ran}")
            if off is not None and action is not None and k < steps - 2:
                force_every_workload(off, action, *window)
                if cuda:  # the cache the plans before it built (keeping everything, say) is not its own
                    torch.cuda.empty_cache()
            if record and k == steps - 1:
                print("  new segments in the recorded micro-batch (the second of the last step):")
                print("\n".join(_growth(snapshot)) or "    none")
                print("  the cache after it:")
                print("\n".join(_cache(snapshot)))
                # now, not peaks: the budget's controller resets the peak counters group by group
                stats = torch.cuda.memory_stats()
                print(f"  allocator now: inactive split {stats.get('inactive_split_bytes.all.current', 0) / GiB:.2f} GiB, "
                      f"segments {stats.get('segment.all.current', 0)}; "
                      f"retries in this method {stats.get('num_alloc_retries', 0) - retries}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
