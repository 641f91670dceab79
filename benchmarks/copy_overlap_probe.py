"""Whether fast's copies overlap the compute they are meant to hide behind, on transformers'
8B-shaped Llama at 32k tokens (``hf_8b_32k``; a diagnostic, not a test; CUDA).

For a few forced plans (``BudgetController.force``: one action on every layer, one copy window)
it records one step with torch's profiler and reads the device's timeline: the compute
stream's busy and idle time in forward and in backward, each copy direction's bytes, time and
rate, and the compute stream's longest idle gaps. Each gap says what the copy streams did
meanwhile and whether the kernel after it was launched late (the host behind: ``launched
late``) or had been waiting on another stream (``waited``). A plan whose copies the model
hides behind compute but whose backward runs as long as its compute and its reloads together
shows here as gaps that waited on reloads.

On an H200 (``benchmarks/results/*-copy-overlap-probe-log.txt``): at 4386384, offloading every
layer with a window of one idled 363 ms in backward in three waits of about 120 ms, a whole
layer's reload each (no reload ran ahead: the layers' first saves gave prefetch no link to the
layer before); at 9acff22, 40 ms each (half a layer ahead, the rest after the layer before);
at 127375b (whole layers ahead under a plan), 26-31 ms, and the selective plans moving their
kept outputs 4 ms in all.

    PYTHONPATH=benchmarks:. python benchmarks/copy_overlap_probe.py [--steps 3] [--device cpu] [--trace DIR] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from actoffload.budget.actions import Action, GroupDecision
from actoffload.tools.sweep_models import plain
from forced_llama import ForcedLlama, probe_device

VARIANTS: list[tuple[str, Action, float, int, int]] = [
    ("offload 1.0 w1 p1", Action.OFFLOAD, 1.0, 1, 1),
    ("offload 1.0 w2 p2", Action.OFFLOAD, 1.0, 2, 2),
    ("recompute_selective_offload 1.0 w1 p1", Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0, 1, 1),
    ("recompute_selective_offload 1.0 w2 p2", Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0, 2, 2),
]
GAP_US = 1000.0  # a compute-stream gap worth listing


@dataclass(frozen=True)
class Span:
    start: float  # microseconds, the profiler's clock
    end: float


def merged(spans: list[Span]) -> list[Span]:
    """The union of ``spans`` as disjoint spans in order."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1].end:
            out[-1] = Span(out[-1].start, max(out[-1].end, s.end))
        else:
            out.append(s)
    return out


def covered(spans: list[Span], lo: float, hi: float) -> float:
    """Microseconds of [lo, hi] that the disjoint ``spans`` cover."""
    return sum(max(0.0, min(s.end, hi) - max(s.start, lo)) for s in spans)


def timeline(trace: dict[str, Any], backward_at: float | None) -> str:
    """The report on one step's trace (Chrome trace JSON as torch's profiler writes it)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    if not kernels:
        return "  no device timeline (no CUDA kernels recorded)"
    launch_at = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    busy: dict[int, float] = {}
    for k in kernels:
        busy[k["args"]["stream"]] = busy.get(k["args"]["stream"], 0.0) + k["dur"]
    compute = max(busy, key=lambda s: busy[s])
    mine = sorted((k for k in kernels if k["args"]["stream"] == compute), key=lambda k: k["ts"])
    compute_spans = merged([Span(k["ts"], k["ts"] + k["dur"]) for k in mine])
    out_spans = merged([Span(c["ts"], c["ts"] + c["dur"]) for c in copies if "DtoH" in c["name"]])
    in_spans = merged([Span(c["ts"], c["ts"] + c["dur"]) for c in copies if "HtoD" in c["name"]])
    first = min(e["ts"] for e in kernels + copies)
    last = max(e["ts"] + e["dur"] for e in kernels + copies)
    split = backward_at if backward_at is not None and first < backward_at < last else None
    lines = [f"  device span {(last - first) / 1e3:.1f} ms; compute stream {compute}: "
             f"{sum(s.end - s.start for s in compute_spans) / 1e3:.1f} ms busy"]
    for phase, lo, hi in (("forward", first, split or last), ("backward", split or last, last)):
        if hi <= lo:
            continue
        cb = covered(compute_spans, lo, hi)
        lines.append(f"  {phase}: {(hi - lo) / 1e3:.1f} ms, compute busy {cb / 1e3:.1f}, idle "
                     f"{(hi - lo - cb) / 1e3:.1f}; out {covered(out_spans, lo, hi) / 1e3:.1f} ms, "
                     f"in {covered(in_spans, lo, hi) / 1e3:.1f} ms on the bus")
    for label, key in (("out (DtoH)", "DtoH"), ("in (HtoD)", "HtoD")):
        mine_c = [c for c in copies if key in c["name"]]
        nbytes = sum(c["args"].get("bytes", 0) for c in mine_c)
        dur = sum(c["dur"] for c in mine_c)
        rate = nbytes / dur / 1e3 if dur else 0.0
        lines.append(f"  {label}: {len(mine_c)} copies, {nbytes / 2**30:.2f} GiB, {dur / 1e3:.1f} ms, {rate:.1f} GB/s")
    gaps = []
    for prev, nxt in zip(mine, mine[1:]):
        lo, hi = prev["ts"] + prev["dur"], nxt["ts"]
        if hi - lo >= GAP_US:
            launched = launch_at.get(nxt["args"]["correlation"])
            why = "?" if launched is None else ("launched late" if launched > lo else "waited")
            gaps.append((hi - lo, lo, hi, why, nxt["name"]))
    idle = sum(g[0] for g in gaps)
    lines.append(f"  {len(gaps)} compute gaps of {GAP_US / 1e3:.0f} ms or more, {idle / 1e3:.1f} ms in all; "
                 + ", ".join(f"{why} {sum(g[0] for g in gaps if g[3] == why) / 1e3:.1f} ms"
                             for why in ("waited", "launched late", "?")))
    for length, lo, hi, why, name in sorted(gaps, reverse=True)[:12]:
        phase = "backward" if split is not None and lo >= split else "forward"
        lines.append(f"    at {(lo - first) / 1e3:7.1f} ms ({phase}) idle {length / 1e3:6.1f} ms, {why}; "
                     f"out {covered(out_spans, lo, hi) / 1e3:.1f}, in {covered(in_spans, lo, hi) / 1e3:.1f} ms "
                     f"meanwhile; next {name[:60]}")
    return "\n".join(lines)


def profiled_step(rig: ForcedLlama, trace_dir: str | None, name: str) -> str:
    """One step under torch's profiler, and the report on its device timeline."""
    cuda = rig.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rig._sync()
    with profile(activities=activities) as prof:
        with record_function("probe.forward"):
            loss = rig.workload.loss(plain, 0)
        with record_function("probe.backward"):
            loss.backward()
        rig._sync()
    for q in rig.workload.trainable:
        q.grad = None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if trace_dir is not None:
        slug = name.replace(" ", "_").replace(".", "")
        with gzip.open(os.path.join(trace_dir, f"{slug}.json.gz"), "wt") as f:
            json.dump(trace, f)
    marks = [e for e in trace.get("traceEvents", []) if e.get("name") == "probe.backward"
             and e.get("cat") == "gpu_user_annotation"]
    return timeline(trace, marks[0]["ts"] if marks else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="steps before the profiled one")
    ap.add_argument("--workload", default="hf_8b_32k")
    ap.add_argument("--device", default="cuda", help="cpu: the workload's tiny shape, to check the probe runs")
    ap.add_argument("--trace", default=None, help="a folder for each variant's trace (gzipped Chrome JSON)")
    args = ap.parse_args()
    device, card = probe_device("copy_overlap_probe", args.device)
    print(f"{card}, torch {torch.__version__}, {args.workload}", flush=True)
    rig = ForcedLlama(device, args.workload)
    for i in range(args.steps):
        rig.step(plain, i)
    print("none", flush=True)
    print(profiled_step(rig, args.trace, "none"), flush=True)
    layers = len(rig.workload.blocks)
    for name, action, fraction, window, prefetch in VARIANTS:
        handle = rig.forced([GroupDecision(action, fraction)] * layers, window, prefetch)
        try:
            for i in range(args.steps):
                rig.step(plain, i)
            print(name, flush=True)
            print(profiled_step(rig, args.trace, name), flush=True)
        finally:
            handle.remove()


if __name__ == "__main__":
    main()
