"""Where a plan's step goes on transformers' 8B-shaped Llama at 32k tokens (``hf_8b_32k``), and
what the budget's model says of it (a diagnostic, not a test; CUDA).

Each variant runs as a block of steps: no offloading, torch's checkpoint around each layer, and
fast under a budget whose controller is made to run one action on every layer
(``BudgetController.force``): recomputing only the cheap ops (the costly ops' outputs kept,
``recompute_selective``), the same with all or half of those outputs moved to host memory
(``recompute_selective_offload``) at two copy windows, recomputing all but the fused attention
with the inputs moved out (``recompute_attention_offload``), and offloading everything. A
step is timed whole (its median) and in halves: the forward and loss, then the backward, the
device synchronized between them (so the forward's half includes its copies draining). The
model's step time and peak for each forced plan (``costmodel.simulate`` on the profile the
controller holds) are printed beside them, and beside no offloading and checkpointing the
model's figures for keeping everything and for recomputing every layer. Where
``attention_kept_probe.py --fast-plans`` measures such plans against torch's methods, this asks
how far the model a budget ranks its candidates by is from them before any step calibrates it.
It runs without deterministic algorithms unless ``--deterministic`` (as the sweeps run: a layer's
backward then takes about 1.8x as long).

On an H200 at 3e83115 (``benchmarks/results/*-forced-plans-model-probe*-log.txt``): the
model's peaks within 0.05 GiB of the measured everywhere; with deterministic algorithms its
times within 3% on no offloading, checkpointing and selective recomputation, 1-7% fast on the
plans moving bytes, 23% fast on offloading everything; without them it charged selective
recomputation more than recomputing every layer (765 ms against 746; 643 and 768 measured): the
metered step's last layer had waited 112.9 ms for the device while recomputing, now capped at its
forward's host time (84be614). At 127375b, with whole layers reloaded ahead, the model is within
3% of every plan (``benchmarks/README.md``, "reloads ahead of backward on transformers' Llama").

    PYTHONPATH=benchmarks:. python benchmarks/forced_plans_model_probe.py [--steps 5] [--device cpu] [--deterministic] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from actoffload.budget import costmodel
from actoffload.budget.actions import Action, GroupDecision
from actoffload.tools.sweep_models import plain
from forced_llama import ForcedLlama, probe_device

VARIANTS: list[tuple[str, Action, float, int, int]] = [
    ("recompute_selective", Action.RECOMPUTE_SELECTIVE, 1.0, 0, 0),
    ("recompute_selective_offload 1.0 w1 p1", Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0, 1, 1),
    ("recompute_selective_offload 1.0 w2 p2", Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0, 2, 2),
    ("recompute_selective_offload 0.5 w1 p1", Action.RECOMPUTE_SELECTIVE_OFFLOAD, 0.5, 1, 1),
    ("recompute_attention_offload w0 p1", Action.RECOMPUTE_ATTENTION_OFFLOAD, 1.0, 0, 1),
    ("offload 1.0 w1 p1", Action.OFFLOAD, 1.0, 1, 1),
]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def describe(g: costmodel.GroupProfile) -> str:
    """What the profile holds of one group, and what the model charges its recomputations."""
    charged = {a.value: costmodel.recompute_seconds(GroupDecision(a), g)
               for a in (Action.RECOMPUTE, Action.RECOMPUTE_SELECTIVE, Action.RECOMPUTE_ATTENTION)}
    metered = "-" if g.dispatch_host_s is None else " / ".join(_ms(t) for t in g.dispatch_host_s)
    return (f"group {g.name}: forward {_ms(g.forward_s)} ms, backward {_ms(g.backward_s)} ms, "
            f"recompute {_ms(g.recompute_s)} ms, saved {sum(g.spans) / 2**30:.2f} GiB, "
            f"costly {sum(g.costly or ()) / 2**30:.2f} GiB; host: forward {_ms(g.host_s)} ms, "
            f"recompute {_ms(g.recompute_host_s)} ms, metered {metered} ms; costly share "
            f"{_share(g.costly_share)}, attention share {_share(g.attention_share)}; the model charges "
            "a recomputation " + ", ".join(f"{k} {_ms(v)} ms" for k, v in charged.items()))


def halves(rig: ForcedLlama, call: Any, i: int) -> tuple[float, float, float]:
    """One step's forward-and-loss ms, backward ms and peak allocated GiB (0 on the CPU)."""
    cuda = rig.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rig._sync()
    t0 = time.perf_counter()
    loss = rig.workload.loss(call, i)
    rig._sync()
    t1 = time.perf_counter()
    loss.backward()
    rig._sync()
    t2 = time.perf_counter()
    for q in rig.workload.trainable:
        q.grad = None
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def block(rig: ForcedLlama, name: str, call: Any, steps: int, model: tuple[int, float] | None) -> None:
    full = [rig.step(call, i)[1] for i in range(steps)]
    split = [halves(rig, call, i) for i in range(steps)]
    fwd = statistics.median(s[0] for s in split)
    bwd = statistics.median(s[1] for s in split)
    peak = max(s[2] for s in split)
    said = "" if model is None else f"   model {model[1] * 1e3:7.1f} ms, {model[0] / 2**30:6.2f} GiB"
    print(f"{name:40s} step {statistics.median(full):7.1f} ms (forward {fwd:6.1f}, backward {bwd:6.1f}), "
          f"peak {peak:6.2f} GiB{said}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workload", default="hf_8b_32k")
    ap.add_argument("--device", default="cuda", help="cpu: the workload's tiny shape, to check the probe runs")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic algorithms, as the sweeps run (set CUBLAS_WORKSPACE_CONFIG=:4096:8 too)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(args.deterministic)
    device, card = probe_device("forced_plans_model_probe", args.device)
    print(f"{card}, torch {torch.__version__}, {args.workload}, deterministic: {args.deterministic}", flush=True)
    rig = ForcedLlama(device, args.workload)
    profile = rig._controller.profile
    assert profile is not None
    for g in profile.groups:
        print(describe(g), flush=True)
    print(f"bus: {profile.d2h_bps / 1e9:.1f} GB/s out, {profile.h2d_bps / 1e9:.1f} GB/s in", flush=True)
    layers = len(rig.workload.blocks)
    keep_all = costmodel.simulate(profile, [GroupDecision(Action.KEEP)] * layers, 0, 0)
    recompute_all = costmodel.simulate(profile, [GroupDecision(Action.RECOMPUTE)] * layers, 0, 0)
    block(rig, "none", plain, args.steps, keep_all)  # (the model's: fast keeping everything)
    block(rig, "checkpoint", rig.checkpointed, args.steps, recompute_all)  # (fast recomputing every layer)
    for name, action, fraction, window, prefetch in VARIANTS:
        decisions = [GroupDecision(action, fraction)] * layers
        model = costmodel.simulate(profile, decisions, window, prefetch)
        handle = rig.forced(decisions, window, prefetch)
        try:
            block(rig, name, plain, args.steps, model)
        finally:
            handle.remove()
    block(rig, "none (again)", plain, args.steps, None)


if __name__ == "__main__":
    main()
