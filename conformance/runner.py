"""Run one scenario without an offloader, with ref and with fast; compare what is observable."""

from __future__ import annotations

import atexit
import contextlib
import gc
import time
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint

import actoffload as ao
from actoffload import Offloader

from .layers import Hooks, build
from .scenario import Scenario

SLEEP_CYCLES = 20_000_000  # a lagging stream: ~10 ms, far longer than the work between copies


class Boom(Exception):
    """The exception a scenario raises inside a group."""


@dataclass
class Outcome:
    error: str | None = None  # class name of the error backward raised
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    stats: dict | None = None
    host_bytes_after_free: int = 0
    resident_bytes: int | None = None  # CUDA: allocated after all forwards (copies finished)
    offloaded_bytes: int = 0


class Model(torch.nn.Module):
    def __init__(self, s: Scenario):
        super().__init__()
        self.groups = torch.nn.ModuleList()
        for g, kinds in enumerate(s.groups):
            layers = []
            for i, kind in enumerate(kinds):
                layer = build(kind, s.width)
                layer.hooks = Hooks(s.marks.get(f"{g}.{i}"), s.inplace_after_save == f"{g}.{i}")
                layer.checkpointed = f"{g}.{i}" in s.checkpoint
                layers.append(layer)
            self.groups.append(torch.nn.ModuleList(layers))

    def run_group(self, g: int, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        for i, layer in enumerate(self.groups[g]):
            if layer.checkpointed:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
            if fail and i == len(self.groups[g]) - 1:
                raise Boom(f"raised inside group {g}")
        return x


class _GroupModules(torch.nn.Module):
    """One group's layers as a module, for ``ao.wrap``."""

    def __init__(self, model: Model, g: int):
        super().__init__()
        self.model, self.g = [model], g

    def forward(self, x, fail=False):
        return self.model[0].run_group(self.g, x, fail)


def _group_names(s: Scenario) -> list[str]:
    return ["block" if s.same_names else str(g) for g in range(len(s.groups))]


def _forward(model: Model, s: Scenario, x: torch.Tensor, off: Offloader | None, wrapped, fail_in=None):
    for g, name in enumerate(_group_names(s)):
        fail = fail_in == g
        if wrapped is not None:
            x = wrapped[g](x, fail)
        elif off is not None:
            with off.group(name):
                x = model.run_group(g, x, fail)
        else:
            x = model.run_group(g, x, fail)
    return x


def _forwards(model: Model, s: Scenario, leaves: list[torch.Tensor], off: Offloader | None, wrapped):
    """One forward per micro-batch; with ``in_except``, from inside an ``except`` block (a
    retry loop, a fallback path), where ``sys.exc_info()`` names an unrelated exception."""
    if s.in_except:
        try:
            raise LookupError("unrelated, being handled")
        except LookupError:
            return [_forward(model, s, leaf * 1, off, wrapped).float().square().mean() for leaf in leaves]
    # leaf * 1: the first group sees an activation, as after an embedding
    return [_forward(model, s, leaf * 1, off, wrapped).float().square().mean() for leaf in leaves]


@contextlib.contextmanager
def _delayed(off, s: Scenario):
    """Make one stream lag far behind, so a missing wait shows up as a wrong result."""
    if s.delay is None or s.device != "cuda" or off is None or off.impl != "fast":
        yield
        return
    streams = off._streams
    if s.delay == "compute":
        original = off._move_out

        def move_out(group, moved):
            torch.cuda._sleep(SLEEP_CYCLES)  # compute lags: copies must wait for it
            return original(group, moved)

        off._move_out = move_out
        try:
            yield
        finally:
            del off._move_out
        return
    name = "on_d2h" if s.delay == "d2h" else "on_h2d"
    stream = streams.d2h if s.delay == "d2h" else streams.h2d
    original = getattr(streams, name)

    def lagging(*after):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return original(*after)

    setattr(streams, name, lagging)
    try:
        yield
    finally:
        delattr(streams, name)


def run(s: Scenario, impl: str | None) -> Outcome:
    """Train the scenario once; ``impl=None`` runs without an offloader."""
    device = torch.device(s.device)
    dtype = getattr(torch, s.dtype)
    torch.manual_seed(s.seed)
    model = Model(s).to(device=device, dtype=dtype)
    inputs = [torch.randn(s.batch, s.seq, s.width, device=device, dtype=dtype) for _ in range(s.microbatches)]
    off = None
    if impl is not None:
        fast_settings = {"prefetch": s.prefetch, "max_inflight": s.max_inflight, "warmup": s.warmup}
        if s.pack_below is not None:
            fast_settings["pack_below"] = s.pack_below
        off = ao.Offloader(impl=impl, device=device, policy=s.policy, keep_last=s.keep_last,
                           min_offload_bytes=s.min_offload_bytes, **(fast_settings if impl == "fast" else {}))
    handles, wrapped = [], None
    if off is not None and s.use_wrap:
        wrapped = [_GroupModules(model, g) for g in range(len(s.groups))]
        handles.append(ao.wrap(wrapped, off, names=_group_names(s)))
    out = Outcome()
    try:
        with _delayed(off, s):
            if s.raise_in_group is not None:
                try:
                    _forward(model, s, inputs[0].clone().requires_grad_(True), off, wrapped, fail_in=s.raise_in_group)
                except Boom:
                    pass
            gc.collect()
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            leaves = [x.clone().requires_grad_(True) for x in inputs]
            losses = _forwards(model, s, leaves, off, wrapped)
            out.outputs = [loss.detach().clone() for loss in losses]
            if device.type == "cuda":
                if off is not None:
                    off.synchronize()  # resident once the copies out have finished
                torch.cuda.synchronize()
                gc.collect()
                out.resident_bytes = torch.cuda.memory_allocated(device) - base
            if off is not None:
                out.offloaded_bytes = off.stats()["offloaded_bytes"]
            try:
                for i in s.backward_order:
                    losses[i].backward(retain_graph=s.retain_graph and i == 0)
                if s.retain_graph:
                    losses[0].backward()
            except Exception as e:  # any error is observable: compared by class with no offloader
                out.error = type(e).__name__
            out.grads = [leaf.grad.clone() if leaf.grad is not None else None for leaf in leaves]
            out.grads += [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            del losses, leaves
    finally:
        for h in handles:
            h.remove()
    gc.collect()
    if off is not None:
        out.stats = off.stats()["groups"]
        off.synchronize()
        out.host_bytes_after_free = _host_bytes_once_released(off)
    return out


def _host_bytes_once_released(off, patience_s: float = 2.0) -> int:
    """Host bytes still in use once the graph is gone.

    When a node raises, PyTorch lets go of the rest of that backward pass late. On CUDA,
    backward runs on autograd's device thread; the caller resumes as soon as the error is
    recorded, and the device thread drops the failing node (with its saved-tensor handles)
    a moment later. Nodes that run on the calling thread and were already queued when the
    error came stay queued, with everything they hold (their saved-tensor handles, and
    the graph behind them), until the next backward on this thread: without an offloader
    their device tensors stay just as long. So first run an empty backward, which drops
    them, then poll briefly, so only bytes that stay in use count as a leak (R8).
    """
    torch.ones((), requires_grad=True).backward()
    gc.collect()
    deadline = time.monotonic() + patience_s
    while True:
        in_use = off.stats()["host_bytes_in_use"]
        if in_use == 0 or time.monotonic() > deadline:
            return in_use
        time.sleep(0.01)
        gc.collect()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equality (NaNs with the same bits are equal, unlike ``torch.equal``)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        bits = _BITS[a.element_size()]
        a, b = a.contiguous().view(bits), b.contiguous().view(bits)
    return torch.equal(a, b)


def compare(s: Scenario, impl: str = "fast") -> list[str]:
    """Every difference between none, ref and ``impl`` on ``s`` (empty when they agree)."""
    runs = {"none": run(s, None), "ref": run(s, "ref")}
    if impl != "ref":
        runs[impl] = run(s, impl)
    base = runs["none"]
    # fast warming up recomputes wrapped groups: what they save differs from ref by design
    recomputing = impl == "fast" and s.warmup == "recompute" and s.use_wrap
    problems = []
    for name, r in runs.items():
        if name == "none":
            continue
        if r.error != base.error:
            problems.append(f"{name}: error {r.error} where none raised {base.error} (R6/R10)")
            continue
        if not all(_same(a, b) for a, b in zip(r.outputs, base.outputs)):
            problems.append(f"{name}: outputs differ from none (R1)")
        if base.error is None and (len(r.grads) != len(base.grads) or not all(_same(a, b) for a, b in zip(r.grads, base.grads))):
            bad = [i for i, (a, b) in enumerate(zip(r.grads, base.grads)) if not _same(a, b)]
            problems.append(f"{name}: gradients {bad[:5]} differ from none (R1)")
        if r.host_bytes_after_free != 0:
            problems.append(f"{name}: {r.host_bytes_after_free} host bytes still in use after the graph was freed (R8)")
        if r.resident_bytes is not None and base.error is None:
            expected = runs["ref"].resident_bytes
            slack = 0.01 * max(expected, 1) + 4096
            if name != "ref" and recomputing:  # recomputed groups hold their inputs at most
                if r.resident_bytes > expected + slack:
                    problems.append(f"{name}: {r.resident_bytes} bytes resident after forward while recomputing, "
                                    f"more than ref's {expected} (R9)")
            elif abs(r.resident_bytes - expected) > slack:
                problems.append(f"{name}: {r.resident_bytes} bytes resident after forward, ref {expected} (R9)")
    if impl != "ref" and not recomputing and runs[impl].stats != runs["ref"].stats:
        problems.append(f"{impl}: stats differ from ref: {runs[impl].stats} vs {runs['ref'].stats}")
    # (a first forward that raised is a step of its own: the warm-up may be over after it)
    if (recomputing and base.error is None and s.raise_in_group is None
            and not any(g.get("recomputed") for g in (runs[impl].stats or {}).values())):
        problems.append(f"{impl}: warmup='recompute' recomputed no wrapped group")
    return problems


def minimize(s: Scenario, impl: str, budget: int = 40) -> Scenario:
    """Shrink a failing scenario while it still fails (at most ``budget`` tries)."""
    from .scenario import shrinks

    tries = 0
    improved = True
    while improved and tries < budget:
        improved = False
        for smaller in shrinks(s):
            tries += 1
            try:
                failing = bool(compare(smaller, impl))
            except Exception:  # a crash is a failure too
                failing = True
            if failing:
                s, improved = smaller, True
                break
            if tries >= budget:
                break
    return s


def init_worker() -> None:
    """Set up a process that runs scenarios (``python -m conformance`` and its workers)."""
    torch.use_deterministic_algorithms(True)
    torch._dynamo.config.cache_size_limit = 256  # "compiled" layers of many shapes and dtypes
    # Every run collects garbage to check lifetimes (R8); a full collection walks every
    # object of torch's and Triton's imports, which is most of the time of a scenario:
    # freeze what exists now so only the scenarios' own objects are walked.
    settle()
    atexit.register(gc.unfreeze)  # let the interpreter's own teardown free them


def settle() -> None:
    """Collect a scenario's garbage, then freeze what survives (torch.compile's caches)."""
    gc.collect()
    gc.freeze()


def check_seeds(seeds: list[int], device: str, impl: str) -> list[tuple[int, list[str]]]:
    """Compare the scenarios of ``seeds``; the failing ones with their problems."""
    from .scenario import generate

    failed = []
    for seed in seeds:
        try:
            problems = compare(generate(seed, device), impl)
        except Exception as e:  # a crash is a failure, reported like the others
            problems = [f"crashed: {type(e).__name__}: {e}"]
        if problems:
            failed.append((seed, problems))
        settle()
    return failed
