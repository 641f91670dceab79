"""What keeping only the fused attention's outputs buys over checkpointing each layer (a
diagnostic, not a test): on transformers' SDPA Llamas of the sweep, steps of no offloading,
of ``torch.utils.checkpoint`` around each layer, of torch's selective checkpointing keeping
the matmuls' and the attention's outputs (``sac``, as the sweep runs it), and keeping the
attention's outputs only (``attention``: :func:`actoffload.selective.attention_policy`). With
``--fast``, also ``fast`` under a memory budget made to run one plan on every layer
(``BudgetController.force``): recomputing (``fast_recompute``), keeping the attention's outputs
(``fast_attention``), and moving them out with the inputs (``fast_attention_offload``, one copy
in flight and one reload ahead, as the search runs it). For each, the peaks allocated and
reserved over three steps on a cache given back first, the median step time (torch's methods
in alternating rounds, each fast plan in a block of its own: its wrapping is made once), and
whether its gradients equal no offloading's (with deterministic algorithms; no offloading runs
twice, to show that it repeats itself).

At long sequences the attention's forward is a layer's costliest op while its outputs take
about what the layer's input does: a plan that keeps them would recompute the rest for a
fraction of checkpointing's cost, at nearly checkpointing's memory. This measures how much.

    PYTHONPATH=.:benchmarks python benchmarks/attention_kept_probe.py --out probe.json     # CUDA: hf_8b_32k, hf_llama_sdpa
    PYTHONPATH=.:benchmarks python benchmarks/attention_kept_probe.py --workloads hf_8b_32k --fast
    PYTHONPATH=.:benchmarks python benchmarks/attention_kept_probe.py --workloads hf_8b_32k --rounds 2 \
        --fast-plans fast_selective,fast_selective_offload,fast_selective_offload_half   # others of FAST
    PYTHONPATH=.:benchmarks python benchmarks/attention_kept_probe.py --device cpu         # tiny models, a smoke run
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from forced_llama import ForcedLlama

from actoffload.budget.actions import Action, GroupDecision
from actoffload.tools.budget_sweep import _checkpointed
from actoffload.tools.determinism import use_deterministic
from actoffload.tools.provenance import describe, results_json
from actoffload.tools.sweep_models import plain

# none twice: where its two runs differ, the attention's backward is not deterministic here and
# no method's gradients can be compared bit for bit
METHODS = ("none", "none_again", "checkpoint", "sac", "attention")
# fast, made to run one decision on every layer, with this copy window; ``--fast`` runs the
# first three, ``--fast-plans`` names others
FAST = {"fast_recompute": (GroupDecision(Action.RECOMPUTE), 0, 0),
        "fast_attention": (GroupDecision(Action.RECOMPUTE_ATTENTION), 0, 0),
        "fast_attention_offload": (GroupDecision(Action.RECOMPUTE_ATTENTION_OFFLOAD), 1, 1),
        "fast_selective": (GroupDecision(Action.RECOMPUTE_SELECTIVE), 0, 0),
        # what selective recomputation keeps, all of it (or its largest half) moved to host memory
        "fast_selective_offload": (GroupDecision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0), 1, 1),
        "fast_selective_offload_w2": (GroupDecision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, 1.0), 2, 2),
        "fast_selective_offload_half": (GroupDecision(Action.RECOMPUTE_SELECTIVE_OFFLOAD, 0.5), 1, 1)}
DEFAULT_FAST = ("fast_recompute", "fast_attention", "fast_attention_offload")


def _call(method: str, layers: int) -> Any:
    kinds = {"checkpoint": "plain", "sac": "selective", "attention": "attention"}
    return plain if method.startswith("none") else _checkpointed(layers, kinds[method])


def _step(w: Any, call: Any, i: int, device: torch.device) -> float:
    """One training step's ms, its gradients left in place."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    w.loss(call, i).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _fingerprint(w: Any) -> str:
    h = hashlib.sha256()
    for q in w.trainable:
        if q.grad is not None:
            h.update(q.grad.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _clear(w: Any) -> None:
    for q in w.trainable:
        q.grad = None


def _measured(w: Any, call: Any, device: torch.device) -> dict[str, Any]:
    """Three steps on a cache given back first: the peaks, and step 0's gradients' fingerprint."""
    _clear(w)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    _step(w, call, 0, device)  # step 0: the gradients compared
    fp = _fingerprint(w)
    for i in (1, 2):
        _clear(w)
        _step(w, call, i, device)
    _clear(w)
    peaks = ((torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
             if device.type == "cuda" else (None, None))
    return {"allocated_peak_bytes": peaks[0], "reserved_peak_bytes": peaks[1], "grad_fingerprint": fp, "steps_ms": []}


def probe(name: str, device: torch.device, rounds: int, steps: int, fast: Sequence[str] = ()) -> dict[str, Any]:
    """One workload: each method's peaks, median step ms and gradient fingerprint (and those of
    the ``fast`` plans named, of :data:`FAST`)."""
    rig = ForcedLlama(device, name)
    w = rig.workload
    n = len(w.blocks)
    calls = {m: _call(m, n) for m in METHODS}
    out: dict[str, Any] = {"workload": name, "info": w.info, "methods": {}}
    for m in METHODS:
        out["methods"][m] = _measured(w, calls[m], device)
    for r in range(rounds):  # alternating rounds: a drift of the machine touches every method alike
        for m in METHODS:
            for i in range(steps):
                out["methods"][m]["steps_ms"].append(_step(w, calls[m], i, device))
                _clear(w)
    for m in fast:
        decision, max_inflight, prefetch = FAST[m]
        handle = rig.forced(decision, max_inflight, prefetch)  # (two steps in: its host memory pinned)
        out["methods"][m] = _measured(w, plain, device)
        for i in range(rounds * steps):
            out["methods"][m]["steps_ms"].append(_step(w, plain, i, device))
            _clear(w)
        out["methods"][m]["actions"] = [g["action"] for g in rig.offloader.stats()["plan"]["groups"]]
        handle.remove()
    none = out["methods"]["none"]
    for m, x in out["methods"].items():
        x["median_ms"] = statistics.median(x["steps_ms"])
        x["grads_equal_none"] = x["grad_fingerprint"] == none["grad_fingerprint"]
    ck = out["methods"]["checkpoint"]["median_ms"]
    for m, x in out["methods"].items():
        x["x_checkpoint"] = x["median_ms"] / ck
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny models)")
    p.add_argument("--workloads", default="hf_8b_32k,hf_llama_sdpa", help="comma-separated names of the sweep's SDPA Llamas")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps of each method per round")
    p.add_argument("--fast", action="store_true", help="also fast, made to run one plan on every layer")
    p.add_argument("--fast-plans", default=None, metavar="NAMES",
                   help=f"fast's plans, comma-separated, of {', '.join(FAST)} (implies --fast)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)
    use_deterministic(True)  # before the first matmul
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attention_kept_probe: no CUDA device here; --device cpu runs the tiny models", file=sys.stderr)
        return 2
    fast = tuple(a.fast_plans.split(",")) if a.fast_plans else DEFAULT_FAST if a.fast else ()
    unknown = [m for m in fast if m not in FAST]
    if unknown:
        print(f"attention_kept_probe: --fast-plans {', '.join(unknown)}: not one of {', '.join(FAST)}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"env": describe(device), "rounds": a.rounds, "steps": a.steps, "workloads": []}
    print(f"attention_kept_probe on {doc['env']['gpu']}, torch {torch.__version__}")
    for name in a.workloads.split(","):
        r = probe(name, device, a.rounds, a.steps, fast)
        doc["workloads"].append(r)
        for m, x in r["methods"].items():
            gib = [f"{v / 2**30:6.2f}" if v is not None else "     -" for v in
                   (x["allocated_peak_bytes"], x["reserved_peak_bytes"])]
            print(f"{name:14} {m:22} {x['median_ms']:8.1f} ms  x checkpoint {x['x_checkpoint']:.3f}"
                  f"  GiB allocated {gib[0]} reserved {gib[1]}  grads == none: {x['grads_equal_none']}", flush=True)
    if a.out is not None:
        a.out.write_text(results_json(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
