"""``actoffload demo``: train a small GPT without and with offloading, side by side.

Every configuration trains the same model from the same seed on the same batches;
the table says whether each loss matched the run without an offloader bit for bit,
how many bytes moved per step, what stayed resident after forward and, on CUDA, peak
GPU memory and step time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from . import factory
from .memory import SavedTracker
from .models import GPT, GPTConfig
from .ops import select_modules
from .wrap import wrap

CPU_DEFAULTS = dict(d_model=128, n_layers=4, n_heads=4, seq_len=64, batch=8, vocab=512, steps=3)
CUDA_DEFAULTS = dict(d_model=1024, n_layers=8, n_heads=16, seq_len=1024, batch=8, vocab=8192, steps=6)


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    loss_bits: list[torch.Tensor] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    offloaded_bytes: int = 0
    offloaded_by_role: dict = field(default_factory=dict)
    resident_bytes: int = 0
    peak_bytes: int = 0
    error: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(name: str, impl: str | None, cfg: GPTConfig, args, device: torch.device, dtype) -> RunResult:
    """Train ``args.steps`` steps; ``impl=None`` runs without an offloader."""
    res = RunResult(name)
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen) for _ in range(args.steps)]
    off = None
    handle = None
    if impl is not None:
        off = factory.Offloader(impl=impl, device=device, keep_last=args.keep_last,
                                min_offload_bytes=args.min_offload_bytes, policy=args.policy)
        handle = wrap(model.blocks, off)
    select_modules(model, args.roles)
    params = list(model.parameters())
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for step, batch in enumerate(batches):
            batch = batch.to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            _sync(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            t0 = time.perf_counter()
            measure = step == len(batches) - 1  # measure residency once, outside the timed steps
            with SavedTracker(off, exclude=params) if measure else contextlib.nullcontext() as tracker:
                loss = model.loss(x, y)
            if measure:
                _sync(device)
                if off is not None and hasattr(off, "synchronize"):
                    off.synchronize()  # in-flight copies still hold their sources
                res.resident_bytes = (
                    torch.cuda.memory_allocated(device) - before if device.type == "cuda" else tracker.resident_bytes()
                )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if not measure:
                res.step_s.append(time.perf_counter() - t0)
            res.losses.append(loss.item())
            res.loss_bits.append(loss.detach().cpu())
            if off is not None:
                stats = off.stats()
                res.offloaded_bytes = stats["offloaded_bytes"]
                res.offloaded_by_role = {}
                for g in stats["groups"].values():
                    for role, n in g.get("offloaded_bytes_by_role", {}).items():
                        res.offloaded_by_role[role] = res.offloaded_by_role.get(role, 0) + n
            del loss
        if device.type == "cuda":
            res.peak_bytes = torch.cuda.max_memory_allocated(device)
    finally:
        if handle is not None:
            handle.remove()
    return res


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def format_table(results: list[RunResult], device: torch.device) -> str:
    base = results[0]
    head = ["config", "loss == none (bitwise)", "offloaded MB/step", "resident act. MB after fwd"]
    by_role = any(r.offloaded_by_role for r in results)
    if by_role:
        head.append("offloaded MB/step by role")
    if device.type == "cuda":
        head += ["peak GPU MB", "step ms (median)", "x none"]
    rows = [head]
    base_ms = statistics.median(base.step_s) * 1e3 if base.step_s else float("nan")
    for r in results:
        same = all(torch.equal(a, b) for a, b in zip(r.loss_bits, base.loss_bits))
        row = [r.name, "yes" if same else "NO", _mb(r.offloaded_bytes), _mb(r.resident_bytes)]
        if by_role:
            row.append(", ".join(f"{k} {_mb(v)}" for k, v in sorted(r.offloaded_by_role.items())) or "-")
        if device.type == "cuda":
            ms = statistics.median(r.step_s) * 1e3 if r.step_s else float("nan")
            row += [_mb(r.peak_bytes), f"{ms:.1f}", f"{ms / base_ms:.2f}"]
        rows.append(row)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--impl", default=None, help="comma-separated implementations to compare (default: all built)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--keep-last", type=int, default=1)
    p.add_argument("--experts", type=int, default=0, help="> 0: a GPT-MoE with this many experts per block")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    p.add_argument("--offload-modules", default="", help="comma-separated roles to offload, e.g. moe_act,expert_fc1")
    p.add_argument("--policy", default="all", choices=["all", "marked"],
                   help="'marked' with --offload-modules offloads exactly those roles")
    p.add_argument("--min-offload-bytes", type=int, default=1 << 20)


def run(args) -> int:
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    pick = lambda name, key=None: getattr(args, name) if getattr(args, name) is not None else defaults[key or name]  # noqa: E731
    args.steps = max(2, pick("steps"))
    args.batch = pick("batch")
    cfg = GPTConfig(
        vocab_size=defaults["vocab"],
        seq_len=pick("seq_len"),
        d_model=pick("d_model"),
        n_heads=defaults["n_heads"],
        n_layers=pick("layers", "n_layers"),
        attention="eager",  # deterministic everywhere, so losses can be compared bit for bit
        n_experts=args.experts,
        top_k=args.top_k,
    )
    args.roles = {r for r in args.offload_modules.split(",") if r}
    if args.roles:
        from .ops import ROLES

        unknown = args.roles - set(ROLES)
        if unknown:
            raise SystemExit(f"--offload-modules: unknown role(s) {sorted(unknown)}; valid roles are: {', '.join(ROLES)}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.use_deterministic_algorithms(True)
    impls = args.impl.split(",") if args.impl else list(factory.IMPLS)
    for impl in impls:
        factory.resolve_impl(impl)  # a clear error for an unknown name
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (host memory stands in for GPU memory; small configuration)"
    print(
        f"actoffload demo on {where}: GPT d={cfg.d_model} layers={cfg.n_layers} seq={cfg.seq_len} "
        f"batch={args.batch} {str(dtype).replace('torch.', '')}, {args.steps} steps, keep_last={args.keep_last}"
        + (f", {cfg.n_experts} experts top-{cfg.top_k}" if cfg.n_experts else "")
        + (f", offload roles {sorted(args.roles)} (policy {args.policy})" if args.roles else ""),
        flush=True,
    )
    configs = [("none", None), ("none (again)", None)] + [(impl, impl) for impl in impls]
    results = []
    for i, (name, impl) in enumerate(configs):
        print(f"  [{i + 1}/{len(configs)}] {name} ...", end="", flush=True, file=sys.stderr)
        results.append(train(name, impl, cfg, args, device, dtype))
        print(" done", file=sys.stderr, flush=True)
    print(format_table(results, device))
    if device.type != "cuda":
        print("(CPU run: 'resident' counts saved storages still alive after forward; no GPU memory or timing.)")
    return 0
