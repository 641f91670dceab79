"""``memory_budget="auto"`` as a user meets it: one line, on a model that fits and on one that
does not.

The Llama-style decoder of the budget sweep (d2048, 8 layers, GQA 16/4, 2048 tokens a
sequence, bf16), its blocks wrapped whole with ``ao.wrap(model.blocks, ao.Offloader(
memory_budget="auto"))``, in two runs on one card:

- **fits**: 4 sequences a step, no offloading beside ``"auto"`` on the same data. What
  ``"auto"`` costs where nothing needs to move: its step time against no offloading's
  (median of the steps after its plan settled), and its gradients against no offloading's,
  bit for bit, every step.
- **does not fit**: as many sequences as make no offloading's predicted peak 1.15 times the
  card's memory (from the first run's peak and base). No offloading is run for one step to
  show that it runs out of memory (the batch grows until it does, twice at most); then
  ``"auto"`` trains ``--steps`` steps at that batch. Per step: time, peak allocated and
  reserved memory (read across the budget's own resets, :class:`~.peaks.Peaks`), loss; at the
  end ``stats()["plan"]``.

Nothing is asserted: the JSON says whether no offloading ran out, whether ``"auto"`` trained
every step with finite losses and within its budget, and the time ratio. On the CPU
(``--small``, tiny model) the runs go through every path but nothing runs out of memory.

Example::

    python -m actoffload.tools.auto_check --out auto.json         # a GPU
    python -m actoffload.tools.auto_check --small --steps 6       # the CPU
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from typing import Any, Callable

import torch

import actoffload as ao
from actoffload.budget import BudgetTooSmall
from .models import Llama, LlamaConfig, next_token_loss
from .peaks import Peaks
from .workloads import sync

OOM_FACTOR = 1.15  # no offloading's predicted peak on the run that must not fit, against the card's memory
FITTING_BATCH = 4


def _config(small: bool) -> LlamaConfig:
    if small:
        return LlamaConfig(seq_len=32, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn=172)
    return LlamaConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_kv_heads=4, n_layers=8, ffn=5632)


def _model(cfg: LlamaConfig, device: torch.device) -> Llama:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Llama(cfg).to(device=device, dtype=dtype)


def _batch(cfg: LlamaConfig, n: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 + step)
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_steps(model: Llama, cfg: LlamaConfig, n: int, steps: int, device: torch.device,
              off: ao.Offloader | None, keep_grads: bool = False) -> dict[str, Any]:
    """``steps`` steps (forward, backward, SGD) of ``n`` sequences; with ``off``, its blocks
    wrapped for the whole run. Per step: seconds, peaks, loss (and the gradients, kept on the
    host, with ``keep_grads``); the plan at the end."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    out: dict[str, Any] = {"sequences": n, "steps_s": [], "allocated_bytes": [], "reserved_bytes": [], "losses": [],
                           "settled_at": None}
    grads: list[list[torch.Tensor]] = []
    handle = ao.wrap(model.blocks, off) if off is not None else None
    try:
        with Peaks(device) as peaks:
            for i in range(steps):
                x, y = _batch(cfg, n, i, device)
                sync(device)
                peaks.start()
                t0 = time.perf_counter()
                loss = next_token_loss(model(x).float(), y)
                loss.backward()
                sync(device)
                out["steps_s"].append(time.perf_counter() - t0)
                reserved, allocated = peaks.read()
                out["reserved_bytes"].append(reserved)
                out["allocated_bytes"].append(allocated)
                out["losses"].append(float(loss.detach()))
                if keep_grads:
                    grads.append([p.grad.detach().to("cpu", copy=True) for p in model.parameters()])
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss, x, y
                if off is not None and out["settled_at"] is None and off.stats()["plan"].get("settled"):
                    out["settled_at"] = i + 1
    finally:
        if handle is not None:
            handle.remove()
    if off is not None:
        plan = off.stats()["plan"]
        out["plan"] = {k: v for k, v in plan.items() if k not in ("groups", "profile", "tried")}
        out["plan"]["actions"] = [g["action"] for g in plan.get("groups", [])]
    if keep_grads:
        out["grads"] = grads
    return out


def _runs_out(fn: Callable[[], Any]) -> str | None:
    """The out-of-memory error (or the budget's own, :class:`BudgetTooSmall`) ``fn`` raised,
    else ``None``."""
    try:
        fn()
    except (torch.OutOfMemoryError, BudgetTooSmall) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def _steady(run: dict[str, Any]) -> float:
    """Median seconds of the steps after the plan settled (or the second half, if it never did)."""
    s = run["steps_s"]
    start = run.get("settled_at") or len(s) // 2
    return statistics.median(s[start:] or s[-1:])


def check(device: torch.device, small: bool, steps: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Both runs; see the module docstring."""
    cfg = _config(small)
    res: dict[str, Any] = {"config": {"d_model": cfg.d_model, "layers": cfg.n_layers, "seq_len": cfg.seq_len}}
    # fits: no offloading against "auto", the same steps and data
    model = _model(cfg, device)
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    none = run_steps(model, cfg, FITTING_BATCH, steps, device, None, keep_grads=True)
    model.load_state_dict(initial)
    _free(device)
    auto = run_steps(model, cfg, FITTING_BATCH, steps, device, ao.Offloader(memory_budget="auto"), keep_grads=True)
    bitwise = all(all(torch.equal(a, b) for a, b in zip(ga, gb)) for ga, gb in zip(none.pop("grads"), auto.pop("grads")))
    res["fits"] = {"none": none, "auto": auto, "bitwise": bitwise,
                   "auto_vs_none": _steady(auto) / _steady(none)}
    log(f"fits ({FITTING_BATCH} sequences): none {_steady(none) * 1e3:.1f} ms, auto {_steady(auto) * 1e3:.1f} ms "
        f"({res['fits']['auto_vs_none']:.3f}x), bitwise {bitwise}, auto's plan {auto['plan'].get('state')}")
    del model, initial
    _free(device)
    if device.type != "cuda":
        res["does_not_fit"] = {"skipped": "the CPU has no device memory to run out of"}
        return res
    # does not fit: a batch whose no-offloading peak is predicted OOM_FACTOR times the card's memory
    total = torch.cuda.mem_get_info(device)[1]
    per_sequence = max(1, (max(none["allocated_bytes"]) - base) // FITTING_BATCH)
    n = math.ceil((OOM_FACTOR * total - base) / per_sequence)
    model = _model(cfg, device)
    oom = None
    for tries in range(3):
        if tries:
            n *= 2  # no offloading fitted after all: a larger batch
        oom = _runs_out(lambda: run_steps(model, cfg, n, 1, device, None))
        model.zero_grad(set_to_none=True)
        _free(device)
        if oom is not None:
            break
    log(f"does not fit ({n} sequences): no offloading {'ran out of memory' if oom else 'did NOT run out of memory'}")
    off = ao.Offloader(memory_budget="auto")
    failed = _runs_out(lambda: res.setdefault("auto_run", run_steps(model, cfg, n, steps, device, off)))
    run = res.pop("auto_run", None)
    budget = off.stats()["plan"].get("memory_budget")
    trained = run is not None and failed is None and all(math.isfinite(v) for v in run["losses"])
    within = (run is not None and budget is not None
              and all(p is not None and p <= budget for p in run["reserved_bytes"]))
    res["does_not_fit"] = {"sequences": n, "device_bytes": total, "none_out_of_memory": oom, "auto": run,
                           "auto_out_of_memory": failed, "trained": trained, "within_budget_every_step": within,
                           "memory_budget": budget}
    log(f"  auto: {'trained' if trained else 'FAILED: ' + str(failed)}, budget {budget}, "
        f"within it every step {within}, plan {(run or {}).get('plan', {}).get('actions')}")
    return res


def main(argv: list[str] | None = None) -> int:
    from .determinism import use_deterministic
    from .provenance import describe, results_json

    from .arguments import UsageError, out_file

    p = argparse.ArgumentParser(prog="python -m actoffload.tools.auto_check",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", help="results JSON")
    p.add_argument("--small", action="store_true", help="a tiny model (the CPU always uses it)")
    p.add_argument("--steps", type=int, default=16, help="steps of each run (profiling and settling included)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be at least 1")
    if args.out:
        try:
            out_file("--out", args.out)
        except UsageError as e:
            p.error(str(e))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_deterministic(True)
    res = {"env": describe(device), **check(device, args.small or device.type != "cuda", args.steps)}
    if args.out:
        with open(args.out, "w") as f:
            f.write(results_json(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
