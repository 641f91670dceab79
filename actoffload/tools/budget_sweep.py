"""The memory-budget sweep of ``actoffload bench``: budgets against what users pick instead.

For each workload, measured side by side in one run on one card: no offloading,
activation checkpointing of every block, the best hand-picked selective checkpointing
(the fewest checkpointed blocks that fit each budget), torch's selective activation
checkpointing (every block checkpointed, the outputs of its matmuls and attention kept:
``sac``), checkpointing every block with its saved input moved to host memory
(``checkpoint_offload``, what transformers' offloaded checkpointing and Unsloth's do),
``save_on_cpu``, ref and fast offloading everything, and fast with a ``memory_budget`` at
five levels from the smallest peak it can reach to the peak without offloading (plus one
just under the peak of checkpointing every block, and one at 1.25 times it). A budget gets
this repository's blocks with their three parts each a group (or the whole block where its
plan recomputes it), and transformers' layers whole, as users wrap them. Each figure is a pair: median step time
(forward + backward) and peak device memory during the step, everything included: what the
caching allocator reserved (``reserved_peak_bytes``, each method starting from an emptied
cache), which is what a budget bounds and what budgets are set from and judged by, and beside
it what was allocated (``peak_bytes``). Every method's gradients are compared with no
offloading, bit for bit; for transformers' models no offloading also runs twice, which
tells whether the step is deterministic at all (SDPA's backward may not be). Each budget is
judged against the fastest of the alternatives whose peak fits it.

The workloads (:mod:`.sweep_models`): ``--models default`` (this repository's decoder, MoE
and plain stacks), ``--models hf`` (transformers' ``LlamaForCausalLM``, eager and SDPA, and
8B-shaped layers at 8k and 32k tokens: measured for less long, three budget levels; skipped
with a message where transformers is not installed) or ``--models all``; ``--only`` picks by
name from any set.

Example::

    python -m actoffload.tools.budget_sweep --out sweep.json --plot sweep.png
    python -m actoffload.tools.budget_sweep --models hf --out sweep-hf.json
    python -m actoffload.tools.budget_sweep --only hf_llama_eager --small   # the CPU: tiny models
"""

from __future__ import annotations

import contextlib
import functools
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
from actoffload.selective import attention_policy, sac_policy
from .peaks import Peaks
from .plan_trace import PlanTrace
from .sweep_models import (MODEL_SETS, Call, Scale, Workload, have_transformers, plain, workload_names,
                           workloads)
from .workloads import sync

__all__ = ["Method", "Scale", "Workload", "measure", "paired", "sweep", "sweep_workload", "verdicts", "workloads"]

GiB = 1 << 30
LEVELS = 5
PAIRED_S = 6.0  # seconds of alternating steps of a budget and its rival (a host-bound MoE drifts by 10%)
PAIRED_ROUNDS = (8, 40)  # the fewest and most rounds of them, at first
PAIRED_PRECISION = 0.01  # then more rounds, until the median ratio's 95% interval is this narrow (each side)
PAIRED_MAX_S = 24.0  # or the rounds took this long
SLOW_S = 6.0  # a method whose measured steps take this long stops after 3 (it is far from the front)


# ---------------------------------------------------------------- one method, measured
# a fresh pair of contexts for each checkpointed call: torch's selective activation
# checkpointing, keeping what a budget's selective recomputation keeps (the matmuls' and fused
# attention's outputs), recomputing everything else
_sac_context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, sac_policy)
# the same keeping the fused attention's outputs only
_attention_context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, attention_policy)


CHECKPOINT_KINDS = ("plain", "selective", "attention", "offload")


def _checkpointed(first: int, kind: str = "plain", pin: bool = False) -> Call:
    """Call blocks ``0 .. first-1`` under activation checkpointing (non-reentrant), the others
    plainly. ``kind``: ``plain`` recomputes the whole block; ``selective`` keeps what
    :func:`actoffload.selective.sac_policy` keeps, ``attention`` what
    :func:`actoffload.selective.attention_policy` keeps; ``offload`` moves the checkpoint's saved inputs to host memory
    (``save_on_cpu`` around the checkpoint: what it saves itself, the recomputation's
    inputs, moves; what the block saves is its checkpoint's to drop)."""
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(f"checkpoint kind {kind!r}: one of {CHECKPOINT_KINDS}")

    def call(i: int, b: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if i >= first:
            return b(*args, **kwargs)
        if kind in ("selective", "attention"):
            context = _sac_context if kind == "selective" else _attention_context
            return torch.utils.checkpoint.checkpoint(b, *args, use_reentrant=False, context_fn=context, **kwargs)
        if kind == "offload":
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return torch.utils.checkpoint.checkpoint(b, *args, use_reentrant=False, **kwargs)
        return torch.utils.checkpoint.checkpoint(b, *args, use_reentrant=False, **kwargs)

    return call


@dataclass
class Method:
    """How a step runs: plainly, with the first ``checkpointed`` blocks checkpointed (the
    ``checkpoint`` kind: see :func:`_checkpointed`), under ``save_on_cpu``, or with an
    offloader (made once by ``offloader``) wrapping the blocks, with the workload's parts
    where ``parts``."""

    label: str
    checkpointed: int = 0
    save_on_cpu: bool = False
    offloader: Callable[[], ao.Offloader] | None = None
    parts: bool = False
    checkpoint: str = "plain"


class _Runner:
    """Runs steps of one method on one workload. Its offloader lives as long as the runner,
    but wraps the modules only during a step, so another method's steps can run in between
    (the paired comparison)."""

    def __init__(self, w: Workload, method: Method, device: torch.device):
        self.w, self.method, self.device = w, method, device
        self.off = method.offloader() if method.offloader is not None else None
        self._call = (_checkpointed(method.checkpointed, method.checkpoint, pin=device.type == "cuda")
                      if method.checkpointed else plain)
        self.reserved = 0  # the latest step's reserved peak
        self.note: dict[str, Any] | None = None  # its memory budget's plan (:meth:`_plan_note`)
        self._trace = PlanTrace()

    def _plan_note(self) -> dict[str, Any] | None:
        """What a memory budget did in the latest step (``None`` without one): the plan that ran
        (:class:`~.plan_trace.PlanTrace`), the state and plan after it, the allocator's reserve,
        and each plan tried so far, its steps and times: which step of a warm-up went over,
        running what, and what each of the steps to settle went to."""
        plan = self.off.stats().get("plan") if self.off is not None else None
        if not plan:
            return None
        tried = [{k: t.get(k) for k in ("actions", "steps", "max_inflight", "prefetch", "predicted_step_s",
                                        "measured_step_s")} for t in plan.get("tried", [])]
        return {"ran": self._trace.ran(plan), "state": plan.get("state"),
                "actions": [g["action"] for g in plan.get("groups", [])],
                "allocator_reserve_bytes": plan.get("allocator_reserve_bytes"), "cache_trims": plan.get("cache_trims"),
                "tried": tried}

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
        handle = (ao.wrap(w.blocks, self.off, parts=w.parts if self.method.parts else None)
                  if self.off is not None else None)
        try:
            sync(self.device)
            # the step's peaks across the resets a budget makes inside it (while it profiles)
            with Peaks(self.device) as peaks:
                peaks.start()
                ctx = (torch.autograd.graph.save_on_cpu(pin_memory=cuda) if self.method.save_on_cpu
                       else contextlib.nullcontext())
                t0 = time.perf_counter()
                with ctx:
                    loss = w.loss(self._call, step)
                loss.backward()
                sync(self.device)
                elapsed = time.perf_counter() - t0
                reserved, allocated = peaks.read()
        finally:
            if handle is not None:
                handle.remove()
        # what the caching allocator held at most (its rounding and cache on top of what is allocated)
        self.reserved = reserved or 0
        self.note = self._plan_note()
        return elapsed, allocated or 0


def _warm_up(run: Any, first: int, least: int, settle: bool = False) -> list[tuple[float, int, int, Any]]:
    """Steps of ``run`` from step ``first`` until it is steady: ``least`` of them, and on while
    its offloader still recomputes as it pins (fast's warm-up on CUDA), or with ``settle``
    while its memory budget still tries plans (at most 50 more, should either never end).
    Each step's seconds, peak allocated bytes, peak reserved bytes and its budget's plan
    after it (:meth:`_Runner._plan_note`)."""
    out: list[tuple[float, int, int, Any]] = []
    while len(out) < least or ((run.warming_up() or (settle and run.settling())) and len(out) < least + 50):
        out.append((*run.step(first + len(out)), run.reserved, run.note))
    return out


def measure(w: Workload, method: Method, device: torch.device, steps: int, warmup: int,
            settle: bool = False) -> tuple[dict[str, Any], _Runner]:
    """Median step seconds, peak device bytes, the gradients of the last step, and what the
    offloader reports; and the runner, for more steps of the same method. ``settle``: warm
    up until a memory budget's plan is final too."""
    # what earlier methods leave is let go before the caches are emptied, else their first step
    # begins on it: the gradients, and the runners and offloaders (reference cycles) they dropped
    for t in w.trainable:
        t.grad = None
    gc.collect()
    compat.empty_host_cache()  # earlier methods' pinned memory: each first step starts alike
    if device.type == "cuda":
        torch.cuda.empty_cache()  # and their cached device blocks: each method's reserved peak is its own
    run = _Runner(w, method, device)
    times, peaks, reserved = [], [], []
    warming = _warm_up(run, 0, warmup, settle)
    early, early_peaks = [t for t, _, _, _ in warming], [0] + [p for _, p, _, _ in warming]
    early_reserved = [0] + [r for _, _, r, _ in warming]
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
                           "early_peak_bytes": max(early_peaks), "early_reserved_peak_bytes": max(early_reserved),
                           # each of them: which went over a budget, running what
                           "early_steps": [{"peak_bytes": p, "reserved_peak_bytes": r, "plan": note}
                                           for _, p, r, note in warming],
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


def paired(a: _Runner, b: _Runner, warmup: int, first_step: int, scale: Scale | None = None) -> dict[str, Any]:
    """``a`` against ``b`` in alternating steps (``b`` warmed up first): the host's state
    drifts over seconds (a MoE waits on the host in every block), so two methods measured
    one after the other can differ by more than the difference asked about; alternating
    steps see the same drift. As many rounds as fill about ``PAIRED_S`` seconds (short,
    noisy steps get more), then more while the median ratio is not known within
    ``PAIRED_PRECISION`` and the rounds took less than ``PAIRED_MAX_S`` (a workload's
    ``scale`` may set shorter ones). Step numbers go on from ``first_step`` (the workload's
    data may depend on them)."""
    paired_s, (least, most), max_s = ((scale.paired_s, scale.paired_rounds, scale.paired_max_s) if scale else
                                      (PAIRED_S, PAIRED_ROUNDS, PAIRED_MAX_S))
    warming = _warm_up(b, first_step, max(1, warmup))  # its last step times a round
    step = first_step + len(warming)
    pair_s = a.step(step)[0] + warming[-1][0]
    step += 1
    rounds = max(least, min(most, round(paired_s / pair_s)))
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

    trims_before = _trims_by(a)
    more(rounds)
    r = ratios()
    while sum(ta) + sum(tb) < max_s:
        lo, hi = median_interval(r)
        if hi - lo <= 2 * PAIRED_PRECISION * statistics.median(r):
            break
        more(least)
        r = ratios()
    ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    return {"against": b.method.label, "rounds": len(ta), "step_ms": ma, "against_step_ms": mb,
            "ratio": statistics.median(r), "ratio_interval": list(median_interval(r)),
            "ratio_of_medians": ma / mb, "steps_ms": [t * 1e3 for t in ta], "against_steps_ms": [t * 1e3 for t in tb],
            # the caches ``a``'s budget gave back meanwhile, by why: a rival whose steps reserve
            # more than ``a``'s leaves it a cache grown between its steps, given back before each
            "cache_trims_by": {why: n - trims_before.get(why, 0) for why, n in _trims_by(a).items()
                               if n > trims_before.get(why, 0)}}


def _trims_by(runner: _Runner) -> dict[str, int]:
    """The times ``runner``'s memory budget gave the allocator's cache back so far, by why
    (none without a budget, or on the CPU)."""
    plan = runner.off.stats().get("plan") if runner.off is not None else None
    return dict((plan or {}).get("cache_trims_by") or {})


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# what users pick instead of a budget, each judged by its peak and step time (ref is not
# among them: fast offloads the same, faster), and the kinds of checkpointing every block
ALTERNATIVES = ("none", "checkpoint_all", "sac", "checkpoint_offload", "save_on_cpu", "fast")


def _fastest_fitting(workload: dict[str, Any], budget: int) -> dict[str, Any] | None:
    """The fastest of what users would pick instead (:data:`ALTERNATIVES` and the selective
    first-k checkpointing; a method that failed or that an older sweep did not run is left
    out) whose peak fits ``budget``; ``None`` if none does."""
    m = workload["methods"]
    alternatives = [m[k] for k in ALTERNATIVES if k in m] + workload["selective"]
    fitting = [a for a in alternatives if "error" not in a and budget_peak(a) <= budget]
    return min(fitting, key=lambda a: a["step_ms"]) if fitting else None


def _methods(w: Workload, device: torch.device) -> dict[str, Method]:
    n = len(w.blocks)
    methods = {"none": Method("none"), "none_repeat": Method("none_repeat"),
               "checkpoint_all": Method("checkpoint_all", checkpointed=n),
               "sac": Method("sac", checkpointed=n, checkpoint="selective"),
               "checkpoint_offload": Method("checkpoint_offload", checkpointed=n, checkpoint="offload"),
               "save_on_cpu": Method("save_on_cpu", save_on_cpu=True),
               "ref": Method("ref", offloader=lambda: ao.Offloader(impl="ref", device=device)),
               "fast": Method("fast", offloader=lambda: ao.Offloader(impl="fast", device=device)),
               "fast_offload_first": Method("fast_offload_first", offloader=lambda: ao.Offloader(
                   impl="fast", device=device, warmup="offload"))}
    methods.update({f"checkpoint_{k}": Method(f"checkpoint_{k}", checkpointed=k) for k in range(1, n)})
    return methods


def _empty_caches(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sweep_workload(w: Workload, device: torch.device, steps: int, warmup: int, log=print) -> dict[str, Any]:
    """Every method on one workload, then the budget levels, each paired with the fastest
    alternative that fits it (and the level under checkpointing with checkpointing). A
    workload's ``scale`` sets its steps, warm-up, levels and alternating rounds instead."""
    scale = w.scale
    if scale is not None:
        steps, warmup = scale.steps, scale.warmup
    n_levels = scale.levels if scale is not None else LEVELS
    methods = _methods(w, device)
    base, _ = measure(w, methods["none"], device, steps, warmup)
    res: dict[str, Any] = {"workload": w.name, "blocks": len(w.blocks), "config": w.info,
                           "budget_parts": w.parts is not None, "methods": {}, "budgets": []}
    if scale is not None:
        res["scale"] = {"steps": scale.steps, "warmup": scale.warmup, "levels": scale.levels,
                        "paired_s": scale.paired_s, "paired_rounds": list(scale.paired_rounds),
                        "paired_max_s": scale.paired_max_s}

    def keep(r: dict[str, Any]) -> dict[str, Any]:
        r["bitwise"] = _same(r.pop("grads"), base["grads"])
        log(f"  {w.name}: {r['method']}: {r['step_ms']:.1f} ms, {r['peak_bytes'] / GiB:.2f} GiB "
            f"({r['reserved_peak_bytes'] / GiB:.2f} reserved), "
            f"bitwise {r['bitwise']}")
        return r

    def attempt(name: str) -> dict[str, Any]:
        """A method that may not run on every workload or torch: its error is its result."""
        try:
            return keep(measure(w, methods[name], device, steps, warmup)[0])
        except Exception as e:  # noqa: BLE001  recorded, and left out of the fastest fitting
            log(f"  {w.name}: {name} failed: {type(e).__name__}: {e}")
            return {"method": name, "error": f"{type(e).__name__}: {e}"}
        finally:
            _empty_caches(device)

    res["methods"]["none"] = keep(dict(base, grads=base["grads"]))
    if w.repeat_none:  # whether the step itself is deterministic: every bitwise figure rests on it
        res["methods"]["none_repeat"] = attempt("none_repeat")
        res["none_vs_none_bitwise"] = res["methods"]["none_repeat"].get("bitwise")
    for name in ("checkpoint_all", "sac", "checkpoint_offload", "save_on_cpu", "ref", "fast", "fast_offload_first"):
        res["methods"][name] = (attempt(name) if name in ("sac", "checkpoint_offload") else
                                keep(measure(w, methods[name], device, steps, warmup)[0]))
    res["selective"] = [keep(measure(w, methods[f"checkpoint_{k}"], device, steps, warmup)[0])
                        for k in range(1, len(w.blocks))]
    # the least a plan reaches: the profiling steps run the least-memory plan
    profiling = measure(w, Method("fast_budget_profile", parts=True,
                                  offloader=lambda: ao.Offloader(impl="fast", device=device, memory_budget=1 << 50)),
                        device, 1, PROFILE_STEPS)[0]
    least = profiling["plan"]
    high = budget_peak(res["methods"]["none"])
    under_ckpt = None
    if high == 0:  # the CPU has no allocator to read: one cell runs the planner end to end
        budgets = [1 << 40]
        res["smallest_reachable_bytes"] = None
    else:
        # the least-memory plan ran while profiling: its measured peak is reachable (1% for
        # the allocator's step-to-step variation)
        # (its early steps are the profiling ones; its one measured step ran the plan chosen after)
        low = int(min(profiling.get("early_reserved_peak_bytes") or profiling["early_peak_bytes"],
                      least["smallest_reachable_bytes"]) * 1.01)
        res["smallest_reachable_bytes"] = low
        levels = [int(low + (high - low) * k / (n_levels - 1)) for k in range(n_levels)]
        ckpt = budget_peak(res["methods"]["checkpoint_all"])
        under_ckpt = ckpt - (1 << 20)  # strictly below it
        # a quarter more than checkpointing's: room to keep part of what it recomputes
        above_ckpt = [int(1.25 * ckpt)] if 1.25 * ckpt < high else []
        budgets = sorted(set(levels + [under_ckpt] + above_ckpt))
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
                                 len(r["early_steps_ms"]) + len(r["steps_ms"]), scale)
            log(f"  {w.name}: budget {budget / GiB:.2f} GiB against {rival['method']}, alternating: "
                f"{r['paired']['step_ms']:.1f} / {r['paired']['against_step_ms']:.1f} ms"
                + (f", caches given back meanwhile {r['paired']['cache_trims_by']}" if r["paired"]["cache_trims_by"] else ""))
        res["budgets"].append(r)
        run = None  # its offloader (pinned pool, plans) let go before the next budget's first step
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
    sync(device)


def sweep(device: torch.device, small: bool, log=print, done=lambda results: None,
          only: set[str] | None = None, skip: set[str] = frozenset(), models: str = "default") -> list[dict[str, Any]]:
    """Every workload of ``models`` (``default``, ``hf`` or ``all``; with ``only``, those
    named, from any set) in turn; ``done(results so far)`` after each (to save partial
    results). A workload that fails is reported with its error and the sweep goes on; one
    of transformers' where it is not installed is reported as skipped."""
    steps, warmup = (2, 1) if small else (8, 2)
    _compile_kernels(device)
    out: list[dict[str, Any]] = []
    for name, build in workloads(device, small, "all" if only else models):
        if (only and name not in only) or name in skip:
            continue
        if name.startswith("hf_") and not have_transformers():
            log(f"budget sweep: {name} skipped: transformers is not installed")
            out.append({"workload": name, "skipped": True, "error": "skipped: transformers is not installed"})
            done(out)
            continue
        w = None
        try:
            w = build()
            log(f"budget sweep: {w.name} ({len(w.blocks)} blocks)")
            gc.freeze()  # the model and torch stay: each step's collection walks only its own garbage
            out.append(sweep_workload(w, device, steps, warmup, log))
        except Exception as e:  # noqa: BLE001  report it, keep what the others measure
            log(f"budget sweep: {name} failed: {type(e).__name__}: {e}")
            out.append({"workload": name, "error": f"{type(e).__name__}: {e}"})
        finally:
            w = None
            gc.unfreeze()
            _empty_caches(device)
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


def budget_peak(r: dict[str, Any], every_step: bool = False) -> int:
    """A method's peak as a budget counts it: what the allocator reserved (on CUDA; the CPU has
    no allocator, and its figures are the allocated stand-ins), over its measured steps or, with
    ``every_step``, its early ones too."""
    reserved = max(r.get("reserved_peak_bytes") or 0, r.get("early_reserved_peak_bytes") or 0 if every_step else 0)
    return reserved or (_every_step_peak(r) if every_step else r["peak_bytes"])


def sweep_workloads(doc: Any) -> list[dict[str, Any]]:
    """The workloads of a budget sweep's results (``doc``, read from its JSON), or ``ValueError``
    naming what makes them another tool's (a loop sweep's workloads have no methods at their top).

    Example::

        earlier = sweep_workloads(json.load(open("earlier.json")))
    """
    workloads = doc["workloads"]
    if not isinstance(workloads, list) or not all(
            isinstance(w, dict) and "workload" in w and ("error" in w or {"methods", "budgets"} <= w.keys())
            for w in workloads):
        raise ValueError("its workloads are not a budget sweep's: each names its workload and has its methods "
                         "and budgets")
    return workloads


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
            "peak_within_budget": budget_peak(b) <= b["budget_bytes"],
            # also while it profiled and tried plans (a plan's first step runs on the model alone)
            "peak_within_budget_every_step": budget_peak(b, every_step=True) <= b["budget_bytes"],
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
    # every method's figures, side by side (a method that failed: its error)
    table = {name: ({"error": r["error"]} if "error" in r else
                    {k: r.get(k) for k in ("step_ms", "peak_bytes", "reserved_peak_bytes", "bitwise")})
             for name, r in [*m.items(), *((r["method"], r) for r in workload["selective"])]}
    under = [b for b in workload["budgets"] if b.get("under_checkpoint_all") and "error" not in b]
    ckpt = m["checkpoint_all"]
    under_time = _ratio(under[0], ckpt)[0] if under else None
    return {
        "cells": cells,
        "methods": table,
        # no offloading against itself (transformers' models): False where the step is not
        # deterministic (SDPA's backward may not be), and then no bitwise figure says much
        "none_vs_none_bitwise": workload.get("none_vs_none_bitwise"),
        "below_checkpoint_all": bool(under) and budget_peak(under[0]) < budget_peak(ckpt) and under_time <= 1.10,
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
        # settling, as a user meets it: steps until the plan was final, and the first 20 steps
        # (warm-up and measured ones, consecutive) against as many steady ones (asked: 10, 1.5x)
        "budget_steps_to_settle": [len(b.get("early_steps_ms") or []) for b in workload["budgets"] if "error" not in b],
        "budget_first_steps_vs_steady": [first_steps_vs_steady(b) for b in workload["budgets"] if "error" not in b],
    }


def first_steps_vs_steady(cell: dict[str, Any], n: int = 20) -> dict[str, Any]:
    """A method's first ``n`` steps (its warm-up's, then its measured ones: consecutive) against
    as many of its steady steps (the measured median): ``{"steps": how many it ran, at most n,
    "ratio": ...}``.

    >>> first_steps_vs_steady({"early_steps_ms": [30.0, 20.0], "steps_ms": [10.0, 10.0, 12.0], "step_ms": 10.0})
    {'steps': 5, 'ratio': 1.64}
    """
    steps = ((cell.get("early_steps_ms") or []) + cell["steps_ms"])[:n]
    return {"steps": len(steps), "ratio": round(sum(steps) / (len(steps) * cell["step_ms"]), 4)}


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """Peak memory against step time, one panel per workload, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for ax, wres in zip(axes[0], results):
        m = wres["methods"]
        for key, marker in (("none", "o"), ("checkpoint_all", "s"), ("sac", "P"), ("checkpoint_offload", "X"),
                            ("save_on_cpu", "v"), ("ref", "^"), ("fast", "D")):
            if key not in m or "error" in m[key]:
                continue
            ax.scatter(budget_peak(m[key]) / GiB, m[key]["step_ms"], marker=marker, label=key, zorder=3)
        sel = wres["selective"]
        if sel:
            ax.plot([budget_peak(s) / GiB for s in sel], [s["step_ms"] for s in sel], ":", color="gray",
                    marker=".", label="checkpoint first k blocks")
        cells = [b for b in wres["budgets"] if "error" not in b]
        ax.plot([budget_peak(b) / GiB for b in cells], [b["step_ms"] for b in cells], "-", color="crimson",
                marker="*", markersize=9, label="fast, memory_budget")
        for b in cells:
            ax.axvline(b["budget_bytes"] / GiB, color="crimson", alpha=0.12)
        ax.set_title(wres["workload"])
        ax.set_xlabel("peak device memory reserved (GiB)")
        ax.set_ylabel("step time (ms, log scale)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title + "  (faint lines: the budgets)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m actoffload.tools.budget_sweep [--small] [--models default|hf|all] [--only NAMES]
    [--out FILE.json] [--plot FILE.png] [--include EARLIER.json]``"""
    import argparse
    import json

    from .arguments import UsageError, out_file, plot_file
    from .determinism import use_deterministic
    from .provenance import describe, results_json

    p = argparse.ArgumentParser(prog="python -m actoffload.tools.budget_sweep",
                                description="Memory budgets against no offloading, checkpointing and the other "
                                            "alternatives, workload by workload, at one shape each.")
    p.add_argument("--small", action="store_true", help="tiny workloads (the CPU always uses them)")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--plot", help="peak memory against step time, as a PNG")
    p.add_argument("--models", choices=MODEL_SETS, default="default",
                   help="which workloads: this repository's models (default), transformers' LlamaForCausalLM "
                        "(hf: hf_llama_eager, hf_llama_sdpa, hf_8b_8k, hf_8b_32k), or all")
    p.add_argument("--only", default="", help="comma-separated workloads to run, from any set (default: all of --models)")
    p.add_argument("--include", action="append", default=[], metavar="JSON",
                   help="results of an earlier run on the same GPU: its workloads join these (and are not run "
                        "again), so a sweep can be split over several sessions")
    args = p.parse_args(argv)
    try:  # before any workload runs, not when its results are saved
        if args.out:
            out_file("--out", args.out)
        if args.plot:
            plot_file(args.plot)
    except UsageError as e:
        p.error(str(e))
    earlier: list[dict[str, Any]] = []
    for path in args.include:
        try:
            with open(path) as f:
                earlier += sweep_workloads(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--include {path}: not a budget sweep's results ({e})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or device.type != "cuda"
    only = set(args.only.split(",")) if args.only else set()
    unknown = only - set(workload_names(small))
    if unknown:
        p.error(f"--only: no workload {', '.join(repr(n) for n in sorted(unknown))}{' with --small' if small else ''}; "
                f"valid: {', '.join(workload_names(small))}")
    use_deterministic(True)
    env = describe(device)
    pinning = host_pinning_ms_per_gib() if device.type == "cuda" else None

    def save(results: list[dict[str, Any]]) -> dict[str, Any]:
        results = earlier + results
        doc = {"env": env, "host_pinning_ms_per_gib": pinning, "workloads": results,
               "verdicts": {r["workload"]: verdicts(r) for r in results if "error" not in r}}
        if args.out:
            with open(args.out, "w") as f:
                f.write(results_json(doc))
        return doc

    results = sweep(device, small, log=lambda s: print(s, file=sys.stderr, flush=True),
                    done=save, only=only, skip={r["workload"] for r in earlier}, models=args.models)
    doc = save(results)
    print(json.dumps(doc["verdicts"], indent=1, default=float))
    if args.plot:
        plot([r for r in doc["workloads"] if "error" not in r], args.plot, f"memory budgets on {env['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
