"""The memory-budget sweep of ``actoffload bench``: budgets against what users pick instead.

For each workload, measured side by side in one run on one card: no offloading,
activation checkpointing of every block, the best hand-picked selective checkpointing
(the fewest checkpointed blocks that fit each budget), ``save_on_cpu``, ref and fast
offloading everything, and fast with a ``memory_budget`` (each block's three parts a
group, or the whole block where its plan recomputes it) at five levels from the
smallest peak it can reach to the peak without offloading (plus one just under the
peak of checkpointing every block). Each figure is a pair: median step time
(forward + backward) and peak device memory allocated during the step, everything
included; beside it the most the caching allocator reserved (``reserved_peak_bytes``, each
method starting from an emptied cache). Every method's gradients are compared with no
offloading, bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint

import actoffload as ao
from actoffload import compat, hostmem
from actoffload.budget.controller import PROFILE_STEPS
from .models import GPT, Block, GPTConfig, Llama, LlamaConfig, block_parts, next_token_loss
from .peaks import Peaks

GiB = 1 << 30
LEVELS = 5
PAIRED_S = 6.0  # seconds of alternating steps of a budget and its rival (a host-bound MoE drifts by 10%)
PAIRED_ROUNDS = (8, 40)  # the fewest and most rounds of them, at first
PAIRED_PRECISION = 0.01  # then more rounds, until the median ratio's 95% interval is this narrow (each side)
PAIRED_MAX_S = 24.0  # or the rounds took this long
SLOW_S = 6.0  # a method whose measured steps take this long stops after 3 (it is far from the front)


@dataclass
class Workload:
    """A model with ``blocks``, and a step: loss of one batch, backward.

    Checkpointing and offloading everything work block by block, as users set them up; a
    memory budget gets each block with its three parts (:func:`block_parts`), so that its
    plan can go below checkpointing every block (where backward holds a whole block's
    recomputed activations at once) and still recompute a whole block where that is faster."""

    name: str
    model: torch.nn.Module
    blocks: torch.nn.ModuleList
    loss: Callable[[Callable[[int, torch.nn.Module, torch.Tensor], torch.Tensor], int], torch.Tensor]
    trainable: list[torch.Tensor]  # what gradients are compared for (parameters and the input)


def _stack(name: str, d: int, layers: int, batch: int, seq: int, device: torch.device, dtype: torch.dtype) -> Workload:
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=d, n_heads=max(1, d // 128), n_layers=layers, seq_len=seq, attention="eager",
                    embedding=False)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(layers)).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    leaf = x.requires_grad_(True)

    def loss(call, step):
        h = leaf * 1  # the first block sees an activation
        for i, b in enumerate(blocks):
            h = call(i, b, h)
        return h.float().square().mean()

    return Workload(name, blocks, blocks, loss, [leaf, *blocks.parameters()])


def _tokens(model: torch.nn.Module, vocab: int, batch: int, seq: int, device: torch.device) -> Workload | Any:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)


def _gpt_moe(device: torch.device, dtype: torch.dtype, small: bool) -> Workload:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512 if small else 8192, seq_len=32 if small else 1024, d_model=64 if small else 1024,
                    n_heads=4 if small else 16, n_layers=2 if small else 8, attention="eager",
                    n_experts=4 if small else 8, top_k=2)
    model = GPT(cfg).to(device=device, dtype=dtype)
    # 16 sequences: with 8, each expert's GEMMs were so short that the host (reading the
    # routing back every block) set the pace of nearly the whole step, which then drifted by
    # 10-20% within seconds on an H200's host; with 16 the steps hold within 3%
    batch = _tokens(model, cfg.vocab_size, 2 if small else 16, cfg.seq_len, device)

    def loss(call, step):
        x, y = batch[:, :-1], batch[:, 1:]
        h = model.embed(x) + model.pos[: x.shape[1]]
        for i, b in enumerate(model.blocks):
            h = call(i, b, h)
        return next_token_loss(model.head(model.ln_f(h)).float(), y)

    return Workload("gpt_moe", model, model.blocks, loss, list(model.parameters()))


def _llama(device: torch.device, dtype: torch.dtype, small: bool) -> Workload:
    torch.manual_seed(0)
    cfg = (LlamaConfig(seq_len=32, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn=172) if small else
           LlamaConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_kv_heads=4, n_layers=8, ffn=5632))
    model = Llama(cfg).to(device=device, dtype=dtype)
    batch = _tokens(model, cfg.vocab_size, 2 if small else 4, cfg.seq_len, device)

    def loss(call, step):
        x, y = batch[:, :-1], batch[:, 1:]
        h = model.embed(x)
        for i, b in enumerate(model.blocks):
            h = call(i, b, h)
        return next_token_loss(model.head(model.norm(h)).float(), y)

    return Workload("llama", model, model.blocks, loss, list(model.parameters()))


def workloads(device: torch.device, small: bool) -> list[Callable[[], Workload]]:
    """The sweep's workloads, built one at a time (each frees the last)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if small:
        return [lambda: _stack("stack_small", 64, 3, 2, 32, device, dtype),
                lambda: _gpt_moe(device, dtype, True), lambda: _llama(device, dtype, True)]
    return [  # the decoder first: its first-step figure matters most
        lambda: _llama(device, dtype, False),
        lambda: _stack("d2048_L8", 2048, 8, 8, 2048, device, dtype),
        lambda: _gpt_moe(device, dtype, False),
        lambda: _stack("d4096_L4", 4096, 4, 4, 4096, device, dtype),
        lambda: _stack("d8192_L4", 8192, 4, 2, 4096, device, dtype),
    ]


# ---------------------------------------------------------------- one method, measured
def _plain(i: int, b: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return b(h)


def _checkpointed(first: int) -> Callable[[int, torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Call blocks ``0 .. first-1`` under activation checkpointing, the others plainly."""

    def call(i: int, b: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        if i < first:
            return torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
        return b(h)

    return call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Method:
    """How a step runs: plainly, with the first ``checkpointed`` blocks checkpointed, under
    ``save_on_cpu``, or with an offloader (made once by ``offloader``) wrapping the blocks,
    their parts with ``parts``."""

    label: str
    checkpointed: int = 0
    save_on_cpu: bool = False
    offloader: Callable[[], ao.Offloader] | None = None
    parts: bool = False


class _Runner:
    """Runs steps of one method on one workload. Its offloader lives as long as the runner,
    but wraps the modules only during a step, so another method's steps can run in between
    (the paired comparison)."""

    def __init__(self, w: Workload, method: Method, device: torch.device):
        self.w, self.method, self.device = w, method, device
        self.off = method.offloader() if method.offloader is not None else None
        self._call = _checkpointed(method.checkpointed) if method.checkpointed else _plain
        self.reserved = 0  # the latest step's reserved peak

    def warming_up(self) -> bool:
        """Whether the offloader still recomputes while it pins (its warm-up on CUDA)."""
        return self.off is not None and self.off.stats().get("warmup", {}).get("warming_up", False)

    def settling(self) -> bool:
        """Whether the offloader's memory budget still profiles or tries plans."""
        return self.off is not None and not self.off.stats().get("plan", {}).get("settled", True)

    def step(self, step: int) -> tuple[float, int]:
        """One step's seconds and peak device bytes."""
        w, cuda = self.w, self.device.type == "cuda"
        for t in w.trainable:
            t.grad = None
        gc.collect()
        handle = (ao.wrap(w.blocks, self.off, parts=block_parts if self.method.parts else None)
                  if self.off is not None else None)
        try:
            _sync(self.device)
            # the step's peaks across the resets a budget makes inside it (while it profiles)
            with Peaks(self.device) as peaks:
                peaks.start()
                ctx = (torch.autograd.graph.save_on_cpu(pin_memory=cuda) if self.method.save_on_cpu
                       else contextlib.nullcontext())
                t0 = time.perf_counter()
                with ctx:
                    loss = w.loss(self._call, step)
                loss.backward()
                _sync(self.device)
                elapsed = time.perf_counter() - t0
                reserved, allocated = peaks.read()
        finally:
            if handle is not None:
                handle.remove()
        # what the caching allocator held at most (its rounding and cache on top of what is allocated)
        self.reserved = reserved or 0
        return elapsed, allocated or 0


def _warm_up(run: Any, first: int, least: int, settle: bool = False) -> list[tuple[float, int]]:
    """Steps of ``run`` from step ``first`` until it is steady: ``least`` of them, and on while
    its offloader still recomputes as it pins (fast's warm-up on CUDA), or with ``settle``
    while its memory budget still tries plans (at most 50 more, should either never end).
    Each step's seconds and peak bytes."""
    out: list[tuple[float, int]] = []
    while len(out) < least or ((run.warming_up() or (settle and run.settling())) and len(out) < least + 50):
        out.append(run.step(first + len(out)))
    return out


def measure(w: Workload, method: Method, device: torch.device, steps: int, warmup: int,
            settle: bool = False) -> tuple[dict[str, Any], _Runner]:
    """Median step seconds, peak device bytes, the gradients of the last step, and what the
    offloader reports; and the runner, for more steps of the same method. ``settle``: warm
    up until a memory budget's plan is final too."""
    compat.empty_host_cache()  # earlier methods' pinned memory: each first step starts alike
    if device.type == "cuda":
        torch.cuda.empty_cache()  # and their cached device blocks: each method's reserved peak is its own
    run = _Runner(w, method, device)
    times, peaks, reserved = [], [], []
    warming = _warm_up(run, 0, warmup, settle)
    early, early_peaks = [t for t, _ in warming], [0] + [p for _, p in warming]
    for step in range(len(warming), len(warming) + steps):
        elapsed, peak = run.step(step)
        times.append(elapsed)
        peaks.append(peak)
        reserved.append(run.reserved)
        if len(times) >= 3 and sum(times) > SLOW_S:
            break
    early = early or times[:1]
    # kept on the host: a copy on the device would raise every later method's peak
    grads = [t.grad.detach().to("cpu") for t in w.trainable if t.grad is not None]
    out: dict[str, Any] = {"method": method.label, "step_ms": statistics.median(times) * 1e3, "peak_bytes": max(peaks),
                           "reserved_peak_bytes": max(reserved),
                           "first_step_ms": early[0] * 1e3, "early_steps_ms": [t * 1e3 for t in early],
                           # the steps before: a warm-up, a budget's profiling and the plans it tried
                           "early_peak_bytes": max(early_peaks),
                           "steps_ms": [t * 1e3 for t in times], "grads": grads}
    if run.off is not None:
        s = run.off.stats()
        out["offloaded_bytes"] = s["offloaded_bytes"]
        out["largest_group_bytes"] = max((g["offloaded_bytes"] for g in s["groups"].values()), default=0)
        if "plan" in s:
            out["plan"] = {k: v for k, v in s["plan"].items() if k != "groups"}
            out["plan"]["actions"] = [g["action"] for g in s["plan"].get("groups", [])]
    return out, run


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95% interval for the median of ``values``, from their order statistics (no
    assumption on how they spread)."""
    v = sorted(values)
    k = max(0, int((len(v) - 1.96 * len(v) ** 0.5) / 2))
    return v[k], v[len(v) - 1 - k]


def paired(a: _Runner, b: _Runner, warmup: int, first_step: int) -> dict[str, Any]:
    """``a`` against ``b`` in alternating steps (``b`` warmed up first): the host's state
    drifts over seconds (a MoE waits on the host in every block), so two methods measured
    one after the other can differ by more than the difference asked about; alternating
    steps see the same drift. As many rounds as fill about ``PAIRED_S`` seconds (short,
    noisy steps get more), then more while the median ratio is not known within
    ``PAIRED_PRECISION`` and the rounds took less than ``PAIRED_MAX_S``. Step numbers go on
    from ``first_step`` (the workload's data may depend on them)."""
    warming = _warm_up(b, first_step, max(1, warmup))  # its last step times a round
    step = first_step + len(warming)
    pair_s = a.step(step)[0] + warming[-1][0]
    step += 1
    rounds = max(PAIRED_ROUNDS[0], min(PAIRED_ROUNDS[1], round(PAIRED_S / pair_s)))
    ta: list[float] = []
    tb: list[float] = []

    def more(n: int) -> None:
        nonlocal step
        for _ in range(n):
            ta.append(a.step(step)[0])
            tb.append(b.step(step + 1)[0])
            step += 2

    def ratios() -> list[float]:  # each round's own: two neighbouring steps share the host's state
        return [x / y for x, y in zip(ta, tb)]

    more(rounds)
    r = ratios()
    while sum(ta) + sum(tb) < PAIRED_MAX_S:
        lo, hi = median_interval(r)
        if hi - lo <= 2 * PAIRED_PRECISION * statistics.median(r):
            break
        more(PAIRED_ROUNDS[0])
        r = ratios()
    ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    return {"against": b.method.label, "rounds": len(ta), "step_ms": ma, "against_step_ms": mb,
            "ratio": statistics.median(r), "ratio_interval": list(median_interval(r)),
            "ratio_of_medians": ma / mb, "steps_ms": [t * 1e3 for t in ta], "against_steps_ms": [t * 1e3 for t in tb]}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _fastest_fitting(workload: dict[str, Any], budget: int) -> dict[str, Any] | None:
    """The fastest of what users would pick instead (offloading everything included, ref
    not: fast is the faster of the two) whose peak fits ``budget``; ``None`` if none does."""
    m = workload["methods"]
    alternatives = [m[k] for k in ("none", "checkpoint_all", "save_on_cpu", "fast")] + workload["selective"]
    fitting = [a for a in alternatives if a["peak_bytes"] <= budget]
    return min(fitting, key=lambda a: a["step_ms"]) if fitting else None


def sweep_workload(w: Workload, device: torch.device, steps: int, warmup: int, log=print) -> dict[str, Any]:
    """Every method on one workload, then the budget levels, each paired with the fastest
    alternative that fits it (and the level under checkpointing with checkpointing)."""
    methods = {"none": Method("none"), "checkpoint_all": Method("checkpoint_all", checkpointed=len(w.blocks)),
               "save_on_cpu": Method("save_on_cpu", save_on_cpu=True),
               "ref": Method("ref", offloader=lambda: ao.Offloader(impl="ref", device=device)),
               "fast": Method("fast", offloader=lambda: ao.Offloader(impl="fast", device=device)),
               "fast_offload_first": Method("fast_offload_first", offloader=lambda: ao.Offloader(
                   impl="fast", device=device, warmup="offload"))}
    methods.update({f"checkpoint_{k}": Method(f"checkpoint_{k}", checkpointed=k) for k in range(1, len(w.blocks))})
    base, _ = measure(w, methods["none"], device, steps, warmup)
    res: dict[str, Any] = {"workload": w.name, "blocks": len(w.blocks), "methods": {}, "budgets": []}

    def keep(r: dict[str, Any]) -> dict[str, Any]:
        r["bitwise"] = _same(r.pop("grads"), base["grads"])
        log(f"  {w.name}: {r['method']}: {r['step_ms']:.1f} ms, {r['peak_bytes'] / GiB:.2f} GiB "
            f"({r['reserved_peak_bytes'] / GiB:.2f} reserved), "
            f"bitwise {r['bitwise']}")
        return r

    res["methods"]["none"] = keep(dict(base, grads=base["grads"]))
    for name in ("checkpoint_all", "save_on_cpu", "ref", "fast", "fast_offload_first"):
        res["methods"][name] = keep(measure(w, methods[name], device, steps, warmup)[0])
    res["selective"] = [keep(measure(w, methods[f"checkpoint_{k}"], device, steps, warmup)[0])
                        for k in range(1, len(w.blocks))]
    # the least a plan reaches: the profiling steps run the least-memory plan
    least = measure(w, Method("fast_budget_profile", parts=True,
                              offloader=lambda: ao.Offloader(impl="fast", device=device, memory_budget=1 << 50)),
                    device, 1, PROFILE_STEPS)[0]["plan"]
    high = res["methods"]["none"]["peak_bytes"]
    under_ckpt = None
    if high == 0:  # the CPU has no allocator to read: one cell runs the planner end to end
        budgets = [1 << 40]
        res["smallest_reachable_bytes"] = None
    else:
        # the least-memory plan ran while profiling: its measured peak is reachable (1% for
        # the allocator's step-to-step variation)
        low = int(min(least["profiled_peak_bytes"], least["smallest_reachable_bytes"]) * 1.01)
        res["smallest_reachable_bytes"] = low
        levels = [int(low + (high - low) * k / (LEVELS - 1)) for k in range(LEVELS)]
        under_ckpt = res["methods"]["checkpoint_all"]["peak_bytes"] - (1 << 20)  # strictly below it
        budgets = sorted(set(levels + [under_ckpt]))
    # a budget's first steps profile, then it may try a few plans the model rates fastest and
    # the fastest that moves no bytes before keeping the fastest measured: its steady steps
    # begin once its plan is settled
    for budget in budgets:
        method = Method("fast_budget", parts=True,
                        offloader=lambda: ao.Offloader(impl="fast", device=device, memory_budget=budget))
        try:
            r, run = measure(w, method, device, steps, warmup + PROFILE_STEPS, settle=True)
        except ValueError as e:  # no plan fits
            res["budgets"].append({"budget_bytes": budget, "error": str(e)})
            log(f"  {w.name}: budget {budget / GiB:.2f} GiB: {e}")
            continue
        r = keep(r)
        r["budget_bytes"] = budget
        r["under_checkpoint_all"] = budget == under_ckpt
        rival = res["methods"]["checkpoint_all"] if r["under_checkpoint_all"] else _fastest_fitting(res, budget)
        if rival is not None:
            r["paired"] = paired(run, _Runner(w, methods[rival["method"]], device), warmup,
                                 len(r["early_steps_ms"]) + len(r["steps_ms"]))
            log(f"  {w.name}: budget {budget / GiB:.2f} GiB against {rival['method']}, alternating: "
                f"{r['paired']['step_ms']:.1f} / {r['paired']['against_step_ms']:.1f} ms")
        res["budgets"].append(r)
    return res


def host_pinning_ms_per_gib(reps: int = 3) -> float:
    """Milliseconds to make 1 GiB of fresh host memory pinned the way fast's pool does (the
    fastest of ``reps``): a fresh offloader's first step pins every byte it offloads, so this
    rate times those bytes is the least that step costs beyond a steady one."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        host = hostmem.exact_host_allocator(GiB, pinned=True)
        times.append(time.perf_counter() - t0)
        del host
        gc.collect()
    return min(times) * 1e3


def _compile_kernels(device: torch.device) -> None:
    """One packed round trip, so that compiling the Triton kernels (once per process) is not
    counted as any offloader's first step."""
    off = ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=0)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with off.group("warm-up"):
        y = (x * 1).exp()
    y.sum().backward()
    _sync(device)


def sweep(device: torch.device, small: bool, log=print, done=lambda results: None,
          only: set[str] | None = None, skip: set[str] = frozenset()) -> list[dict[str, Any]]:
    """Every workload in turn; ``done(results so far)`` after each (to save partial results).
    A workload that fails is reported with its error and the sweep goes on."""
    steps, warmup = (2, 1) if small else (8, 2)
    _compile_kernels(device)
    out: list[dict[str, Any]] = []
    for build in workloads(device, small):
        try:
            w = build()
            if (only and w.name not in only) or w.name in skip:
                continue
            log(f"budget sweep: {w.name} ({len(w.blocks)} blocks)")
            gc.freeze()  # the model and torch stay: each step's collection walks only its own garbage
            out.append(sweep_workload(w, device, steps, warmup, log))
        except Exception as e:  # noqa: BLE001  report it, keep what the others measure
            log(f"budget sweep: a workload failed: {type(e).__name__}: {e}")
            out.append({"workload": getattr(locals().get("w"), "name", "?"), "error": f"{type(e).__name__}: {e}"})
        finally:
            w = None
            gc.unfreeze()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        done(out)
    return out


# ---------------------------------------------------------------- verdicts
def _ratio(b: dict[str, Any], rival: dict[str, Any]) -> tuple[float, str]:
    """``b``'s step time over ``rival``'s: from their alternating steps where they ran so,
    else from their separate runs."""
    p = b.get("paired")
    if p is not None and p["against"] == rival["method"]:
        return p["ratio"], "alternating"
    return b["step_ms"] / rival["step_ms"], "separately"


def _steady_ms(b: dict[str, Any]) -> float:
    """A budget's steady step time: the median of all its steps after it settled, those run
    alone and those alternating with its rival, which are more and weigh more (in a step that
    waits on the host, one second's steps can sit 20% off the next second's)."""
    return statistics.median(b["steps_ms"] + b.get("paired", {}).get("steps_ms", []))


def _every_step_peak(r: dict[str, Any]) -> int:
    return max(r["peak_bytes"], r.get("early_peak_bytes", 0))


def verdicts(workload: dict[str, Any]) -> dict[str, Any]:
    """The sweep's questions, answered from one workload's figures."""
    m = workload["methods"]
    cells = []
    for b in workload["budgets"]:
        if "error" in b:
            cells.append({"budget_bytes": b["budget_bytes"], "error": b["error"]})
            continue
        best = _fastest_fitting(workload, b["budget_bytes"])
        predicted = (b.get("plan", {}).get("predicted_step_s") or 0.0) * 1e3
        ratio, how = _ratio(b, best) if best else (None, None)
        cells.append({
            "budget_bytes": b["budget_bytes"],
            "peak_within_budget": b["peak_bytes"] <= b["budget_bytes"],
            # also while it profiled and tried plans (a plan's first step runs on the model alone)
            "peak_within_budget_every_step": _every_step_peak(b) <= b["budget_bytes"],
            "fastest_fitting_alternative": best["method"] if best else None,
            "vs_fastest_fitting": ratio,
            "vs_fastest_fitting_measured": how,
            # where alternating: a 95% interval for that median ratio
            "vs_fastest_fitting_interval": (b["paired"].get("ratio_interval") if how == "alternating" else None),
            "vs_fastest_fitting_separately": b["step_ms"] / best["step_ms"] if best else None,
            "vs_predicted": _steady_ms(b) / predicted if predicted else None,
            "vs_predicted_alone": b["step_ms"] / predicted if predicted else None,
            "bitwise": b["bitwise"],
        })
    under = [b for b in workload["budgets"] if b.get("under_checkpoint_all") and "error" not in b]
    ckpt = m["checkpoint_all"]
    under_time = _ratio(under[0], ckpt)[0] if under else None
    return {
        "cells": cells,
        "below_checkpoint_all": bool(under) and under[0]["peak_bytes"] < ckpt["peak_bytes"] and under_time <= 1.10,
        "below_checkpoint_all_time_ratio": under_time,
        # fast's peak over every step, its warm-up's included
        "fast_peak_minus_ref_peak_bytes": _every_step_peak(m["fast"]) - m["ref"]["peak_bytes"],
        "fast_peak_minus_ref_peak_groups": ((_every_step_peak(m["fast"]) - m["ref"]["peak_bytes"])
                                            / m["fast"]["largest_group_bytes"] if m["fast"].get("largest_group_bytes") else None),
        # the default (on CUDA it recomputes while it pins): its first step and its slowest
        # step before it is warm, against its steady step
        "fast_first_step_vs_steady": (m["fast"]["first_step_ms"] / m["fast"]["step_ms"]
                                      if m["fast"].get("first_step_ms") else None),
        "fast_slowest_early_step_vs_steady": max(m["fast"].get("early_steps_ms") or [0.0]) / m["fast"]["step_ms"],
        "fast_warmup_steps": len(m["fast"].get("early_steps_ms") or []),
        # warmup="offload": offloading, so pinning, from the first step
        **({"offload_first_step_vs_steady": m["fast_offload_first"]["first_step_ms"] / m["fast"]["step_ms"]}
           if "fast_offload_first" in m else {}),
        "budget_first_step_vs_steady": [b["first_step_ms"] / b["step_ms"] for b in workload["budgets"]
                                        if "error" not in b and b.get("first_step_ms")],
    }


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """Peak memory against step time, one panel per workload, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for ax, wres in zip(axes[0], results):
        m = wres["methods"]
        for key, marker in (("none", "o"), ("checkpoint_all", "s"), ("save_on_cpu", "v"), ("ref", "^"), ("fast", "D")):
            ax.scatter(m[key]["peak_bytes"] / GiB, m[key]["step_ms"], marker=marker, label=key, zorder=3)
        sel = wres["selective"]
        if sel:
            ax.plot([s["peak_bytes"] / GiB for s in sel], [s["step_ms"] for s in sel], ":", color="gray",
                    marker=".", label="checkpoint first k blocks")
        cells = [b for b in wres["budgets"] if "error" not in b]
        ax.plot([b["peak_bytes"] / GiB for b in cells], [b["step_ms"] for b in cells], "-", color="crimson",
                marker="*", markersize=9, label="fast, memory_budget")
        for b in cells:
            ax.axvline(b["budget_bytes"] / GiB, color="crimson", alpha=0.12)
        ax.set_title(wres["workload"])
        ax.set_xlabel("peak device memory (GiB)")
        ax.set_ylabel("step time (ms, log scale)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title + "  (faint lines: the budgets)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m actoffload.tools.budget_sweep [--small] [--out FILE.json] [--plot FILE.png]``"""
    import argparse
    import json

    from .determinism import use_deterministic
    from .provenance import describe

    p = argparse.ArgumentParser(prog="python -m actoffload.tools.budget_sweep")
    p.add_argument("--small", action="store_true", help="tiny workloads (the CPU always uses them)")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--plot", help="peak memory against step time, as a PNG")
    p.add_argument("--only", default="", help="comma-separated workloads to run (default: all)")
    p.add_argument("--include", action="append", default=[], metavar="JSON",
                   help="results of an earlier run on the same GPU: its workloads join these (and are not run "
                        "again), so a sweep can be split over several sessions")
    args = p.parse_args(argv)
    earlier: list[dict[str, Any]] = []
    for path in args.include:
        try:
            with open(path) as f:
                earlier += json.load(f)["workloads"]
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--include {path}: not a budget sweep's results ({e})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_deterministic(True)
    env = describe(device)
    pinning = host_pinning_ms_per_gib() if device.type == "cuda" else None

    def save(results: list[dict[str, Any]]) -> dict[str, Any]:
        results = earlier + results
        doc = {"env": env, "host_pinning_ms_per_gib": pinning, "workloads": results,
               "verdicts": {r["workload"]: verdicts(r) for r in results if "error" not in r}}
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(doc, indent=1, default=float))
        return doc

    only = {name for name in args.only.split(",") if name}
    results = sweep(device, args.small or device.type != "cuda", log=lambda s: print(s, file=sys.stderr, flush=True),
                    done=save, only=only, skip={r["workload"] for r in earlier})
    doc = save(results)
    print(json.dumps(doc["verdicts"], indent=1, default=float))
    if args.plot:
        plot([r for r in doc["workloads"] if "error" not in r], args.plot, f"memory budgets on {env['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
