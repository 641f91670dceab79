"""What recomputing each part of the GPT-MoE's blocks costs a step, measured, against what
the budget planner's profile says (a diagnostic, not a test; CUDA).

Each plan names, per block part (Q/K/V projection, attention core, MoE), what a step does:
``K`` keep, ``R`` recompute the part, ``rii`` recompute the whole block. Every plan runs
twice: with ``torch.utils.checkpoint`` on those parts ("plain"), and under a fast
offloader with a memory budget whose controller is made to run that plan ("off": the
script replaces private methods of ``BudgetController`` for the whole process, to force
the plan and read the host's clock; a diagnostic, not an API). After a warm-up, all of them run in
interleaved rounds, so that the host's drift hits each alike; the medians and each plan's
ratio to plain checkpointing of two blocks go to the JSON, with the host's time for each
group's forward and recomputation while the offloader profiled.

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
import time

import torch
import torch.utils.checkpoint as cp

import actoffload as ao
from actoffload.budget import controller as C
from actoffload.budget.planner import GroupPlan, Plan, simulate
from actoffload.tools import budget_sweep as bs
from actoffload.tools.provenance import describe

CODES = {"keep": "K", "recompute": "R", "offload": "O", "recompute_offload": "Q", "recompute_whole": "r",
         "recompute_whole_offload": "q", "inside": "i"}
ACTIONS = {v: k for k, v in CODES.items()}
PLANS = {"keep": "K" * 24, "ckpt2": "riirii" + "K" * 18, "ckpt5": "rii" * 5 + "K" * 9,
         "chosen": "RKKRKKRRKRRKRKKRRKRRKRKK",  # what the device-time model chose at 7.86 GiB
         "qkv8": "RKK" * 8, "core8": "KRK" * 8, "mlp8": "KKR" * 8, "core4": "KRK" * 4 + "K" * 12,
         "qkv4": "RKK" * 4 + "K" * 12}
WARMUP, ROUNDS = 6, 25


def code(groups) -> str:
    return "".join(CODES[g.action] for g in groups)


FORCED: dict[int, str] = {}  # controller -> the plan it must run
HOST: dict[int, dict] = {}  # controller -> host times while profiling


def _patch_controller() -> None:
    fastest, begins, ends = C.BudgetController._fastest, C.BudgetController.recompute_begins, C.BudgetController.recompute_ends
    action, closing = C.BudgetController.action, C.BudgetController.group_closing

    def forced(self, fitting):
        want = FORCED.get(id(self))
        if want is None:
            return fastest(self, fitting)
        for p in self.plans:
            if code(p.groups) == want and (p.max_inflight, p.prefetch) == (0, 0):
                return p
        groups = tuple(GroupPlan(ACTIONS[ch]) for ch in want)
        p = Plan(groups, 0, 0, *simulate(self.profile, groups, 0, 0))
        self.plans.append(p)
        return p

    def host(self, kind, pos, start):
        if self._profiling is None:
            return
        d = HOST.setdefault(id(self), {})
        if start:
            d[("start", kind, pos)] = time.perf_counter()
        else:
            d.setdefault((kind, pos), []).append(time.perf_counter() - d[("start", kind, pos)])

    def on_begins(self, pos):
        host(self, "rec", pos, True)
        return begins(self, pos)

    def on_ends(self, pos):
        host(self, "rec", pos, False)
        return ends(self, pos)

    def on_action(self, recomputable, parts=0):
        host(self, "fwd", self._position, True)
        return action(self, recomputable, parts)

    def on_closing(self, pos):
        host(self, "fwd", pos, False)
        return closing(self, pos)

    C.BudgetController._fastest = forced
    C.BudgetController.recompute_begins, C.BudgetController.recompute_ends = on_begins, on_ends
    C.BudgetController.action, C.BudgetController.group_closing = on_action, on_closing


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
    _patch_controller()
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
        FORCED[id(r.off._budget)] = pattern
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
            line += f"  model {s['predicted_step_s'] * 1e3:.1f}  {code([GroupPlan(g['action']) for g in s['groups']])}"
        print(line, flush=True)
    host = HOST[id(runners["off_keep"].off._budget)]
    doc["host"] = {f"{k[0]}{k[1]}": v for k, v in host.items() if k[0] in ("fwd", "rec")}
    with open(out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage (on a CUDA machine): python benchmarks/recompute_costs.py OUT.json")
    main(sys.argv[1])
