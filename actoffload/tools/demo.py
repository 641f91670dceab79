"""``actoffload demo``: train a small GPT-MoE without and with offloading, side by side.

Every configuration (no offload, no offload again, ``torch.autograd.graph.save_on_cpu``,
``ref``, ``fast``) trains the same model from the same seed on the same batches. The
table says whether each loss matched the run without an offloader bit for bit, how many
bytes moved per step, what stayed resident after forward, peak GPU memory, step time,
and the achieved bus bandwidth against this card's pinned-copy bandwidth measured in
the same run.

Each configuration runs ``--steps`` steps: the first warms up (pinned pools, kernels),
the next ones are timed, the second to last runs under the profiler (memory timeline for
``--plot``, bus copies for GB/s) and the last measures what forward leaves resident (it
waits for copies out to finish first). On CUDA an untimed run without offloading goes
first, so that no configuration pays for the GPU's and the allocator's first steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import actoffload as ao
from .arguments import BASELINES, LEAST_STEPS, DemoOptions
from .determinism import use_deterministic
from .models import GPT, GPTConfig
from .progress import Progress
from .saved_tracker import SavedTracker
from .steptrace import StepProfiler, StepTrace
from .workloads import sync


@dataclass
class RunResult:
    name: str
    kind: str | None = None  # None: no offloading; else "save_on_cpu" or an implementation
    loss_bits: list[torch.Tensor] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    offloaded_bytes: int = 0
    offloaded_by_role: dict = field(default_factory=dict)
    offloaded_by_group: dict = field(default_factory=dict)
    held_back: list[str] = field(default_factory=list)  # groups keep_last left on the device
    resident_bytes: int = 0
    peak_bytes: int = 0
    trace: StepTrace | None = None

    def step_ms(self) -> float | None:
        return statistics.median(self.step_s) * 1e3 if self.step_s else None


class CountingSaveOnCpu:
    """``torch.autograd.graph.save_on_cpu``, counting what it copies (it keeps no stats).

    ``on_save(tensor)`` is told about each saved tensor that stays where it is (on the
    CPU, where save_on_cpu has nothing to move), so residency can be measured there.
    """

    def __init__(self, device: torch.device, on_save: Callable[[torch.Tensor], None] | None = None):
        self.pin = device.type == "cuda"
        self.on_save = on_save
        self.copied_bytes = 0

    def hooks(self):
        inner = torch.autograd.graph.save_on_cpu(pin_memory=self.pin)

        def pack(t):
            if t.device.type != "cpu":
                self.copied_bytes += t.numel() * t.element_size()
            elif self.on_save is not None:
                self.on_save(t)
            return inner.pack_hook(t)

        return torch.autograd.graph.saved_tensors_hooks(pack, inner.unpack_hook)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def train(name: str, kind: str | None, cfg: GPTConfig, opts: DemoOptions, device: torch.device,
          dtype: torch.dtype) -> RunResult:
    """Train ``opts.steps`` steps; ``kind``: None (no offload), "save_on_cpu", or an impl.

    Example::

        res = train("ref", "ref", cfg, opts, torch.device("cpu"), torch.float32)
        res.offloaded_bytes, res.loss_bits
    """
    res = RunResult(name, kind)
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (opts.batch, cfg.seq_len + 1), generator=gen) for _ in range(opts.steps)]
    params = list(model.parameters())
    off: ao.Offloader | None = None
    handle: ao.WrapHandle | None = None
    baseline: CountingSaveOnCpu | None = None
    if kind in BASELINES:
        baseline = CountingSaveOnCpu(device)
    elif kind is not None:
        # every step offloads (no recomputing warm-up): the table counts what each step moves
        warmup = {"warmup": "offload"} if kind == "fast" else {}
        off = ao.Offloader(impl=kind, device=device, keep_last=opts.keep_last,
                           min_offload_bytes=opts.min_offload_bytes, policy=opts.policy, **warmup)
        handle = ao.wrap(model.blocks, off)
    ao.select_modules(model, set(opts.roles))
    profiled, measured = opts.steps - 2, opts.steps - 1
    bar = Progress(opts.steps, name)
    finished = False
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for step, batch in enumerate(batches):
            batch = batch.to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            sync(device)
            if baseline is not None:
                baseline.copied_bytes = 0
            prof = StepProfiler(device, memory=opts.plot is not None) if step == profiled and (
                device.type == "cuda" or opts.plot) else None
            tracker = SavedTracker(off, exclude=params) if step == measured else None
            if baseline is not None and tracker is not None:
                baseline.on_save = tracker.record
            before = _allocated(device)
            t0 = time.perf_counter()
            with prof.step() if prof else contextlib.nullcontext():
                with StepProfiler.phase("forward"), _saving_hooks(baseline, tracker):
                    loss = model.loss(x, y)
                if tracker is not None:  # what forward left resident, once its copies are done
                    sync(device)
                    if off is not None:
                        off.synchronize()  # copies in flight still hold their sources
                    res.resident_bytes = _allocated(device) - before if device.type == "cuda" else tracker.resident_bytes()
                with StepProfiler.phase("backward"):
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(device)
            if 0 < step < profiled:
                res.step_s.append(time.perf_counter() - t0)
            if prof:
                res.trace = prof.trace
            res.loss_bits.append(loss.detach().cpu())
            del loss
            bar.update(step + 1)
        finished = True
        if off is not None:
            stats = off.stats()
            res.offloaded_bytes = stats["offloaded_bytes"]  # the last step's: every step moves the same
            for group_name, g in stats["groups"].items():
                res.offloaded_by_group[group_name] = g["offloaded_bytes"]
                if g["kept"].get("keep_last"):
                    res.held_back.append(group_name)
                for role, n in g.get("offloaded_bytes_by_role", {}).items():
                    res.offloaded_by_role[role] = res.offloaded_by_role.get(role, 0) + n
        if baseline is not None:
            res.offloaded_bytes = baseline.copied_bytes
        if device.type == "cuda":
            res.peak_bytes = torch.cuda.max_memory_allocated(device)
    finally:
        if handle is not None:
            handle.remove()
        bar.close("" if finished else "  (failed)")
    return res


def _saving_hooks(baseline: CountingSaveOnCpu | None, tracker: SavedTracker | None) -> Any:
    """The saved-tensor hooks of one forward. Hooks do not nest (the innermost alone sees a
    save), so save_on_cpu's report to the tracker themselves rather than sit inside it."""
    if baseline is not None:
        return baseline.hooks()
    return tracker if tracker is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------- the table
def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _gbps(r: RunResult, direction: str, pinned: float | None) -> str:
    rate = r.trace.gbps(direction) if r.trace and r.offloaded_bytes else None  # none's own tiny copies: no figure
    if rate is None:
        return "-"
    return f"{rate:.1f} ({rate / pinned:.2f}x)" if pinned else f"{rate:.1f}"


def format_table(results: list[RunResult], device: torch.device, pinned: dict | None = None) -> str:
    """One row per configuration; ``pinned``: same-run pinned-copy GB/s (``d2h_gbps``, ``h2d_gbps``).

    Example::

        print(format_table([train("none", None, cfg, opts, device, dtype), ...], device))
    """
    base = results[0]
    cuda = device.type == "cuda"
    where = "GPU" if cuda else "host"
    head = ["config", "loss == none (bitwise)", "offloaded MB/step", f"resident act. MB after fwd ({where})"]
    by_role = any(r.offloaded_by_role for r in results)
    if by_role:
        head.append("offloaded MB/step by role")
    head += ["peak GPU MB", "step ms (median)", "x none (faster run)"]
    if cuda:
        head += ["D2H GB/s (x pinned)", "H2D GB/s (x pinned)"]
    rows = [head]
    # Two runs without offloading show the machine's run-to-run noise; ratios are to the
    # faster one, so noise never flatters an offloader.
    none_ms = [ms for r in results if r.kind is None and (ms := r.step_ms())]
    base_ms = min(none_ms, default=None)
    pinned = pinned or {}
    for r in results:
        same = len(r.loss_bits) == len(base.loss_bits) and all(torch.equal(a, b) for a, b in zip(r.loss_bits, base.loss_bits))
        row = [r.name, "yes" if same else "NO", _mb(r.offloaded_bytes), _mb(r.resident_bytes)]
        if by_role:
            row.append(", ".join(f"{k} {_mb(v)}" for k, v in sorted(r.offloaded_by_role.items())) or "-")
        ms = r.step_ms()
        row += [_mb(r.peak_bytes) if cuda else "-", f"{ms:.1f}" if ms else "-",
                f"{ms / base_ms:.2f}" if ms and base_ms else "-"]
        if cuda:
            row += [_gbps(r, "d2h", pinned.get("d2h_gbps")), _gbps(r, "h2d", pinned.get("h2d_gbps"))]
        rows.append(row)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the command
CPU_PLOT_NOTE = (
    "CPU run: the 'device' is host memory here, so offloading cannot lower this curve (its host\n"
    "copies add to it). It shows when memory is taken and given back, not what offloading saves on\n"
    "a GPU; the table's 'resident act. MB after fwd' is what offloading frees.")


def run(opts: DemoOptions) -> int:
    """``actoffload demo`` with checked arguments (see :func:`actoffload.tools.arguments.check_demo`).

    Example::

        run(check_demo(parser.parse_args(["--device", "cpu", "--steps", "2"])))
    """
    device = torch.device(opts.device)
    cuda = device.type == "cuda"
    cfg = GPTConfig(
        vocab_size=opts.vocab,
        seq_len=opts.seq_len,
        d_model=opts.d_model,
        n_heads=opts.n_heads,
        n_layers=opts.layers,
        attention="eager",  # deterministic everywhere, so losses can be compared bit for bit
        n_experts=opts.experts,
        top_k=opts.top_k,
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    use_deterministic(True)
    where = torch.cuda.get_device_name(device) if cuda else "CPU (host memory stands in for GPU memory; small configuration)"
    model_name = f"GPT-MoE ({cfg.n_experts} experts, top-{cfg.top_k})" if cfg.n_experts else "GPT (dense)"
    print(
        f"actoffload demo on {where}: {model_name} d={cfg.d_model} layers={cfg.n_layers} seq={cfg.seq_len} "
        f"batch={opts.batch} {str(dtype).replace('torch.', '')}, {opts.steps} steps, keep_last={opts.keep_last}"
        + (f", offload roles {sorted(opts.roles)} (policy {opts.policy})" if opts.roles else ""),
        flush=True,
    )
    pinned = None
    if cuda:
        from .bench import pinned_bandwidth

        pinned = pinned_bandwidth(device, 256 << 20, 5)
        print(f"pinned-copy bandwidth in this run: D2H {pinned['d2h_gbps']:.1f} GB/s, "
              f"H2D {pinned['h2d_gbps']:.1f} GB/s", flush=True)
        # the GPU's and the allocator's first steps, paid by no configuration shown
        train("warm-up (not shown)", None, cfg, dataclasses.replace(opts, steps=LEAST_STEPS["cuda"], plot=None),
              device, dtype)
    results = [train(name, kind, cfg, opts, device, dtype) for name, kind in opts.configs]
    print(format_table(results, device, pinned))
    if not cuda:
        print("(CPU run: 'resident' counts saved storages still alive after forward, in host memory; "
              "no GPU memory or bus figures.)")
    else:
        print(f"(step ms: median of steps 2..{opts.steps - 2}; GB/s: bytes copied each way in one profiled step / "
              "time the copy engines were busy with them.)")
    if opts.plot:
        from .plot import save_plot

        traces, kinds = {}, set()
        for r in results:  # one line per kind: no offloading is drawn once
            if r.trace is not None and r.kind not in kinds:
                kinds.add(r.kind)
                traces[r.name] = r.trace
        save_plot(opts.plot, traces, {r.name: r.offloaded_by_group for r in results},
                  f"actoffload demo on {where.split(' (')[0]}: {model_name} d={cfg.d_model} layers={cfg.n_layers} "
                  f"seq={cfg.seq_len} batch={opts.batch}",
                  "GPU memory allocated (GiB)" if cuda else "host memory allocated since the step began (GiB)",
                  relative=not cuda, note=None if cuda else CPU_PLOT_NOTE,
                  held_back={g: f"kept on the device (keep_last={opts.keep_last})"
                             for r in results for g in r.held_back})
        print(f"wrote {opts.plot}")
    return 0
