"""Memory budgets in two training loops users run: variable sequence lengths, and gradient
accumulation with evaluation.

``budget_sweep`` measures each workload at one shape. A training loop changes shape from
step to step (batches of several lengths), or runs several forwards per optimizer step and
evaluates now and then; each shape, and each base of memory a step begins on, is a workload
of its own for a budget's plan (docs/budgets.md, "A plan per workload"). This tool runs
both loops on the Llama-style decoder and the GPT-MoE of ``budget_sweep`` (the same model
classes and sizes, built here with a length per step; each block's three parts a group), and on
request (``--only hf_llama_eager``) on its transformers ``LlamaForCausalLM`` with eager attention
(its layers wrapped whole, called by the model's own forward), every method side by side in one
process on one card:

- **variable lengths**: ``--steps`` training steps (forward, backward, an SGD step), each at
  a length drawn by a seeded generator from 1/4, 1/2, 3/4 and all of the workload's sequence
  length, the same draw for every method. Methods: no offloading (run twice: the second run
  shows whether the loop repeats bit for bit at all), activation checkpointing of every block
  (non-reentrant), and fast with a ``memory_budget`` (the blocks' parts, :attr:`LoopWorkload.parts`;
  a fresh offloader per budget) at five budgets:
  checkpointing's peak, halfway from it to no offloading's, no offloading's, 1.25 times
  checkpointing's, and the least peak a plan reaches (read from the run at checkpointing's
  peak);
- **accumulation**: 4 micro-batches (forward and backward each) per AdamW step at the full
  length, ``zero_grad`` after it, and every 5 optimizer steps an evaluation forward under
  ``torch.no_grad()`` and ``model.eval()``; no offloading (twice), checkpointing, and budgets
  at checkpointing's peak, halfway, and no offloading's peak.

Every step's wall time (the device synchronized before and after) and, on CUDA, its peak
reserved and allocated device memory: the peak counters are reset as the step begins, and,
since the offloader resets them too inside a step (its budget measures its own window), read
just before each of its resets (:class:`Peaks`), so a step's peak covers all of it. Before
each method the allocator's cache is emptied, so that its reserved peaks are its own. A
budget here is a method's *reserved* peak, the memory the process holds, while the plan
bounds what is allocated: the reserved figures show what the allocator's cache adds.
Gradients (and the parameters at the end of the accumulation loop, and its evaluation
losses) are compared with no offloading's, step by step, bit for bit through fingerprints
(:class:`Fingerprint`): every step's gradients of every method, kept whole, would fill the
host's memory. The figures the sweep is asked about (no step over its budget, the time against
checkpointing's at its peak and at the halfway budget, bitwise) are reported with whether each
meets the ask (``verdicts``'s ``asks``), never asserted: the tool's exit status does not
depend on them.

On the CPU (always ``--small``: tiny models) there is no allocator to read: the peaks are
``None``, and the budgets stand on the bytes each method's forward saves for backward at the
full length (what a budget counts on the CPU, docs/budgets.md), plus the least margin the
plan adds to every modelled peak, so that every code path runs; no figure of it is a GPU's.

Example::

    python -m actoffload.tools.loop_sweep --out loops.json.gz              # a GPU, both workloads (.gz: compressed)
    python -m actoffload.tools.loop_sweep --out loops.json --only llama --steps 24
    python -m actoffload.tools.loop_sweep --small --steps 12 --opt-steps 5 --out small.json   # the CPU
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint

import actoffload as ao
from actoffload import compat
from actoffload.budget import BudgetTooSmall
from actoffload.budget.tolerances import least_margin

from .models import GPT, GPTConfig, Llama, LlamaConfig, block_parts, next_token_loss
from .peaks import Peaks
from .plan_trace import PlanTrace
from .sweep_models import Call, hf_shape, llama_for_causal_lm, plain, routed
from .workloads import sync

GiB = 1 << 30
QUARTERS = (1, 2, 3, 4)  # a step's length: this many quarters of the full length
PADDED_TO = 8  # ... or, with ``--lengths any``, any multiple of this from a quarter of it to all of it
SPREADS = ("quarters", "any")
MICRO_BATCHES = 4
EVAL_EVERY = 5  # optimizer steps
SGD_LR = 1e-3
ADAMW_LR = 1e-4
TRIES = 3  # a step whose forward raised BudgetTooSmall runs again (it is raised once per workload)
WARM_UP_BUDGET = 1 << 50  # bytes: a budget every plan fits, for the warm-up
# The figures the sweep is asked about, reported against these (never asserted): a budget's
# total time over checkpointing's at checkpointing's peak, and at the halfway budget.
ASK_AT_CHECKPOINT_PEAK = 1.00
ASK_AT_HALFWAY = 0.90

# ---------------------------------------------------------------- workloads
@dataclass
class LoopWorkload:
    """A model and how a step runs it at any length up to ``seq_len``: ``tokens(key, length)``
    makes a batch (the same for every method: seeded by ``key``), ``loss(call, tokens)`` runs
    the forward with each block called through ``call`` (``_logits(call, ids)``: the model's
    logits so). ``embed`` is the module every forward calls once, outside the blocks (never
    checkpointed or recomputed): counting its calls counts forwards. ``parts``: what
    :func:`actoffload.wrap` gets as the blocks' parts (``None``: each block whole)."""

    name: str
    model: torch.nn.Module
    blocks: torch.nn.ModuleList
    embed: torch.nn.Module
    seq_len: int
    batch: int
    vocab: int
    device: torch.device
    _logits: Callable[[Call, torch.Tensor], torch.Tensor]
    parts: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = block_parts

    def tokens(self, key: int, length: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1_000_003 + key)
        return torch.randint(0, self.vocab, (self.batch, length + 1), generator=gen).to(self.device)

    def loss(self, call: Call, tokens: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self._logits(call, tokens[:, :-1]).float(), tokens[:, 1:])


def _stacked(blocks: torch.nn.ModuleList, embed: Callable[[torch.Tensor], torch.Tensor],
             head: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Call, torch.Tensor], torch.Tensor]:
    """The logits of a model that embeds, runs ``blocks`` in turn, and projects."""
    def logits(call: Call, ids: torch.Tensor) -> torch.Tensor:
        h = embed(ids)
        for i, b in enumerate(blocks):
            h = call(i, b, h)
        return head(h)

    return logits


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def llama(device: torch.device, small: bool) -> LoopWorkload:
    """budget_sweep's Llama-style decoder (d2048, 8 layers, GQA 16/4, 4 x 2048 tokens; tiny
    with ``small``), run at any length up to its sequence length."""
    torch.manual_seed(0)
    cfg = (LlamaConfig(seq_len=32, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn=172) if small else
           LlamaConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_kv_heads=4, n_layers=8, ffn=5632))
    model = Llama(cfg).to(device=device, dtype=_dtype(device))
    return LoopWorkload("llama", model, model.blocks, model.embed, cfg.seq_len, 2 if small else 4, cfg.vocab_size,
                        device, _stacked(model.blocks, model.embed, lambda h: model.head(model.norm(h))))


def gpt_moe(device: torch.device, small: bool) -> LoopWorkload:
    """budget_sweep's GPT-MoE (d1024, 8 layers, top-2 of 8 experts, eager attention, 16 x 1024
    tokens; tiny with ``small``), run at any length up to its sequence length."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512 if small else 8192, seq_len=32 if small else 1024, d_model=64 if small else 1024,
                    n_heads=4 if small else 16, n_layers=2 if small else 8, attention="eager",
                    n_experts=4 if small else 8, top_k=2)
    model = GPT(cfg).to(device=device, dtype=_dtype(device))
    assert model.embed is not None

    def embed(x: torch.Tensor) -> torch.Tensor:
        return model.embed(x) + model.pos[: x.shape[1]]  # type: ignore[misc]

    return LoopWorkload("gpt_moe", model, model.blocks, model.embed, cfg.seq_len, 2 if small else 16,
                        cfg.vocab_size, device, _stacked(model.blocks, embed, lambda h: model.head(model.ln_f(h))))


def hf_llama_eager(device: torch.device, small: bool) -> LoopWorkload:
    """budget_sweep's ``hf_llama_eager``: transformers' ``LlamaForCausalLM`` (random init from a
    config; d2048, 8 layers, GQA 16/4, eager attention, 4 x 2048 tokens; tiny with ``small``),
    its layers wrapped whole and called by the model's own forward (with their position ids,
    rotary embeddings and mask), run at any length up to its sequence length. Raises
    ``ImportError`` without transformers."""
    shape = hf_shape("hf_llama_eager", small)
    model = llama_for_causal_lm(shape, device, _dtype(device))
    layers = model.model.layers

    def logits(call: Call, ids: torch.Tensor) -> torch.Tensor:
        with routed(layers, call):
            return model(input_ids=ids).logits

    return LoopWorkload("hf_llama_eager", model, layers, model.model.embed_tokens, shape.seq, shape.batch,
                        shape.vocab, device, logits, parts=None)


WORKLOADS: dict[str, Callable[[torch.device, bool], LoopWorkload]] = {
    "llama": llama, "gpt_moe": gpt_moe, "hf_llama_eager": hf_llama_eager}
DEFAULT = ("llama", "gpt_moe")  # what runs without --only (transformers' is asked for by name)


def draw_lengths(full: int, steps: int, seed: int = 0, spread: str = "quarters") -> list[int]:
    """``steps`` lengths drawn by a generator seeded with ``seed``, the same list for every
    method: each 1/4, 1/2, 3/4 or all of ``full`` (``spread="quarters"``), or any multiple of
    :data:`PADDED_TO` from a quarter of ``full`` to all of it (``"any"``: batches padded to
    their longest sequence, as a data collator pads them, so that few lengths recur).

    Example::

        draw_lengths(2048, 4)               # four of 512, 1024, 1536, 2048
        draw_lengths(2048, 4, spread="any")  # four of 512, 520, ..., 2048
    """
    if spread not in SPREADS:
        raise ValueError(f"spread {spread!r} is not one of {', '.join(SPREADS)}")
    rng = random.Random(seed)
    if spread == "any":
        step = min(PADDED_TO, full)
        low = max(step, full // len(QUARTERS) // step * step)
        return [rng.randrange(low, full + 1, step) if low < full else full for _ in range(steps)]
    return [max(1, full * rng.choice(QUARTERS) // len(QUARTERS)) for _ in range(steps)]


# ---------------------------------------------------------------- measuring
class Fingerprint:
    """A short digest of tensors' exact bits, computed on their device, for comparing many
    steps' gradients bit for bit without keeping them. Each tensor is read as 16-bit words,
    in chunks of ``chunk``; per chunk, two sums of the words times fixed pseudo-random weights
    below 2**27 (exact in int64: no sum can overflow); the digest is SHA-256 over the shapes,
    dtypes and sums. A difference in any one word always changes it; more differences hide
    only where they cancel exactly in both weighted sums. The work buffers are made once
    (``4 * chunk * 8`` bytes on the device) and kept, so fingerprinting leaves the allocator's
    cache nearly as it was (the sums take a few small blocks).

    Example::

        fp = Fingerprint(device)
        fp([p.grad for p in model.parameters()])      # '3f0a...' (32 hex digits)
    """

    def __init__(self, device: torch.device, chunk: int = 1 << 20):
        gen = torch.Generator().manual_seed(20261127)
        self.chunk = chunk
        self.weights = torch.randint(1, 1 << 27, (2, chunk), generator=gen, dtype=torch.int64).to(device)
        self.work = torch.empty(2, chunk, dtype=torch.int64, device=device)

    def _words(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().contiguous().reshape(-1)
        if flat.element_size() % 2:
            return flat.view(torch.uint8)
        return flat.view(torch.int16)

    def __call__(self, tensors: Sequence[torch.Tensor | None]) -> str:
        h = hashlib.sha256()
        sums = []
        for t in tensors:
            if t is None:
                h.update(b"None;")
                continue
            h.update(f"{tuple(t.shape)} {t.dtype};".encode())
            words = self._words(t)
            for start in range(0, words.numel(), self.chunk):
                part = words[start:start + self.chunk]
                n = part.numel()
                work = self.work[:, :n]
                work.copy_(part.expand(2, n))
                work.mul_(self.weights[:, :n])
                sums.append(work.sum(dim=1))
        if sums:
            h.update(torch.cat(sums).cpu().numpy().tobytes())
        return h.hexdigest()[:32]


def _checkpointed(i: int, b: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(b, *args, use_reentrant=False, **kwargs)


@dataclass
class Method:
    """A method of a loop: ``name``; every block checkpointed; or a memory budget (bytes) at
    budget level ``level``."""

    name: str
    checkpoint: bool = False
    budget: int | None = None
    level: str | None = None

    def call(self) -> Call:
        return _checkpointed if self.checkpoint else plain


class _Loop:
    """What one method's run shares: the workload, its initial parameters (restored before
    each method), the peaks, the fingerprints, the log."""

    def __init__(self, w: LoopWorkload, log: Callable[[str], None]):
        self.w, self.log, self.device = w, log, w.device
        self.initial = {k: v.detach().to("cpu", copy=True) for k, v in w.model.state_dict().items()}
        self.params = list(w.model.parameters())
        self.fingerprint = Fingerprint(w.device)
        self.peaks = Peaks(w.device)
        self.gc_passes: dict[str, Any] = {}  # the garbage collector in the latest timed call (see timed)
        # the device memory the allocator took and gave back over the latest method's run (CUDA):
        # a budget's allocator collecting idle blocks (budget/reclaim.py) shows in "freed"
        self.segments: dict[str, int] | None = None
        # the embedding's calls, by torch.is_grad_enabled() (training forwards, evaluations)
        self.forwards: collections.Counter[bool] = collections.Counter()
        w.embed.register_forward_hook(lambda module, args, out: self.forwards.update([torch.is_grad_enabled()]))

    @contextmanager
    def method(self, m: Method) -> Iterator[ao.Offloader | None]:
        """A fresh start for one method: the initial parameters, no gradients, the caches
        emptied (host and device); its offloader wrapping the blocks for the whole run."""
        w = self.w
        for p in self.params:
            p.grad = None
        w.model.load_state_dict(self.initial)
        w.model.train()
        gc.collect()
        compat.empty_host_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before = _segment_counts(self.device)
        off: ao.Offloader | None = None
        if m.budget is not None:
            off = ao.Offloader(impl="fast", device=self.device, memory_budget=m.budget)
        handle = ao.wrap(w.blocks, off, parts=w.parts) if off is not None else None
        try:
            with self.peaks:  # its steps' peaks, read across the budget's own resets
                yield off
        finally:
            if handle is not None:
                handle.remove()
            for p in self.params:
                p.grad = None
            after = _segment_counts(self.device)
            self.segments = None if before is None or after is None else {
                "allocated": after[0] - before[0], "freed": after[1] - before[1]}

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float, int | None, int | None]:
        """``fn()``, its seconds (the device synchronized before and after) and its peaks; the
        garbage collector's passes meanwhile go to :attr:`gc_passes` (a step's host time
        beyond its kernels: the plan's, or the collector's)."""
        sync(self.device)
        self.peaks.start()
        passes: list[tuple[int, float]] = []
        started: dict[int, float] = {}

        def note(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[info["generation"]] = time.perf_counter()
            elif info["generation"] in started:
                passes.append((info["generation"], time.perf_counter() - started.pop(info["generation"])))

        gc.callbacks.append(note)
        try:
            t0 = time.perf_counter()
            out = fn()
            sync(self.device)
            seconds = time.perf_counter() - t0
        finally:
            gc.callbacks.remove(note)
        self.gc_passes = {"passes": len(passes), "oldest": max((g for g, _ in passes), default=None),
                            "seconds": sum(s for _, s in passes)}
        reserved, allocated = self.peaks.read()
        return out, seconds, reserved, allocated

    def forward(self, m: Method, tokens: torch.Tensor, raised: list[str]) -> torch.Tensor:
        """The loss of a training forward; where the budget raises :class:`BudgetTooSmall` as
        the step begins (once per workload, before anything is saved), noted in ``raised`` and
        run again, as a loop that goes on would (it then runs the least-memory plan)."""
        for _ in range(TRIES):
            try:
                return self.w.loss(m.call(), tokens)
            except BudgetTooSmall as e:
                raised.append(str(e))
        return self.w.loss(m.call(), tokens)


def _plan_reading(off: ao.Offloader, trace: PlanTrace) -> dict[str, Any]:
    """What the plan says after a step, and the plan that ran in it (``trace``'s); the counters
    (planning seconds, cache trims, host allocations) are running totals: a step's share is the
    difference from the step before."""
    stats = off.stats()
    plan = stats.get("plan", {})
    workload = plan.get("workload") or {}
    return {"signature": workload.get("signature"), "tokens": workload.get("tokens"), "ran": trace.ran(plan),
            "actions": [g["action"] for g in plan.get("groups", [])], "state": plan.get("state"),
            "settled": plan.get("settled"), "smallest_reachable_bytes": plan.get("smallest_reachable_bytes"),
            # the offloader's own window (from its first group to the end of backward), on CUDA
            "measured_peak_bytes": plan.get("measured_peak_bytes"),
            "measured_reserved_peak_bytes": plan.get("measured_reserved_peak_bytes"),
            "allocator_reserve_bytes": plan.get("allocator_reserve_bytes"), "cache_trims": plan.get("cache_trims"),
            "cache_trims_by": plan.get("cache_trims_by"), "cache_bound": plan.get("cache_bound"),
            "allocator_reclaim": plan.get("allocator_reclaim"),
            "planning_s_all": workload.get("planning_s_all"), "planning_by_all": workload.get("planning_by_all"),
            "background_planning_s_all": workload.get("background_planning_s_all"),
            "host_allocations": stats.get("host_allocations")}


def _plan_summary(off: ao.Offloader) -> dict[str, Any]:
    plan = off.stats().get("plan", {})
    out = {k: v for k, v in plan.items() if k not in ("groups", "profile", "tried")}
    out["actions"] = [g["action"] for g in plan.get("groups", [])]
    return out


def workload_records(off: ao.Offloader) -> list[dict[str, Any]]:
    """Each signature's controller, kept or parked, as a run left it (its ``stats()``: the profile its plans are
    modelled on, the plans it ran with their measured peaks and times, the plan, the budget, the
    margin and the reserve), so that why a signature settled where it did can be looked into on
    the CPU (``benchmarks/settle_replay.py`` reads a profile so). The latest step's signature
    alone is in ``stats()["plan"]``.

    Example::

        records = workload_records(off)   # [{"signature": "[4, 2048, 2048] ...", "profile": {...}, ...}, ...]
    """
    out = []
    workloads = off.plan.workloads
    for wl in workloads.parked + workloads.workloads:
        stats = wl.controller.stats()
        out.append({"signature": str(wl.signature), "tokens": wl.signature.tokens, "steps": wl.steps,
                    "parked": wl in workloads.parked,
                    "predicted_from": None if wl.predicted_from is None else str(wl.predicted_from),
                    **{k: v for k, v in stats.items() if k != "groups"},
                    "actions": [g["action"] for g in stats.get("groups", [])]})
    return out


def steps_to_settle(readings: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per signature (as ``stats()["plan"]["workload"]`` names it), how many of its steps ran
    until the reading after one said its plan was settled (that step counted); ``None``: never.
    Workloads of one signature on different bases (accumulation's first micro-batch, with no
    gradients yet, and the others) share the signature: the first of them to settle counts.

    Example::

        steps_to_settle([{"signature": "a", "settled": False}, {"signature": "a", "settled": True}])   # {'a': 2}
    """
    seen: collections.Counter[str] = collections.Counter()
    out: dict[str, int | None] = {}
    for r in readings:
        sig = str(r.get("signature"))
        seen[sig] += 1
        if out.get(sig) is None:
            out[sig] = seen[sig] if r.get("settled") else None
    return out


def _segment_counts(device: torch.device) -> tuple[int, int] | None:
    """How many blocks the caching allocator has taken from the device and given back so far
    (``cudaMalloc`` and ``cudaFree`` calls); ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_device_alloc", 0)), int(stats.get("num_device_free", 0))


# ---------------------------------------------------------------- the two loops
def run_variable(loop: _Loop, m: Method, lengths: list[int]) -> dict[str, Any]:
    """One method over ``lengths``: per step its length, seconds (forward, backward, the SGD
    step), peaks, and a fingerprint of the gradients the SGD step used (taken after it, before
    ``zero_grad``: SGD reads the gradients, never writes them); with a budget, the plan's
    state after each step."""
    w = loop.w
    rec: dict[str, Any] = {"method": m.name, "lengths": list(lengths), "steps_s": [], "reserved_bytes": [],
                           "allocated_bytes": [], "fingerprints": [], "budget_too_small": []}
    if m.budget is not None:
        rec.update(level=m.level, budget_bytes=m.budget, plan_steps=[])
    trace = PlanTrace()
    t_start = time.perf_counter()
    with loop.method(m) as off:
        opt = torch.optim.SGD(loop.params, lr=SGD_LR)
        for i, length in enumerate(lengths):
            tokens = w.tokens(i, length)

            def step() -> None:
                loop.forward(m, tokens, rec["budget_too_small"]).backward()
                opt.step()

            _, seconds, reserved, allocated = loop.timed(step)
            rec["steps_s"].append(seconds)
            rec["reserved_bytes"].append(reserved)
            rec["allocated_bytes"].append(allocated)
            rec["fingerprints"].append(loop.fingerprint([p.grad for p in loop.params]))
            opt.zero_grad(set_to_none=True)
            if off is not None:
                rec["plan_steps"].append({**_plan_reading(off, trace), "gc": loop.gc_passes})
            if (i + 1) % 12 == 0 or i + 1 == len(lengths):
                loop.log(f"  {w.name} lengths {m.name}{_at(m)}: {i + 1}/{len(lengths)} steps, "
                         f"{sum(rec['steps_s']):.1f} s of steps, {time.perf_counter() - t_start:.1f} s")
        if off is not None:
            rec["plan"] = _plan_summary(off)
            rec["workloads"] = workload_records(off)
    rec["device_segments"] = loop.segments
    rec["total_s"] = sum(rec["steps_s"])
    rec["max_reserved_bytes"] = _max(rec["reserved_bytes"])
    rec["max_allocated_bytes"] = _max(rec["allocated_bytes"])
    return rec


def run_accumulation(loop: _Loop, m: Method, opt_steps: int) -> dict[str, Any]:
    """One method over ``opt_steps`` optimizer steps of ``MICRO_BATCHES`` micro-batches at the
    full length (each loss divided by their count, gradients accumulating), an AdamW step and
    ``zero_grad`` after the last, and every ``EVAL_EVERY`` optimizer steps an evaluation forward
    (``model.eval()``, ``torch.no_grad()``, then ``model.train()``). Records each micro-batch,
    optimizer step and evaluation: seconds and peaks; per optimizer step the fingerprint of the
    gradients before the optimizer reads them, and the training forwards that ran (counted by
    the embedding's calls; a forward the budget stopped with ``BudgetTooSmall`` and ran again
    counted once); the evaluation losses; the parameters' fingerprint at the end."""
    w = loop.w
    rec: dict[str, Any] = {"method": m.name, "records": [], "grad_fingerprints": [], "eval_losses": [],
                           "forwards_per_optimizer_step": [], "eval_forwards": [], "budget_too_small": []}
    if m.budget is not None:
        rec.update(level=m.level, budget_bytes=m.budget, plan_steps=[])
    trace = PlanTrace()
    eval_tokens = w.tokens(999_999, w.seq_len)
    t_start = time.perf_counter()
    with loop.method(m) as off:
        opt = torch.optim.AdamW(loop.params, lr=ADAMW_LR)
        for k in range(opt_steps):
            loop.forwards.clear()
            raised_before = len(rec["budget_too_small"])
            for j in range(MICRO_BATCHES):
                tokens = w.tokens(100_000 + MICRO_BATCHES * k + j, w.seq_len)

                def micro() -> None:
                    (loop.forward(m, tokens, rec["budget_too_small"]) / MICRO_BATCHES).backward()

                _, seconds, reserved, allocated = loop.timed(micro)
                rec["records"].append({"kind": "micro", "optimizer_step": k, "micro_batch": j, "s": seconds,
                                       "reserved_bytes": reserved, "allocated_bytes": allocated})
                if off is not None:
                    rec["plan_steps"].append({**_plan_reading(off, trace), "gc": loop.gc_passes})
            rec["grad_fingerprints"].append(loop.fingerprint([p.grad for p in loop.params]))
            rec["forwards_per_optimizer_step"].append(loop.forwards[True]
                                                      - (len(rec["budget_too_small"]) - raised_before))

            def optimizer() -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)

            _, seconds, reserved, allocated = loop.timed(optimizer)
            rec["records"].append({"kind": "optimizer", "optimizer_step": k, "s": seconds,
                                   "reserved_bytes": reserved, "allocated_bytes": allocated})
            if (k + 1) % EVAL_EVERY == 0:
                loop.forwards.clear()

                def evaluate() -> float:
                    w.model.eval()
                    with torch.no_grad():
                        loss = w.loss(m.call(), eval_tokens).item()
                    w.model.train()
                    return loss

                loss, seconds, reserved, allocated = loop.timed(evaluate)
                rec["records"].append({"kind": "eval", "optimizer_step": k, "s": seconds,
                                       "reserved_bytes": reserved, "allocated_bytes": allocated})
                rec["eval_losses"].append(loss)
                rec["eval_forwards"].append(loop.forwards[False])
            if (k + 1) % 5 == 0 or k + 1 == opt_steps:
                loop.log(f"  {w.name} accumulation {m.name}{_at(m)}: {k + 1}/{opt_steps} optimizer steps, "
                         f"{sum(r['s'] for r in rec['records']):.1f} s of steps, {time.perf_counter() - t_start:.1f} s")
        rec["param_fingerprint"] = loop.fingerprint(loop.params)
        if off is not None:
            rec["plan"] = _plan_summary(off)
            rec["workloads"] = workload_records(off)
    rec["device_segments"] = loop.segments
    rec["total_s"] = sum(r["s"] for r in rec["records"])
    rec["max_reserved_bytes"] = _max([r["reserved_bytes"] for r in rec["records"]])
    rec["max_allocated_bytes"] = _max([r["allocated_bytes"] for r in rec["records"]])
    return rec


def _max(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _at(m: Method) -> str:
    return f" at {m.budget / GiB:.2f} GiB" if m.budget is not None and m.budget >= (1 << 24) else (
        f" at {m.budget} B" if m.budget is not None else "")


def saved_bytes_at_full_length(loop: _Loop, checkpoint: bool) -> int:
    """The CPU's stand-in for a method's peak: the bytes a training forward at the full length
    leaves saved for backward, parameters not counted; with every block checkpointed, the
    saves outside the blocks and the blocks' inputs (what checkpointing keeps)."""
    from .saved_tracker import SavedTracker

    w = loop.w
    inputs = 0

    def call(i: int, b: torch.nn.Module, h: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal inputs
        if not checkpoint:
            return b(h, *args, **kwargs)
        inputs += h.numel() * h.element_size()
        return _checkpointed(i, b, h, *args, **kwargs)

    with loop.method(Method("stand-in")):
        with SavedTracker(exclude=loop.params) as tracker:
            loss = w.loss(call, w.tokens(0, w.seq_len))
        saved = tracker.resident_bytes() + inputs
        loss.backward()
        del loss
    return saved


def _warm_up(loop: _Loop, lengths: list[int]) -> None:
    """A forward and backward at each length, plain and checkpointed, then two steps under a
    budget that everything fits, before any method is measured: the first method would
    otherwise pay for what a process does once (loading kernels, making handles, compiling
    fast's Triton kernels, measuring the bus), where the others do not."""
    w = loop.w
    with loop.method(Method("warm-up")):
        for n in sorted(set(lengths)):
            for call in (plain, _checkpointed):
                w.loss(call, w.tokens(0, n)).backward()
    with loop.method(Method("warm-up", budget=WARM_UP_BUDGET)):
        for _ in range(2):  # its profiling steps: every kind of copy, and the bus measured
            w.loss(plain, w.tokens(0, max(lengths))).backward()
    sync(loop.device)


# ---------------------------------------------------------------- one workload
def sweep_workload(w: LoopWorkload, steps: int, opt_steps: int, seed: int, log: Callable[[str], None],
                   save: Callable[[], object] = lambda: None, out: dict[str, Any] | None = None,
                   spread: str = "quarters") -> dict[str, Any]:
    """Both loops on one workload, every method in turn, filling ``out`` (a new dict if not
    given) as they finish, and calling ``save()`` after each method (``spread``: the lengths'
    draw, :func:`draw_lengths`)."""
    loop = _Loop(w, log)
    cuda = w.device.type == "cuda"
    lengths = draw_lengths(w.seq_len, steps, seed, spread)
    out = {} if out is None else out
    out.update({"workload": w.name, "blocks": len(w.blocks), "seq_len": w.seq_len, "batch": w.batch,
                "parameters": sum(p.numel() for p in loop.params),
                "peaks": "max_memory_reserved" if cuda else
                "the CPU: no allocator; each budget is the bytes its method saved at the full length, plus the "
                "plan's least margin (1 MiB)"})
    with loop.peaks:
        log(f"loop sweep: {w.name}: warm-up at lengths {sorted(set(lengths))}")
        _warm_up(loop, lengths)
        stand_in: dict[str, int] = {}
        if not cuda:
            stand_in = {"none": saved_bytes_at_full_length(loop, False),
                        "checkpoint_all": saved_bytes_at_full_length(loop, True)}
            out["cpu_saved_bytes"] = stand_in

        def peak_of(r: dict[str, Any], name: str) -> int:
            return r["max_reserved_bytes"] if cuda else stand_in[name]

        def baselines(section: dict[str, Any], what: str, run: Callable[[Method], dict[str, Any]]) -> tuple[int, int]:
            """No offloading (twice) and checkpointing every block, into ``section``: their peaks."""
            for m in (Method("none"), Method("none_again"), Method("checkpoint_all", checkpoint=True)):
                log(f"loop sweep: {w.name}: {what}, {m.name}")
                section["methods"][m.name] = run(m)
                save()
            return (peak_of(section["methods"]["none"], "none"),
                    peak_of(section["methods"]["checkpoint_all"], "checkpoint_all"))

        def method(level: str, budget: int) -> Method:
            # on the CPU, plus the least margin the plan adds to every modelled peak (1 MiB),
            # which the tiny models' bytes would never clear: every level would plan alike
            return Method("fast_budget", budget=max(1, budget if cuda else budget + least_margin(budget)),
                          level=level)

        # ---- variable lengths
        var: dict[str, Any] = {"lengths": lengths, "quarters_of": w.seq_len, "spread": spread, "seed": seed, "methods": {},
                               "budgets": []}
        out["variable_length"] = var
        none_peak, ckpt_peak = baselines(var, "variable lengths", lambda m: run_variable(loop, m, lengths))
        levels: list[tuple[str, int | None]] = [
            ("checkpoint_all_peak", ckpt_peak), ("halfway", (ckpt_peak + none_peak) // 2),
            ("none_peak", none_peak), ("checkpoint_all_peak_x1.25", int(ckpt_peak * 1.25)),
            ("smallest_reachable", None)]
        for level, budget in levels:
            if level == "smallest_reachable":
                budget, note = _smallest_reachable(var["budgets"][0] if var["budgets"] else None)
                var["smallest_reachable"] = {"bytes": budget, "note": note}
                if budget is None:
                    var["budgets"].append({"level": level, "skipped": note})
                    log(f"loop sweep: {w.name}: variable lengths, budget {level} skipped: {note}")
                    save()
                    continue
            assert budget is not None
            m = method(level, budget)
            log(f"loop sweep: {w.name}: variable lengths, budget {level}{_at(m)}")
            var["budgets"].append(_guarded(lambda: run_variable(loop, m, lengths), m, log))
            save()

        # ---- accumulation with evaluation
        acc: dict[str, Any] = {"optimizer_steps": opt_steps, "micro_batches": MICRO_BATCHES,
                               "eval_every": EVAL_EVERY, "length": w.seq_len, "methods": {}, "budgets": []}
        out["accumulation"] = acc
        none_peak, ckpt_peak = baselines(acc, "accumulation", lambda m: run_accumulation(loop, m, opt_steps))
        for level, budget in (("checkpoint_all_peak", ckpt_peak), ("halfway", (ckpt_peak + none_peak) // 2),
                              ("none_peak", none_peak)):
            m = method(level, budget)
            log(f"loop sweep: {w.name}: accumulation, budget {level}{_at(m)}")
            acc["budgets"].append(_guarded(lambda: run_accumulation(loop, m, opt_steps), m, log))
            save()
    return out


def _smallest_reachable(at_checkpoint_peak: dict[str, Any] | None) -> tuple[int | None, str]:
    """The least peak a plan reaches, from the run at checkpointing's peak: per signature the
    latest ``smallest_reachable_bytes`` its steps read, and the largest of those (the longest
    length's, which every step must fit)."""
    if at_checkpoint_peak is None or "error" in at_checkpoint_peak:
        return None, "the run at checkpointing's peak did not complete"
    latest: dict[str, int] = {}
    for r in at_checkpoint_peak.get("plan_steps", []):
        if r.get("smallest_reachable_bytes") is not None:
            latest[str(r["signature"])] = r["smallest_reachable_bytes"]
    if not latest:
        return None, "stats()['plan'] had no smallest_reachable_bytes in the run at checkpointing's peak"
    return max(latest.values()), (f"the largest over {len(latest)} signatures of stats()['plan']"
                                  "['smallest_reachable_bytes'] (each its latest), in the run at checkpointing's peak")


def _guarded(run: Callable[[], dict[str, Any]], m: Method, log: Callable[[str], None]) -> dict[str, Any]:
    """A budget's run, or its error (the sweep goes on)."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001  report it, keep what the others measure
        log(f"  failed: {type(e).__name__}: {e}")
        return {"method": m.name, "level": m.level, "budget_bytes": m.budget, "error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------- verdicts
def _over(values: Sequence[int | None], budget: int) -> int | None:
    known = [v for v in values if v is not None]
    return sum(v > budget for v in known) if known else None


def _over_from_first_group(plan_steps: Sequence[dict[str, Any]], budget: int) -> int | None:
    """Steps whose reserved peak went over ``budget`` as the offloader reads it, from the step's
    first group (``measured_reserved_peak_bytes``), where this sweep reads it from before the
    step's forward: a cache over the budget that a step gives back as its first group opens
    counts in this sweep's window, not in the offloader's (``None``: not measured, the CPU)."""
    return _over([p.get("measured_reserved_peak_bytes") for p in plan_steps], budget)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _plan_figures(b: dict[str, Any]) -> dict[str, Any]:
    plan = b.get("plan", {})
    readings = b.get("plan_steps", [])
    return {"plan_state": plan.get("state"), "plan_settled": plan.get("settled"),
            "steps_to_settle": steps_to_settle(readings),
            "signature_tokens": {str(r.get("signature")): r.get("tokens") for r in readings},
            "signatures": len({str(r.get("signature")) for r in readings}),
            "budget_too_small_raised": len(b.get("budget_too_small", [])),
            # host time beyond the kernels, all told: the plan's own, and the garbage collector's
            "planning_s": readings[-1].get("planning_s_all") if readings else None,
            "background_planning_s": readings[-1].get("background_planning_s_all") if readings else None,
            "gc_s": sum((r.get("gc") or {}).get("seconds", 0.0) for r in readings),
            "cache_trims": readings[-1].get("cache_trims") if readings else None,
            "host_allocations": readings[-1].get("host_allocations") if readings else None}


def _variable_verdicts(var: dict[str, Any]) -> dict[str, Any]:
    methods = var["methods"]
    ref = methods["none"]["fingerprints"]
    again = methods["none_again"]["fingerprints"]
    repeats = [a == b for a, b in zip(ref, again)]
    ckpt_s = methods["checkpoint_all"]["total_s"]

    def compared(fps: list[str]) -> dict[str, Any]:
        same = [a == b for a, b in zip(fps, ref)]
        where = [s for s, r in zip(same, repeats) if r]
        return {"bitwise": len(fps) == len(ref) and all(same), "bitwise_steps": sum(same), "steps": len(fps),
                "bitwise_where_none_repeats": all(where)}

    out: dict[str, Any] = {
        "none_repeats_bitwise": all(repeats), "none_repeating_steps": sum(repeats),
        "judged_against": "none" if all(repeats) else
        "none, which did not repeat itself bit for bit: see bitwise_where_none_repeats",
        "methods": {name: {"total_s": r["total_s"], "vs_checkpoint_all": _ratio(r["total_s"], ckpt_s),
                           "max_step_reserved_bytes": r["max_reserved_bytes"],
                           "max_step_allocated_bytes": r["max_allocated_bytes"], **compared(r["fingerprints"])}
                    for name, r in methods.items()},
        "budgets": []}
    for b in var["budgets"]:
        if "skipped" in b or "error" in b:
            out["budgets"].append(dict(b))
            continue
        budget = b["budget_bytes"]
        out["budgets"].append({
            "level": b["level"], "budget_bytes": budget,
            "max_step_reserved_bytes": b["max_reserved_bytes"], "max_step_allocated_bytes": b["max_allocated_bytes"],
            "steps_over_budget": _over(b["reserved_bytes"], budget),
            "steps_over_budget_allocated": _over(b["allocated_bytes"], budget),
            "steps_over_budget_from_first_group": _over_from_first_group(b["plan_steps"], budget),
            "total_s": b["total_s"], "vs_checkpoint_all": _ratio(b["total_s"], ckpt_s),
            **compared(b["fingerprints"]), **_plan_figures(b)})
    return out


def _accumulation_verdicts(acc: dict[str, Any]) -> dict[str, Any]:
    methods = acc["methods"]
    ref = methods["none"]
    again = methods["none_again"]
    ckpt_s = methods["checkpoint_all"]["total_s"]
    repeats = (ref["grad_fingerprints"] == again["grad_fingerprints"] and ref["eval_losses"] == again["eval_losses"]
               and ref["param_fingerprint"] == again["param_fingerprint"])

    def compared(r: dict[str, Any]) -> dict[str, Any]:
        same = [a == b for a, b in zip(r["grad_fingerprints"], ref["grad_fingerprints"])]
        grads = len(same) == len(ref["grad_fingerprints"]) and all(same)
        params = r["param_fingerprint"] == ref["param_fingerprint"]
        evals = r["eval_losses"] == ref["eval_losses"]
        return {"bitwise": grads and params and evals, "bitwise_gradients_steps": sum(same),
                "bitwise_parameters_at_end": params, "bitwise_eval_losses": evals,
                "forwards_per_optimizer_step": sorted(set(r["forwards_per_optimizer_step"])),
                "eval_forwards": sorted(set(r["eval_forwards"]))}

    def by_kind(r: dict[str, Any], key: str, budget: int) -> dict[str, int | None]:
        return {kind: _over([x[key] for x in r["records"] if x["kind"] == kind], budget)
                for kind in ("micro", "optimizer", "eval")}

    out: dict[str, Any] = {
        "none_repeats_bitwise": repeats,
        "judged_against": "none" if repeats else "none, which did not repeat itself bit for bit",
        "methods": {name: {"total_s": r["total_s"], "vs_checkpoint_all": _ratio(r["total_s"], ckpt_s),
                           "max_step_reserved_bytes": r["max_reserved_bytes"],
                           "max_step_allocated_bytes": r["max_allocated_bytes"], **compared(r)}
                    for name, r in methods.items()},
        "budgets": []}
    for b in acc["budgets"]:
        if "error" in b:
            out["budgets"].append(dict(b))
            continue
        budget = b["budget_bytes"]
        kinds = by_kind(b, "reserved_bytes", budget)
        kinds_allocated = by_kind(b, "allocated_bytes", budget)
        out["budgets"].append({
            "level": b["level"], "budget_bytes": budget,
            "max_step_reserved_bytes": b["max_reserved_bytes"], "max_step_allocated_bytes": b["max_allocated_bytes"],
            "steps_over_budget": _sum_known(kinds.values()), "steps_over_budget_by_kind": kinds,
            "steps_over_budget_allocated": _sum_known(kinds_allocated.values()),
            "steps_over_budget_allocated_by_kind": kinds_allocated,
            "total_s": b["total_s"], "vs_checkpoint_all": _ratio(b["total_s"], ckpt_s),
            **compared(b), **_plan_figures(b)})
    return out


def _sum_known(values: Any) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _asks(var: dict[str, Any] | None, acc: dict[str, Any] | None) -> dict[str, Any]:
    """The figures the sweep was asked about, each with whether it meets the ask (``None``
    where it was not measured: the CPU has no reserved peaks)."""

    def cell(cells: list[dict[str, Any]], level: str) -> dict[str, Any]:
        return next((c for c in cells if c.get("level") == level and "error" not in c and "skipped" not in c), {})

    def none_over(cells: list[dict[str, Any]]) -> bool | None:
        if any("error" in c for c in cells):
            return False  # a budget that did not run shows nothing
        over = [c.get("steps_over_budget") for c in cells]
        if not over or any(o is None for o in over):
            return None
        return all(o == 0 for o in over)

    out: dict[str, Any] = {}
    if var is not None:
        cells = [c for c in var["budgets"] if "skipped" not in c]
        at_ckpt, half = cell(cells, "checkpoint_all_peak"), cell(cells, "halfway")
        r_ckpt, r_half = at_ckpt.get("vs_checkpoint_all"), half.get("vs_checkpoint_all")
        out.update({
            "variable_length_budgets_run": sum("error" not in c for c in cells),
            "variable_length_no_step_over_budget": none_over(cells),
            "variable_length_vs_checkpoint_all_at_its_peak": r_ckpt,
            "variable_length_at_its_peak_within_ask": None if r_ckpt is None else r_ckpt <= ASK_AT_CHECKPOINT_PEAK,
            "variable_length_vs_checkpoint_all_at_halfway": r_half,
            "variable_length_at_halfway_within_ask": None if r_half is None else r_half <= ASK_AT_HALFWAY,
            "variable_length_bitwise": bool(cells) and all(c.get("bitwise") for c in cells),
        })
    if acc is not None:
        cells = acc["budgets"]
        out.update({
            "accumulation_budgets_run": sum("error" not in c for c in cells),
            "accumulation_no_step_over_budget": none_over(cells),
            "accumulation_bitwise": bool(cells) and all(c.get("bitwise") for c in cells),
        })
    return out


def verdicts(workload: dict[str, Any]) -> dict[str, Any]:
    """The sweep's figures for one workload, per loop and budget."""
    out: dict[str, Any] = {}
    var = _variable_verdicts(workload["variable_length"]) if _complete(workload.get("variable_length")) else None
    acc = _accumulation_verdicts(workload["accumulation"]) if _complete(workload.get("accumulation")) else None
    if var is not None:
        out["variable_length"] = var
    if acc is not None:
        out["accumulation"] = acc
    out["asks"] = _asks(var, acc)
    return out


def _complete(loop: dict[str, Any] | None) -> bool:
    return loop is not None and {"none", "none_again", "checkpoint_all"} <= set(loop.get("methods", {}))


# ---------------------------------------------------------------- the table
def _size(v: int | None, unit: int) -> str:
    return "-" if v is None else f"{v / unit:.2f}"


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(doc: dict[str, Any]) -> str:
    """A short table of the verdicts, one line per method and budget (sizes in GiB; on the CPU,
    where the budgets stand on saved bytes, in MiB)."""
    cpu = doc["env"].get("gpu") == "cpu"
    unit, unit_name = (1 << 20, "MiB") if cpu else (GiB, "GiB")

    def size(v: int | None) -> str:
        return _size(v, unit)

    lines = []
    head = (f"{'workload':9} {'loop':12} {'method':32} {'budget':>7} {'max res':>8} {'max alloc':>9} "
            f"{'over r/a':>8} {'total s':>8} {'x ckpt':>6} {'bitwise':>7}  plan")
    lines.append(head + f"   (sizes in {unit_name}; over r/a: steps over the budget, reserved/allocated)")
    for name, v in doc["verdicts"].items():
        for loop_name, label in (("variable_length", "lengths"), ("accumulation", "accumulation")):
            lv = v.get(loop_name)
            if lv is None:
                continue
            for method, c in lv["methods"].items():
                lines.append(f"{name:9} {label:12} {method:32} {'-':>7} {size(c['max_step_reserved_bytes']):>8} "
                             f"{size(c['max_step_allocated_bytes']):>9} {'-':>8} {c['total_s']:8.2f} "
                             f"{_fmt(c['vs_checkpoint_all']):>6} {str(c['bitwise']):>7}")
            for c in lv["budgets"]:
                what = f"budget {c.get('level')}"
                if "skipped" in c or "error" in c:
                    lines.append(f"{name:9} {label:12} {what:32} {c.get('skipped') or c.get('error')}")
                    continue
                over = f"{_fmt(c['steps_over_budget'], 'd')}/{_fmt(c['steps_over_budget_allocated'], 'd')}"
                tokens = c.get("signature_tokens", {})
                order = sorted(c["steps_to_settle"], key=lambda sig: tokens.get(sig) or 0)
                settle = ",".join("-" if c["steps_to_settle"][sig] is None else str(c["steps_to_settle"][sig])
                                  for sig in order)
                lines.append(f"{name:9} {label:12} {what:32} {size(c['budget_bytes']):>7} "
                             f"{size(c['max_step_reserved_bytes']):>8} {size(c['max_step_allocated_bytes']):>9} "
                             f"{over:>8} {c['total_s']:8.2f} {_fmt(c['vs_checkpoint_all']):>6} {str(c['bitwise']):>7}  "
                             f"{c['plan_state']}; steps to settle, by signature: {settle}")
        asks = v.get("asks", {})
        lines.append(f"{name:9} asks: " + ", ".join(f"{k}={_fmt(x) if isinstance(x, float) else x}"
                                                    for k, x in asks.items()))
    return "\n".join(lines)


# ---------------------------------------------------------------- main
def sweep(device: torch.device, small: bool, steps: int, opt_steps: int, seed: int = 0,
          only: set[str] | None = None, log: Callable[[str], None] = print,
          done: Callable[[list[dict[str, Any]]], object] = lambda results: None,
          spread: str = "quarters") -> list[dict[str, Any]]:
    """Each workload in turn, those named in ``only`` (default: :data:`DEFAULT`); ``done(results so far)`` after each
    method (``spread``: the lengths' draw, :func:`draw_lengths`). A workload that fails is
    reported with its error and the sweep goes on."""
    if device.type == "cuda":
        from .budget_sweep import _compile_kernels

        _compile_kernels(device)  # Triton's kernels compile once per process, not in a method's first step
    out: list[dict[str, Any]] = []
    for name, build in WORKLOADS.items():
        if name not in (only or DEFAULT):
            continue
        partial: dict[str, Any] = {"workload": name}
        out.append(partial)
        w = None
        try:
            w = build(device, small)
            log(f"loop sweep: {name} ({len(w.blocks)} blocks, {w.batch} x {w.seq_len} tokens at the full length)")
            gc.freeze()  # the model and torch stay: each collection walks only what a step made
            sweep_workload(w, steps, opt_steps, seed, log, save=lambda: done(out), out=partial, spread=spread)
        except Exception as e:  # noqa: BLE001  report it, keep what the others measure
            log(f"loop sweep: {name} failed: {type(e).__name__}: {e}")
            partial["error"] = f"{type(e).__name__}: {e}"
        finally:
            w = None
            gc.unfreeze()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        done(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m actoffload.tools.loop_sweep [--out FILE.json] [--small] [--only llama,gpt_moe]
    [--steps 48] [--opt-steps 20] [--lengths quarters|any]``: 1 where a workload failed as a
    whole, else 0 (whatever the figures say)."""
    from .arguments import UsageError, out_file
    from .determinism import use_deterministic
    from .provenance import describe, write_results

    p = argparse.ArgumentParser(prog="python -m actoffload.tools.loop_sweep",
                                description="Memory budgets in a variable-length loop and in gradient accumulation "
                                            "with evaluation, against no offloading and checkpointing.")
    p.add_argument("--out", help="results JSON (written after each method, so a run cut short keeps its figures)")
    p.add_argument("--small", action="store_true", help="tiny models (the CPU always uses them)")
    p.add_argument("--only", default="", help=f"comma-separated workloads of {', '.join(WORKLOADS)} "
                                              f"(default: {', '.join(DEFAULT)})")
    p.add_argument("--steps", type=int, default=48, help="steps of the variable-length loop (default 48)")
    p.add_argument("--opt-steps", type=int, default=20,
                   help=f"optimizer steps of the accumulation loop, {MICRO_BATCHES} micro-batches each (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths' draw (default 0)")
    p.add_argument("--lengths", choices=SPREADS, default="quarters",
                   help=f"the variable-length loop's lengths: quarters of the full length (default), or any "
                        f"multiple of {PADDED_TO} from a quarter of it to all of it (few recur, as with dynamic padding)")
    args = p.parse_args(argv)
    if args.out:
        try:  # before any method runs, not when its results are saved
            out_file("--out", args.out)
        except UsageError as e:
            p.error(str(e))
    only = set(args.only.split(",")) if args.only else set()
    if only - set(WORKLOADS):
        p.error(f"--only: unknown workload(s) {sorted(only - set(WORKLOADS))}; valid: {', '.join(WORKLOADS)}")
    if args.steps < 1 or args.opt_steps < 1:
        p.error("--steps and --opt-steps must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_deterministic(True)
    small = args.small or device.type != "cuda"
    env = describe(device)
    settings = {"small": small, "steps": args.steps, "quarters": list(QUARTERS), "lengths": args.lengths,
                "seed": args.seed,
                "optimizer_steps": args.opt_steps, "micro_batches": MICRO_BATCHES, "eval_every": EVAL_EVERY,
                "variable_length_optimizer": f"SGD lr={SGD_LR}", "accumulation_optimizer": f"AdamW lr={ADAMW_LR}",
                "dtype": str(_dtype(device)), "attention": "eager",
                "bitwise": "Fingerprint: per 2**20 16-bit words two exact weighted sums, SHA-256 over them",
                "steps_to_settle": "per signature, from stats()['plan'] read after every step",
                "peaks": ("torch.cuda.max_memory_reserved / max_memory_allocated over each step, read across the "
                          "offloader's own resets" if device.type == "cuda" else "None on the CPU")}
    t0 = time.perf_counter()

    def log(line: str) -> None:  # progress, on stderr, with the time since the start
        print(f"[{time.perf_counter() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)

    def save(results: list[dict[str, Any]]) -> dict[str, Any]:
        doc = {"env": env, "settings": settings, "workloads": results,
               "verdicts": {r["workload"]: verdicts(r) for r in results if "variable_length" in r}}
        if args.out:
            write_results(args.out, doc)
        return doc

    results = sweep(device, small, args.steps, args.opt_steps, args.seed, only, log=log, done=save,
                    spread=args.lengths)
    doc = save(results)
    print(table(doc), flush=True)
    print(f"loop sweep: {time.perf_counter() - t0:.1f} s on {env['gpu']}" + (f"; {args.out}" if args.out else ""),
          flush=True)
    failed = [r["workload"] for r in results if "error" in r]
    if failed:  # the tool broke (a budget's own failure is one of its figures, reported in its cell)
        print(f"loop sweep: failed: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
