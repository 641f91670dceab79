"""What recomputing each part of the GPT-MoE's blocks costs a step, measured, against what
the budget planner's profile says (a diagnostic, not a test; CUDA).

Each plan names, per block part (Q/K/V projection, attention core, MoE), what a step does:
``K`` keep, ``R`` recompute the part, ``rii`` recompute the whole block. Every plan runs
twice: with ``torch.utils.checkpoint`` on those parts ("plain"), and under a fast
offloader with a memory budget whose controller is made to run that plan once profiled
("off": ``BudgetController.force``). After a warm-up, all of them run in interleaved
rounds, so that the host's drift hits each alike; the medians and each plan's ratio to
plain checkpointing of two blocks go to the JSON, with the host's time for each group's
forward and recomputation in each profiling step (``BudgetController.profiling_steps``).

    PYTHONPATH=. CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/recompute_costs.py OUT.json

On an H200 (commit 8e2c441, ``benchmarks/results/*-recompute-costs.json``; the workload
then trained 8 sequences, the sweep's MoE now trains 16): recomputing
the eight Q/K/V parts (0.016 ms of device time each) added 8.4 ms to the step, the eight
attention cores (0.82 ms each) 15.7 ms, the eight MoE parts (1.75 ms each) 35.9 ms: each
at about the host's time for its forward, because the step waits on the host.
"""

import gc
import json
import statistics
import sys

import torch
import torch.utils.checkpoint as cp

import actoffload as ao
from actoffload.budget.actions import Action, GroupDecision
from actoffload.budget.controller import BudgetController
from actoffload.tools import budget_sweep as bs
from actoffload.tools.provenance import describe

CODES = {Action.KEEP: "K", Action.RECOMPUTE: "R", Action.OFFLOAD: "O", Action.RECOMPUTE_OFFLOAD: "Q",
         Action.RECOMPUTE_WHOLE: "r", Action.RECOMPUTE_WHOLE_OFFLOAD: "q", Action.INSIDE: "i"}
ACTIONS = {v: k for k, v in CODES.items()}
PLANS = {"keep": "K" * 24, "ckpt2": "riirii" + "K" * 18, "ckpt5": "rii" * 5 + "K" * 9,
         "chosen": "RKKRKKRRKRRKRKKRRKRRKRKK",  # what the device-time model chose at 7.86 GiB
         "qkv8": "RKK" * 8, "core8": "KRK" * 8, "mlp8": "KKR" * 8, "core4": "KRK" * 4 + "K" * 12,
         "qkv4": "RKK" * 4 + "K" * 12}
WARMUP, ROUNDS = 6, 25


def code(actions) -> str:
    return "".join(CODES[Action(a)] for a in actions)


def _controller(off: ao.Offloader) -> BudgetController:
    """The budget controller of a fast offloader made with a ``memory_budget``."""
    return off.plan.controller


def _checkpointing(pattern: str):
    """A block call checkpointing the parts (or the whole block) ``pattern`` recomputes."""
    def call(i, b, h):
        c = pattern[3 * i:3 * i + 3]
        if c[0] == "r":
            return cp.checkpoint(b, h, use_reentrant=False)

        def part(module, recomputed):
            return (lambda *a: cp.checkpoint(module, *a, use_reentrant=False)) if recomputed else module

        mid = h + part(b.attn.core, c[1] == "R")(*part(b.attn.project, c[0] == "R")(h))
        return mid + part(b.mlp, c[2] == "R")(mid)
    return call


def main(out: str, dev: torch.device = torch.device("cuda"), small: bool = False) -> None:
    w = bs._gpt_moe(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, small=small)
    gc.freeze()
    runners = {}
    for name, pattern in PLANS.items():
        r = bs._Runner(w, bs.Method("plain_" + name), dev)
        r._call = _checkpointing(pattern)
        runners["plain_" + name] = r
    for name, pattern in PLANS.items():
        r = bs._Runner(w, bs.Method("off_" + name, parts=True, offloader=lambda: ao.Offloader(
            impl="fast", device=dev, memory_budget=1 << 50)), dev)
        _controller(r.off).force([GroupDecision(ACTIONS[ch]) for ch in pattern])
        runners["off_" + name] = r
    step = 0
    for r in runners.values():
        for _ in range(WARMUP):
            r.step(step)
            step += 1
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(ROUNDS):
        for name, r in runners.items():
            times[name].append(r.step(step)[0] * 1e3)
            step += 1
    base = times["plain_ckpt2"]
    doc: dict = {"env": describe(dev)}
    for name, t in times.items():
        doc[name] = {"median_ms": statistics.median(t), "vs_plain_ckpt2": statistics.median(a / b for a, b in zip(t, base)),
                     "steps": t}
        line = f"{name:16s} {statistics.median(t):7.1f} ms  x{doc[name]['vs_plain_ckpt2']:.3f} vs plain ckpt2"
        if runners[name].off is not None:
            s = runners[name].off.stats()["plan"]
            doc[name]["plan"] = {k: v for k, v in s.items() if k != "groups"}
            line += f"  model {s['predicted_step_s'] * 1e3:.1f}  {code(g['action'] for g in s['groups'])}"
        print(line, flush=True)
    steps = _controller(runners["off_keep"].off).profiling_steps  # the host's seconds, one per profiling step
    n = len(steps[0].groups) if steps else 0
    doc["host"] = {**{f"fwd{i}": [s.groups[i].host_s for s in steps] for i in range(n)},
                   **{f"rec{i}": [s.groups[i].recompute_host_s for s in steps] for i in range(n)}}
    with open(out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage (on a CUDA machine): python benchmarks/recompute_costs.py OUT.json")
    main(sys.argv[1])
