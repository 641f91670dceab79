"""What keeping only the fused attention's outputs buys over checkpointing each layer (a
diagnostic, not a test): on transformers' SDPA Llamas of the sweep, steps of no offloading,
of ``torch.utils.checkpoint`` around each layer, of torch's selective checkpointing keeping
the matmuls' and the attention's outputs (``sac``, as the sweep runs it), and keeping the
attention's outputs only (``attention``: :func:`actoffload.selective.attention_policy`). For
each, the peaks allocated and reserved over three steps on a cache given back first, the
median step time in alternating rounds, and whether its gradients equal no offloading's (with
deterministic algorithms; no offloading runs twice, to show that it repeats itself).

At long sequences the attention's forward is a layer's costliest op while its outputs take
about what the layer's input does: a plan that keeps them would recompute the rest for a
fraction of checkpointing's cost, at nearly checkpointing's memory. This measures how much.

    PYTHONPATH=.:benchmarks python benchmarks/attention_kept_probe.py --out probe.json     # CUDA: hf_8b_32k, hf_llama_sdpa
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
from typing import Any

import torch

from actoffload.tools.budget_sweep import _checkpointed
from actoffload.tools.determinism import use_deterministic
from actoffload.tools.provenance import describe, results_json
from actoffload.tools.sweep_models import hf_llama, plain

# none twice: where its two runs differ, the attention's backward is not deterministic here and
# no method's gradients can be compared bit for bit
METHODS = ("none", "none_again", "checkpoint", "sac", "attention")


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


def probe(name: str, device: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    """One workload: each method's peaks, median step ms and gradient fingerprint."""
    w = hf_llama(name, device, small=device.type == "cpu")
    n = len(w.blocks)
    calls = {m: _call(m, n) for m in METHODS}
    out: dict[str, Any] = {"workload": name, "info": w.info, "methods": {}}
    for m in METHODS:
        _clear(w)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        _step(w, calls[m], 0, device)  # step 0: the gradients compared
        fp = _fingerprint(w)
        for i in (1, 2):
            _clear(w)
            _step(w, calls[m], i, device)
        _clear(w)
        peaks = ((torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
                 if device.type == "cuda" else (None, None))
        out["methods"][m] = {"allocated_peak_bytes": peaks[0], "reserved_peak_bytes": peaks[1], "grad_fingerprint": fp,
                             "steps_ms": []}
    for r in range(rounds):  # alternating rounds: a drift of the machine touches every method alike
        for m in METHODS:
            for i in range(steps):
                out["methods"][m]["steps_ms"].append(_step(w, calls[m], i, device))
                _clear(w)
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
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)
    use_deterministic(True)  # before the first matmul
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attention_kept_probe: no CUDA device here; --device cpu runs the tiny models", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"env": describe(device), "rounds": a.rounds, "steps": a.steps, "workloads": []}
    print(f"attention_kept_probe on {doc['env']['gpu']}, torch {torch.__version__}")
    for name in a.workloads.split(","):
        r = probe(name, device, a.rounds, a.steps)
        doc["workloads"].append(r)
        for m, x in r["methods"].items():
            gib = [f"{v / 2**30:6.2f}" if v is not None else "     -" for v in
                   (x["allocated_peak_bytes"], x["reserved_peak_bytes"])]
            print(f"{name:14} {m:11} {x['median_ms']:8.1f} ms  x checkpoint {x['x_checkpoint']:.3f}"
                  f"  GiB allocated {gib[0]} reserved {gib[1]}  grads == none: {x['grads_equal_none']}", flush=True)
    if a.out is not None:
        a.out.write_text(results_json(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
