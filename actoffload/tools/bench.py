"""``actoffload bench``: fast against the bus, against no offload and against its peers.

The command's usage is in ``actoffload bench --help``. This module holds the timing
loops and the results file; what is timed (a group's round trip, a training step in one
mode, the tiny-op stack) lives in :mod:`actoffload.tools.workloads`, shared with the
pytest-benchmark suites in benchmarks/.
"""

from __future__ import annotations

import datetime as dt
import gc
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .arguments import BenchOptions
from .determinism import set_cublas_workspace, use_deterministic
from .models import GPTConfig
from .provenance import describe, no_nan, results_json
from .workloads import (HOOK_MODES, STEP_MODES, CopyTimer, TrainingStep, copy_per_tensor, group_offloader,
                        group_round_trip, hook_offloader, make_stack, random_bytes, sync, tiny_op_stack)

MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------- bus bandwidth
def pinned_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of one large pinned copy each way, and of both directions at once (NaN on the CPU).

    Example::

        pinned_bandwidth(torch.device("cuda"), 256 << 20, 5)["d2h_gbps"]
    """
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


def _per_tensor_gbps(tensors: list[torch.Tensor], reps: int) -> dict[str, float]:
    """Device-side GB/s of one copy per tensor, each way (CUDA events on a side stream)."""
    total = sum(t.numel() for t in tensors)
    hosts = [torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True) for t in tensors]
    stream = torch.cuda.Stream()
    times: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(reps + 1):
        for direction in times:
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                copy_per_tensor(tensors, hosts, direction)
                end.record()
            sync()
            times[direction].append(start.elapsed_time(end) / 1e3)
    return {f"per_tensor_{d}_gbps": total / statistics.median(t[1:]) / 1e9 for d, t in times.items()}


def copy_throughput(device: torch.device, sizes: list[int], reps: int) -> dict[str, Any]:
    """One group of tensors of these sizes: fast's round trip (wall time; on CUDA the
    copy-stream GB/s of each direction) and, on CUDA, per-tensor copies for comparison.

    Example::

        copy_throughput(torch.device("cuda"), [64 << 10] * 1000, reps=10)["fast_d2h_gbps"]
    """
    tensors = random_bytes(sizes, device)
    total = sum(sizes)
    out: dict[str, Any] = {"tensors": len(sizes), "bytes": total}
    if device.type == "cuda":
        out.update(_per_tensor_gbps(tensors, reps))
    off = group_offloader(device)
    timer = CopyTimer()
    x = torch.zeros(1, device=device, requires_grad=True)
    busy: dict[str, list[float]] = {"d2h": [], "h2d": []}
    wall = []
    with off.add_observer(timer):
        for _ in range(reps + 1):  # the first: pool allocation and kernel compilation
            timer.clear()
            t0 = time.perf_counter()
            group_round_trip(off, x, tensors)
            wall.append(time.perf_counter() - t0)
            for direction in busy:
                busy[direction].append(timer.seconds(direction))
    out["fast_wall_s"] = statistics.median(wall[1:])
    if device.type == "cuda":  # only fast on CUDA reports copy times
        for direction, seconds in busy.items():
            out[f"fast_{direction}_gbps"] = total / statistics.median(seconds[1:]) / 1e9
    out["fast_packed_spans"] = off.stats()["copies"].get("packed_spans", 0)
    return out


def copy_sweep(device: torch.device, total: int, reps: int) -> list[dict[str, Any]]:
    """Per-tensor and fast copy GB/s by tensor size (to choose the packing threshold)."""
    rows = []
    for size in [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        n = max(1, total // size)
        r = copy_throughput(device, [size] * n, reps)
        rows.append({"size": size, **{k: v for k, v in r.items() if "gbps" in k}})
    return rows


# ---------------------------------------------------------------- training steps
def run_steps(stack: torch.nn.Sequential, cfg: GPTConfig, batch: int, mode: str, device: torch.device,
              dtype: torch.dtype, steps: int, warmup: int, min_offload_bytes: int | None = None) -> dict[str, Any]:
    """Median step time, peak memory, what forward leaves resident (on CUDA; None elsewhere, where
    it is not measured) and bytes moved, in one mode of :data:`STEP_MODES` (``min_offload_bytes``:
    the offloader's, :class:`~.workloads.TrainingStep`).

    Example::

        run_steps(make_stack(cfg, "cuda", torch.bfloat16), cfg, 8, "fast:inflight=2", device, torch.bfloat16, 6, 2)
    """
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=gen).to(dtype).to(device)
    cuda = device.type == "cuda"
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    times, resident = [], 0
    gc.collect()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = allocated()
    with TrainingStep(stack, x, mode, device, min_offload_bytes=min_offload_bytes) as step:
        for i in range(warmup + steps + 1):
            step.new_input()
            sync()
            step_base = allocated()  # the step's input exists before its forward: resident counts what forward adds
            t0 = time.perf_counter()
            out = step.forward()
            if i == warmup + steps:  # last, untimed step: memory after forward
                sync()
                if step.off is not None:
                    step.off.synchronize()  # copies in flight still hold their sources
                gc.collect()
                resident = allocated() - step_base
            step.backward(out)
            step.zero_grad()
            sync()
            if warmup <= i < warmup + steps:
                times.append(time.perf_counter() - t0)
            del out
    res: dict[str, Any] = {"step_ms": statistics.median(times) * 1e3, "step_ms_all": [t * 1e3 for t in times],
                           "resident_bytes_after_forward": resident if cuda else None}
    if cuda:
        res["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    if step.off is not None:
        s = step.off.stats()
        res["offloaded_bytes"] = s["offloaded_bytes"]
        res["host_bytes_pooled"] = s["host_bytes_pooled"]
        if "copies" in s:
            res["copies"] = s["copies"]
            res["host_allocations"] = s["host_allocations"]
    return res


def grads_bitwise(cfg: GPTConfig, batch: int, device: torch.device, dtype: torch.dtype,
                  impls: list[str], min_offload_bytes: int | None = None) -> dict[str, bool]:
    """Whether each implementation's gradients equal no offload's bit for bit (eager attention,
    deterministic algorithms); ``none_vs_none`` checks that no offload agrees with itself. An
    implementation that moved nothing is not compared: ``RuntimeError`` (``min_offload_bytes``:
    its offloader's, lower it on a small stack)."""
    cfg = GPTConfig(**{**cfg.__dict__, "attention": "eager"})
    use_deterministic(True)
    try:
        stack = make_stack(cfg, device, dtype)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=gen).to(device=device, dtype=dtype)

        def grads(mode: str) -> list[torch.Tensor]:
            with TrainingStep(stack, x, mode, device, min_offload_bytes=min_offload_bytes) as step:
                step.backward(step.forward())
                out = step.grads()
                step.zero_grad()
                if step.off is not None and not step.off.stats()["offloaded_bytes"]:
                    raise RuntimeError(f"{mode} moved nothing on this stack: its gradients would say nothing "
                                       "of offloading; lower min_offload_bytes")
            return out

        base = grads("none")
        result = {"none_vs_none": all(torch.equal(a, b) for a, b in zip(base, grads("none")))}
        for impl in impls:
            result[impl] = all(torch.equal(a, b) for a, b in zip(base, grads(impl)))
        return result
    finally:
        use_deterministic(False)


def step_benchmark(name: str, cfg: GPTConfig, batch: int, device: torch.device, dtype: torch.dtype, steps: int,
                   warmup: int, bw: dict[str, float], modes: tuple[str, ...],
                   min_offload_bytes: int | None = None) -> dict[str, Any]:
    """Every mode on one stack, side by side, and fast's ratios to the others and to the bus bound."""
    stack = make_stack(cfg, device, dtype)
    out: dict[str, Any] = {"config": {**cfg.__dict__, "batch": batch, "dtype": str(dtype)}}
    for mode in modes:
        print(f"  {name}: {mode} ...", flush=True, file=sys.stderr)
        out[mode] = run_steps(stack, cfg, batch, mode, device, dtype, steps, warmup, min_offload_bytes)
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
def hook_overhead(device: torch.device, n_ops: int, group_size: int, reps: int) -> dict[str, Any]:
    """Host microseconds per saved tensor (pack + unpack) on a stack of tiny ops, in each
    mode of :data:`HOOK_MODES` against none."""
    x0 = torch.randn(256, device=device)

    def timed(off):
        out = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            tiny_op_stack(x0, off, n_ops, group_size)
            out.append(time.perf_counter() - t0)
        return min(out[1:])  # host overhead: the least-disturbed repetition

    base = timed(None)
    res: dict[str, Any] = {"ops": n_ops, "saved_tensors": n_ops, "none_s": base}
    for mode in HOOK_MODES[1:]:
        res[f"{mode}_us_per_tensor"] = (timed(hook_offloader(mode, device)) - base) / n_ops * 1e6
    return res


# ---------------------------------------------------------------- the command
def run(opts: BenchOptions) -> int:
    """``actoffload bench`` with checked arguments (see :func:`actoffload.tools.arguments.check_bench`)."""
    res = measure(set(opts.sections), opts.quick)
    path = write_results(res, opts.out)
    print(json.dumps(no_nan(summary(res)), indent=1))  # (JSON has no NaN: a measure not taken is null)
    print(f"wrote {path}", file=sys.stderr)
    if opts.old is not None:
        print(format_comparison(opts.old, res, opts.compare or "old", str(path)))
    return 0


def measure(sections: set[str], quick: bool) -> dict[str, Any]:
    """Run the chosen sections of the matrix; returns the results dict.

    Example::

        measure({"bandwidth", "hooks"}, quick=True)["hook_overhead"]
    """
    set_cublas_workspace()  # before the first matmul: the bitwise section turns determinism on
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = quick or device.type != "cuda"
    settings = group_offloader(device).settings
    # what the copy sections run fast with (no reload ahead: one group's copies at a time), which
    # is not the library's default (prefetch=1)
    res: dict[str, Any] = {"env": describe(device), "quick": quick,
                           "fast_settings": {k: settings[k] for k in ("max_inflight", "prefetch", "pack_below")}}
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
    small = 0 if quick else None  # (the small stack's tensors are all under the default min_offload_bytes)
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
                modes=STEP_MODES, min_offload_bytes=small,
            )
    if "bitwise" in sections:
        for name, (cfg, batch) in stacks.items():
            print(f"  bitwise {name} ...", file=sys.stderr, flush=True)
            res.setdefault(f"step_{name}", {})["grads_bitwise_equal"] = grads_bitwise(cfg, batch, device, dtype, ["fast", "ref"], small)
    if "hooks" in sections:
        print("  hooks ...", file=sys.stderr, flush=True)
        res["hook_overhead"] = hook_overhead(device, 400 if quick else 4000, 100, 3 if quick else 10)
    if "budgets" in sections:  # last: it turns deterministic kernels on (its gradients are compared)
        from . import budget_sweep

        use_deterministic(True)
        workloads = budget_sweep.sweep(device, quick, log=lambda line: print("  " + line, file=sys.stderr, flush=True))
        res["budget_sweep"] = {"workloads": workloads, "verdicts": {w["workload"]: budget_sweep.verdicts(w)
                                                                   for w in workloads if "error" not in w}}
    return res


def write_results(res: dict[str, Any], out_dir: Path) -> Path:
    """``<gpu>-<date>[-<commit>][-quick].json`` in ``out_dir`` (made if missing); where a file of
    that name is there already (a run earlier the same day, the one ``--compare`` reads
    perhaps), ``...-2.json``, ``...-3.json``: no run's results are overwritten."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = res["env"]
    parts = [env["gpu"].replace(" ", "-").replace("/", "-"), env["date"][:10]]
    parts += [env["commit"]] if env.get("commit") else []
    parts += ["quick"] if res.get("quick") else []
    stem = "-".join(parts)
    text = results_json(res)
    for n in itertools.count(1):
        path = out_dir / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with open(path, "x") as f:  # (made only where no file is: two runs at once take two names)
                f.write(text)
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- comparing runs
def load_results(path: str | Path) -> dict[str, Any]:
    """A results JSON written by ``actoffload bench``; ``ValueError`` saying what is wrong otherwise.

    Example::

        old = load_results("benchmarks/results/NVIDIA-H100-80GB-HBM3-2026-11-26-0039199.json")
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not JSON (not even text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("env"), dict) or not isinstance(data["env"].get("date"), str):
        raise ValueError(f"{path} is not a results file of 'actoffload bench' (no 'env' with a 'date')")
    if "quick" not in data:  # every bench run says whether it was quick; the sweeps' results do not
        raise ValueError(f"{path} is not a results file of 'actoffload bench' (another tool's: it says nothing "
                         "of 'quick')")
    return data


def latest_results(folder: str | Path) -> Path | None:
    """The full (not ``--quick``) results file in ``folder`` measured last, by its ``env.date``
    (file names sort by commit, not by date); None if there is none.

    Example::

        latest_results("benchmarks/results")   # e.g. .../NVIDIA-H100-80GB-HBM3-2026-11-26-0039199.json
    """
    best: tuple[dt.datetime, Path] | None = None
    for path in Path(folder).glob("*.json"):
        try:
            res = load_results(path)
            date = dt.datetime.fromisoformat(res["env"]["date"])
        except (ValueError, TypeError):
            continue  # another kind of JSON (a summary, a conformance run, a sweep's results)
        if date.tzinfo is None:
            date = date.replace(tzinfo=dt.timezone.utc)  # describe() writes UTC
        if not res.get("quick") and (best is None or date > best[0]):
            best = (date, path)
    return best[1] if best else None


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
    """The headline figures: copy GB/s against pinned, step times and their ratios, hook overhead."""
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
    if "budget_sweep" in res:
        out["budget_verdicts"] = {name: {k: v for k, v in verdict.items() if k != "cells"}
                                  for name, verdict in res["budget_sweep"]["verdicts"].items()}
    return out
