"""``actoffload bench``: fast against the bus, against no offload and against its peers.

    actoffload bench                          # on a GPU: the whole matrix (about 4 min on an H100)
    actoffload bench --quick                  # small sizes (CPU or GPU): checks that it runs
    actoffload bench --compare OLD.json       # then print the change of every figure

Writes ``<gpu>-<date>-<commit>.json`` into ``--out`` (default: benchmarks/results when run
from a checkout, else the current folder) and prints a summary. Every ratio is of figures
measured side by side in this one run on this one card; the pinned-copy bandwidth is
measured first and everything is compared with it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import actoffload as ao
from .determinism import use_deterministic
from .models import Block, GPTConfig
from .provenance import describe
from ..wrap import wrap
from .workloads import SaveMany, tiny_op_stack

# Training-step configurations, side by side: fast with its default and with one group in flight
STEP_MODES = ("none", "fast", "fast:inflight=1", "save_on_cpu", "ref")
MiB = 1 << 20
GiB = 1 << 30


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- bus bandwidth
def pinned_bandwidth(device, nbytes: int, reps: int) -> dict:
    """GB/s of one large pinned copy each way, and of both directions at once."""
    if device.type != "cuda":
        return {"d2h_gbps": float("nan"), "h2d_gbps": float("nan"), "both_gbps": float("nan"), "bytes": nbytes}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        out = []
        for _ in range(reps + 2):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
        return statistics.median(out[2:])

    def both():
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    bi = timed(both)
    return {"bytes": nbytes, "d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9, "both_gbps": 2 * nbytes / bi / 1e9}


# ---------------------------------------------------------------- copy throughput
def _log_uniform_sizes(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    sizes, acc = [], 0
    while acc < total:
        n = int(math.exp(math.log(lo) + torch.rand((), generator=gen).item() * (math.log(hi) - math.log(lo))))
        n = min(n // 16 * 16, total - acc) or 16
        sizes.append(n)
        acc += n
    return sizes


def copy_throughput(device, sizes: list[int], reps: int) -> dict:
    """Device-side GB/s of fast's offload and reload of one group, and of per-tensor copies."""
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in sizes]
    total = sum(sizes)
    out = {"tensors": len(sizes), "bytes": total}
    if device.type != "cuda":
        return out
    # per-tensor copies, as a hook-per-tensor offloader makes them
    hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    stream = torch.cuda.Stream()
    res = {"d2h": [], "h2d": []}
    for _ in range(reps + 1):
        for direction in ("d2h", "h2d"):
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                for t, h in zip(tensors, hosts):
                    (h.copy_(t, non_blocking=True) if direction == "d2h" else t.copy_(h, non_blocking=True))
                end.record()
            sync()
            res[direction].append(start.elapsed_time(end) / 1e3)
    out["per_tensor_d2h_gbps"] = total / statistics.median(res["d2h"][1:]) / 1e9
    out["per_tensor_h2d_gbps"] = total / statistics.median(res["h2d"][1:]) / 1e9
    del hosts

    off = ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=0, prefetch=0)
    x = torch.zeros(1, device=device, requires_grad=True)
    times = {"d2h": [], "h2d": []}
    wall = []
    for rep in range(reps + 1):
        off.copy_timings = []
        sync()
        t0 = time.perf_counter()
        with off.group("g"):
            y = SaveMany.apply(x, *tensors)
        off.synchronize()  # let the copy out finish, so backward really reloads (no reuse in place)
        y.sum().backward()
        sync()
        wall.append(time.perf_counter() - t0)
        if rep == 0:
            continue  # first use: pool allocation and kernel compilation
        for direction in ("d2h", "h2d"):
            spans = [(s, e) for d, n, s, e in off.copy_timings if d == direction]
            times[direction].append(sum(s.elapsed_time(e) for s, e in spans) / 1e3)
        del y
    out["fast_d2h_gbps"] = total / statistics.median(times["d2h"]) / 1e9
    out["fast_h2d_gbps"] = total / statistics.median(times["h2d"]) / 1e9
    out["fast_wall_s"] = statistics.median(wall[1:])
    out["fast_packed_spans"] = off.stats()["copies"].get("packed_spans", 0)
    return out


def copy_sweep(device, total: int, reps: int) -> list[dict]:
    """Per-tensor copy GB/s by tensor size (to choose the packing threshold)."""
    rows = []
    for size in [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        n = max(1, total // size)
        r = copy_throughput(device, [size] * n, reps)
        rows.append({"size": size, **{k: v for k, v in r.items() if "gbps" in k}})
    return rows


# ---------------------------------------------------------------- training steps
def make_stack(cfg: GPTConfig, device, dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layers)]).to(device=device, dtype=dtype)


def run_steps(stack, cfg, batch, mode: str, device, dtype, steps: int, warmup: int) -> dict:
    """Median forward+backward time, memory, bytes moved; ``mode``: none|fast|ref|save_on_cpu."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    x_cpu = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=gen).to(dtype)
    x = x_cpu.to(device)
    off = handle = None
    impl, _, inflight = mode.partition(":inflight=")
    if impl in ("fast", "ref"):
        off = ao.Offloader(impl=impl, device=device, keep_last=1)
        if inflight:
            off.max_inflight = int(inflight)  # a fast variant: more groups may copy out at once
        handle = wrap(stack, off)
    times, resident = [], 0
    gc.collect()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    try:
        for step in range(warmup + steps + 1):
            inp = x.clone().requires_grad_(True)
            sync()
            # the step's input exists before its forward: resident counts what forward adds
            step_base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            t0 = time.perf_counter()
            if mode == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    out = stack(inp)
            else:
                out = stack(inp)
            measure = step == warmup + steps  # last, untimed step: memory after forward
            if measure:
                sync()
                if off is not None and hasattr(off, "synchronize"):
                    off.synchronize()
                gc.collect()
                resident = (torch.cuda.memory_allocated() - step_base) if device.type == "cuda" else 0
            out.float().square().mean().backward()
            for p in stack.parameters():
                p.grad = None
            sync()
            if warmup <= step < warmup + steps:
                times.append(time.perf_counter() - t0)
            del out, inp
    finally:
        if handle is not None:
            handle.remove()
    res = {"step_ms": statistics.median(times) * 1e3, "step_ms_all": [t * 1e3 for t in times], "resident_bytes_after_forward": resident}
    if device.type == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    if off is not None:
        s = off.stats()
        res["offloaded_bytes"] = s["offloaded_bytes"]
        res["host_bytes_pooled"] = s["host_bytes_pooled"]
        if "copies" in s:
            res["copies"] = s["copies"]
            res["host_allocations"] = s["host_allocations"]
    return res


def grads_bitwise(cfg, batch, device, dtype, impls) -> dict:
    """Gradients with each impl vs none, eager attention, deterministic algorithms."""
    cfg = GPTConfig(**{**cfg.__dict__, "attention": "eager"})
    use_deterministic(True)
    try:
        stack = make_stack(cfg, device, dtype)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=gen).to(device=device, dtype=dtype)

        def grads(mode):
            off = handle = None
            if mode != "none":
                off = ao.Offloader(impl=mode, device=device, keep_last=1)
                handle = wrap(stack, off)
            inp = x.clone().requires_grad_(True)
            stack(inp).float().square().mean().backward()
            if handle:
                handle.remove()
            out = [inp.grad] + [p.grad for p in stack.parameters()]
            for p in stack.parameters():
                p.grad = None
            return out

        base = grads("none")
        result = {"none_vs_none": all(torch.equal(a, b) for a, b in zip(base, grads("none")))}
        for impl in impls:
            result[impl] = all(torch.equal(a, b) for a, b in zip(base, grads(impl)))
        return result
    finally:
        use_deterministic(False)


def step_benchmark(name, cfg, batch, device, dtype, steps, warmup, bw, modes) -> dict:
    stack = make_stack(cfg, device, dtype)
    out = {"config": {**cfg.__dict__, "batch": batch, "dtype": str(dtype)}}
    for mode in modes:
        print(f"  {name}: {mode} ...", flush=True, file=sys.stderr)
        out[mode] = run_steps(stack, cfg, batch, mode, device, dtype, steps, warmup)
        gc.collect()
    if device.type == "cuda" and "fast" in out:
        moved = out["fast"]["offloaded_bytes"]
        compute = out["none"]["step_ms"] / 1e3
        bus_both = 2 * moved / (bw["both_gbps"] * 1e9)  # out and back, both directions at once
        bus_serial = moved / (bw["d2h_gbps"] * 1e9) + moved / (bw["h2d_gbps"] * 1e9)
        out["bus_bound_ms"] = max(compute, bus_both) * 1e3
        out["bus_bound_serial_ms"] = max(compute, bus_serial) * 1e3
        out["fast_over_none"] = out["fast"]["step_ms"] / out["none"]["step_ms"]
        out["fast_over_bus_bound"] = out["fast"]["step_ms"] / out["bus_bound_ms"]
        if "save_on_cpu" in out:
            out["fast_over_save_on_cpu"] = out["fast"]["step_ms"] / out["save_on_cpu"]["step_ms"]
        out["resident_fraction"] = out["fast"]["resident_bytes_after_forward"] / out["none"]["resident_bytes_after_forward"]
        out["resident_target"] = 1 / cfg.n_layers + 0.02
    return out


# ---------------------------------------------------------------- hook overhead
def hook_overhead(device, n_ops: int, group_size: int, reps: int) -> dict:
    """Host microseconds per saved tensor (pack + unpack) on a stack of tiny ops."""
    x0 = torch.randn(256, device=device)

    def timed(off):
        out = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            tiny_op_stack(x0, off, n_ops, group_size)
            sync()
            out.append(time.perf_counter() - t0)
        return min(out[1:])  # host overhead: the least-disturbed repetition

    base = timed(None)
    res = {"ops": n_ops, "saved_tensors": n_ops, "none_s": base}
    for label, min_bytes in [("kept", 1 << 40), ("offloaded", 0)]:
        off = ao.Offloader(impl="fast", device=device, min_offload_bytes=min_bytes, keep_last=1)
        t = timed(off)
        res[f"fast_{label}_us_per_tensor"] = (t - base) / n_ops * 1e6
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes: check that it runs (always so on CPU)")
    p.add_argument("--out", default=None,
                   help="folder for the results JSON (default: benchmarks/results in a checkout, else .)")
    p.add_argument("--only", default="", help=f"comma list of sections: {','.join(SECTIONS)}")
    p.add_argument("--compare", metavar="OLD.json", help="print the change of every figure against this results file")


SECTIONS = ("bandwidth", "copies", "sweep", "steps", "bitwise", "hooks")


def run(args) -> int:
    sections = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = sections - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {sorted(unknown)}; valid ones are: {', '.join(SECTIONS)}")
    old = load_results(args.compare) if args.compare else None  # a bad file fails before the run
    res = measure(sections, args.quick)
    path = write_results(res, args.out)
    print(json.dumps(summary(res), indent=1))
    print(f"wrote {path}", file=sys.stderr)
    if old is not None:
        print(format_comparison(old, res, args.compare, str(path)))
    return 0


def measure(sections: set[str], quick: bool) -> dict:
    """Run the chosen sections of the matrix; returns the results dict."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = quick or device.type != "cuda"
    from actoffload.fast import FastOffloader

    res = {"env": describe(device), "quick": quick, "fast_pack_below": FastOffloader.pack_below}
    print(f"benchmarks on {res['env']['gpu']} (torch {res['env']['torch']}, triton {res['env']['triton']})", file=sys.stderr)
    res["pinned_bandwidth"] = bw = pinned_bandwidth(device, (16 if quick else 256) * MiB, 5 if quick else 20)
    if "copies" in sections:
        print("  copies ...", file=sys.stderr, flush=True)
        res["copy_1000x64KiB"] = copy_throughput(device, [64 << 10] * (50 if quick else 1000), 3 if quick else 10)
        mixed = _log_uniform_sizes((16 * MiB) if quick else GiB, 4 << 10, (1 if quick else 64) * MiB)
        res["copy_mixed_4KiB_64MiB"] = copy_throughput(device, mixed, 3 if quick else 10)
    if "sweep" in sections and not quick:
        print("  sweep ...", file=sys.stderr, flush=True)
        res["per_tensor_sweep"] = copy_sweep(device, 256 * MiB, 5)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if quick:
        stacks = {"small": (GPTConfig(d_model=64, n_heads=4, n_layers=3, seq_len=32), 2)}
    else:
        stacks = {
            "d2048": (GPTConfig(d_model=2048, n_heads=16, n_layers=8, seq_len=2048), 8),
            "d8192": (GPTConfig(d_model=8192, n_heads=64, n_layers=2, seq_len=4096), 2),
        }
    if "steps" in sections:
        for name, (cfg, batch) in stacks.items():
            res[f"step_{name}"] = step_benchmark(
                name, cfg, batch, device, dtype, steps=3 if quick else 6, warmup=1 if quick else 2, bw=bw,
                modes=STEP_MODES,
            )
    if "bitwise" in sections:
        for name, (cfg, batch) in stacks.items():
            print(f"  bitwise {name} ...", file=sys.stderr, flush=True)
            res.setdefault(f"step_{name}", {})["grads_bitwise_equal"] = grads_bitwise(cfg, batch, device, dtype, ["fast", "ref"])
    if "hooks" in sections:
        print("  hooks ...", file=sys.stderr, flush=True)
        res["hook_overhead"] = hook_overhead(device, 400 if quick else 4000, 100, 3 if quick else 10)
    return res


def write_results(res: dict, out: str | None) -> Path:
    """``<gpu>-<date>[-<commit>][-quick].json`` in ``out``."""
    if out is None:
        checkout = Path("benchmarks/results")
        out = str(checkout) if checkout.is_dir() else "."
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = res["env"]
    parts = [env["gpu"].replace(" ", "-").replace("/", "-"), env["date"][:10]]
    parts += [env["commit"]] if env.get("commit") else []
    parts += ["quick"] if res.get("quick") else []
    path = out_dir / ("-".join(parts) + ".json")
    path.write_text(json.dumps(res, indent=1, default=float))
    return path


# ---------------------------------------------------------------- comparing runs
def load_results(path: str) -> dict:
    """A results JSON written by ``actoffload bench``; a clear error for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise SystemExit(f"--compare: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--compare: {path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or "env" not in data:
        raise SystemExit(f"--compare: {path} is not a results file of 'actoffload bench' (no 'env' key)")
    return data


def figures(res: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a results dict under a dotted name (lists, strings and flags left out)."""
    out = {}
    for k, v in res.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            if k != "env":
                out.update(figures(v, name + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


def format_comparison(old: dict, new: dict, old_name: str = "old", new_name: str = "new") -> str:
    """One line per figure both runs have: old, new and the change in percent."""
    a, b = figures(old), figures(new)
    common = [k for k in b if k in a]
    head = (f"change from {old_name} ({old['env'].get('gpu')}, {old['env'].get('date', '')[:10]}) "
            f"to {new_name} ({new['env'].get('gpu')}, {new['env'].get('date', '')[:10]})")
    if old["env"].get("gpu") != new["env"].get("gpu"):
        head += "\nnote: different devices; ratios within each run compare, absolute figures do not"
    rows = [("figure", "old", "new", "change")]
    for k in common:
        change = "" if a[k] == 0 else f"{(b[k] - a[k]) / abs(a[k]) * 100:+.1f}%"
        rows.append((k, f"{a[k]:.4g}", f"{b[k]:.4g}", change))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows]
    only = sorted(set(a) ^ set(b))
    if only:
        lines.append(f"({len(only)} figure(s) in one run only, e.g. {', '.join(only[:3])})")
    return "\n".join(lines)


def summary(res: dict) -> dict:
    """The figures the fast-path issue sets targets on."""
    out = {"gpu": res["env"]["gpu"], "pinned": res.get("pinned_bandwidth")}
    for k in ("copy_1000x64KiB", "copy_mixed_4KiB_64MiB"):
        if k in res and "fast_d2h_gbps" in res[k]:
            bw = res["pinned_bandwidth"]
            out[k] = {
                "fast_d2h_vs_pinned": res[k]["fast_d2h_gbps"] / bw["d2h_gbps"],
                "fast_h2d_vs_pinned": res[k]["fast_h2d_gbps"] / bw["h2d_gbps"],
                "per_tensor_d2h_vs_pinned": res[k]["per_tensor_d2h_gbps"] / bw["d2h_gbps"],
            }
    for k, v in res.items():
        if k.startswith("step_") and isinstance(v, dict):
            out[k] = {m: round(v[m]["step_ms"], 1) for m in STEP_MODES if m in v}
            out[k]["peak_GiB"] = {m: round(v[m].get("peak_bytes", 0) / GiB, 2) for m in STEP_MODES if m in v}
            for r in ("fast_over_none", "fast_over_bus_bound", "fast_over_save_on_cpu", "resident_fraction", "resident_target", "bus_bound_ms", "grads_bitwise_equal"):
                if r in v:
                    out[k][r] = v[r]
    if "hook_overhead" in res:
        out["hook_overhead"] = res["hook_overhead"]
    return out
