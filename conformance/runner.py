"""Run one scenario without an offloader, with ref and with fast; compare what is observable."""

from __future__ import annotations

import atexit
import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, field, replace

import torch
import torch.utils.checkpoint

import actoffload as ao
from actoffload import Offloader

from .layers import Attribute, Hooks, Resizable, Tiny, build
from .scenario import Scenario

SLEEP_CYCLES = 20_000_000  # a lagging stream: ~10 ms, far longer than the work between copies


class Boom(Exception):
    """The exception a scenario raises inside a group."""


@dataclass
class Outcome:
    error: str | None = None  # class name of the error backward raised (the steps stop there)
    error_detail: str | None = None  # its message, and where it was raised
    outputs: list[torch.Tensor] = field(default_factory=list)  # every step's
    grads: list[torch.Tensor] = field(default_factory=list)  # every step's
    stats: dict | None = None  # stats()["groups"] once the graph is freed
    step_stats: list[dict] = field(default_factory=list)  # stats()["groups"] after each step's forwards
    plans: list[dict | None] = field(default_factory=list)  # stats()["plan"] after each step (a budget's)
    host_bytes_after_free: int = 0
    resident_bytes: list[int] = field(default_factory=list)  # CUDA: allocated after each step's forwards (copies finished)
    substituted_bytes: int = 0  # tensors put in place of the parameters (functional_call), as a recomputation holds them
    offloaded_bytes: int = 0


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep the matmuls' outputs, recompute the rest."""
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if keep else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_save_matmuls)


def checkpointed(kind: str, fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` under activation checkpointing of ``kind`` (scenario.CHECKPOINT_KINDS)."""
    if kind == "reentrant":
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)
    if kind == "selective":
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=_selective)
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)


class Block(torch.nn.ModuleList):
    """One group's layers, run in order: the module ``ao.wrap`` wraps (a memory plan or the
    warm-up may recompute it)."""

    checkpoint_kind = "nonreentrant"

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        for i, layer in enumerate(self):
            x = checkpointed(self.checkpoint_kind, layer, x) if layer.checkpointed else layer(x)
            if fail and i == len(self) - 1:
                raise Boom("raised inside a group")
        return x


class Model(torch.nn.Module):
    """The scenario's blocks at their positions, then its tiny groups; ``forward`` opens the
    groups (by hand, or through the wrapped blocks) as the runner configured it."""

    def __init__(self, s: Scenario):
        super().__init__()
        self.groups = torch.nn.ModuleList()
        for g, kinds in enumerate(s.groups):
            layers = []
            for i, kind in enumerate(kinds):
                layer = build(kind, s.width, s.chain)
                layer.hooks = Hooks(s.marks.get(f"{g}.{i}"), s.inplace_after_save == f"{g}.{i}")
                layer.checkpointed = f"{g}.{i}" in s.checkpoint
                layers.append(layer)
            block = Block(layers)
            block.checkpoint_kind = s.checkpoint_kind
            self.groups.append(block)
        self.tiny = torch.nn.ModuleList(Tiny() for _ in range(s.deep))
        self.scenario = s
        self.order = s.positions()
        self.names = _group_names(s)
        self.off: Offloader | None = None  # groups opened by hand
        self.resized: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (storage, its bytes) freed

    def blocks(self) -> list[torch.nn.Module]:
        """The module at each position, the tiny groups last."""
        return [self.groups[g] for g in self.order] + list(self.tiny)

    def forward(self, x: torch.Tensor, fail_in: int | None = None) -> torch.Tensor:
        s = self.scenario
        regions = {r["first"]: r for r in s.regions if 0 <= r["first"] <= r["last"] < len(self.order)}
        inplace = "inplace_residual" in s.twists
        if inplace and x.is_leaf:
            x = x * 1  # (a first forward that raises gets the leaf itself)
        p = 0
        while p < len(self.order):
            r = regions.get(p)
            if r is None:
                y = self._position(p, x, fail_in == p, resize=True)
                if inplace:
                    x += y  # the residual stream written in place: h += block(h)
                else:
                    x = y
                p += 1
                continue

            def region(t, first=r["first"], last=r["last"], outside=r["outside"]):
                for q in range(first, last + 1):
                    if outside:
                        t = t + t.sin() * 0.5  # saved inside the checkpointed region, outside any group
                    t = self._position(q, t, fail_in == q, resize=False)
                return t

            x = checkpointed(r["kind"], region, x)
            if inplace:
                x = x * 1  # reentrant checkpoint's output may be a view, which cannot be written in place
            p = r["last"] + 1
        for j, tiny in enumerate(self.tiny):
            x = self._call(tiny, self.names[len(self.order) + j], x, False)
        return x

    def _position(self, p: int, x: torch.Tensor, fail: bool, resize: bool) -> torch.Tensor:
        block = self.groups[self.order[p]]
        y = self._call(block, self.names[p], x, fail)
        if resize and self.scenario.resize == "after_group":
            self.free_saved(block)  # the group is closed: its commit may still be pending (keep_last)
        return y

    def _call(self, block: torch.nn.Module, name: str, x: torch.Tensor, fail: bool) -> torch.Tensor:
        if self.off is not None:
            with self.off.group(name):
                return block(x, fail)
        return block(x, fail)  # plain, or wrapped (the block opens its group)

    def free_saved(self, *blocks: torch.nn.Module) -> None:
        """Free the storages ``Resizable`` layers saved (``resize_(0)``), keeping their bytes aside."""
        for block in blocks or list(self.groups):
            for layer in block.modules():
                if isinstance(layer, Resizable):
                    for h in layer.saved:
                        storage = h.untyped_storage()
                        if storage.nbytes():
                            keep = torch.empty(storage.nbytes(), dtype=torch.uint8, device=h.device)
                            keep.untyped_storage().copy_(storage)
                            storage.resize_(0)
                            self.resized.append((storage, keep))
                    layer.saved.clear()

    def refill(self) -> None:
        """Give the freed storages their bytes back (their version counters untouched)."""
        for storage, keep in self.resized:
            storage.resize_(keep.numel())
            storage.copy_(keep.untyped_storage())
        self.resized.clear()

    def set_twist(self, on: bool) -> None:
        """Between the loss and backward (``on``), and back after backward."""
        if "eval" in self.scenario.twists:
            self.train(not on)
        if "attribute" in self.scenario.twists:
            for m in self.modules():
                if isinstance(m, Attribute):
                    m.change() if on else m.restore()


def _group_names(s: Scenario) -> list[str]:
    n = len(s.positions())
    if s.same_names:
        return ["block"] * (n + s.deep)
    return [str(p) for p in range(n)] + [f"t{j}" for j in range(s.deep)]


def _forward(model: Model, s: Scenario, x: torch.Tensor, params: dict | None, fail_in=None) -> torch.Tensor:
    if params is not None:  # parameters other than the module's own (a hypernetwork, an EMA copy)
        return torch.func.functional_call(model, params, (x,), {"fail_in": fail_in})
    return model(x, fail_in)


def _forwards(model: Model, s: Scenario, leaves: list[torch.Tensor], params: dict | None):
    """One forward per micro-batch; with ``in_except``, from inside an ``except`` block (a
    retry loop, a fallback path), where ``sys.exc_info()`` names an unrelated exception."""
    if s.in_except:
        try:
            raise LookupError("unrelated, being handled")
        except LookupError:
            return [_forward(model, s, leaf * 1, params).float().square().mean() for leaf in leaves]
    # leaf * 1: the first group sees an activation, as after an embedding
    return [_forward(model, s, leaf * 1, params).float().square().mean() for leaf in leaves]


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


def _offloader(s: Scenario, impl: str, device: torch.device, budget: int | None) -> Offloader:
    settings: dict = {"policy": s.policy, "min_offload_bytes": s.min_offload_bytes}
    if impl == "fast":
        settings["warmup"] = s.warmup
        if s.pack_below is not None:
            settings["pack_below"] = s.pack_below
    if impl == "fast" and budget is not None:  # its plan chooses the copy window and what stays
        settings["memory_budget"] = budget
    else:
        settings["keep_last"] = s.keep_last
        if impl == "fast":
            settings |= {"prefetch": s.prefetch, "max_inflight": s.max_inflight}
    return ao.Offloader(impl=impl, device=device, **settings)


def _inputs(s: Scenario, step: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    if step == 0:  # from the seed's generator, right after the model (as before steps existed)
        return [torch.randn(s.batch, s.seq, s.width, device=device, dtype=dtype) for _ in range(s.microbatches)]
    gen = torch.Generator().manual_seed(s.seed * 1000 + step)
    return [torch.randn(s.batch, s.seq, s.width, generator=gen).to(device=device, dtype=dtype)
            for _ in range(s.microbatches)]


def run(s: Scenario, impl: str | None) -> Outcome:
    """Train the scenario (``s.steps`` steps); ``impl=None`` runs without an offloader."""
    device = torch.device(s.device)
    dtype = getattr(torch, s.dtype)
    # (sized first: sizing runs the scenario, which seeds and draws from the global generator)
    budget = budget_bytes(s) if impl == "fast" and s.memory_budget is not None else None
    torch.manual_seed(s.seed)
    model = Model(s).to(device=device, dtype=dtype)
    inputs = _inputs(s, 0, device, dtype)
    off = _offloader(s, impl, device, budget) if impl is not None else None
    handles = []
    if off is not None and s.use_wrap:
        blocks = model.blocks()
        if s.wrap_dict:
            handles.append(ao.wrap(torch.nn.ModuleDict({f"b{p}": b for p, b in enumerate(blocks)}), off))
        else:  # one block at several positions: nn.ModuleList([block] * k), wrapped once
            handles.append(ao.wrap(torch.nn.ModuleList(blocks), off, names=_group_names(s)))
    elif off is not None:
        model.off = off
    out = Outcome()
    try:
        with _delayed(off, s):
            if s.raise_in_group is not None:
                try:
                    _forward(model, s, inputs[0].clone().requires_grad_(True), None, fail_in=s.raise_in_group)
                except Boom:
                    pass
                for block in model.groups:
                    for layer in block.modules():
                        if isinstance(layer, Resizable):
                            layer.saved.clear()
            for step in range(s.steps):
                if step:
                    inputs = _inputs(s, step, device, dtype)
                if not _step(model, s, off, inputs, device, dtype, out):
                    break  # backward raised: compared by class, no further step
    finally:
        for h in handles:
            h.remove()
    gc.collect()
    if off is not None:
        out.stats = off.stats()["groups"]
        off.synchronize()
        out.host_bytes_after_free = _host_bytes_once_released(off)
    return out


def _allocated(device: torch.device) -> int:
    """CUDA memory allocated now, once the blocks freed with a stream use recorded on them are
    let go: such a block (fast's packing stage and packed sources, used by the copy stream)
    counts as allocated until the allocator next allocates and finds the use done, so that the
    reading would depend on timing (seed 117 read 8 KiB over, now and then, on a busy card)."""
    torch.cuda.synchronize(device)
    torch.empty(1, device=device)  # an allocation: the allocator looks at the finished uses first
    return torch.cuda.memory_allocated(device)


def _step(model: Model, s: Scenario, off: Offloader | None, inputs: list[torch.Tensor], device: torch.device,
          dtype: torch.dtype, out: Outcome) -> bool:
    """One training step (every micro-batch's forward, then their backwards); what it observes
    goes into ``out``; ``False`` if backward raised."""
    gc.collect()
    base = _allocated(device) if device.type == "cuda" else 0
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    params, scale = None, None
    if "functional_call" in s.twists:
        scale = torch.tensor(0.75, device=device, dtype=dtype, requires_grad=True)
        params = {n: p * scale for n, p in model.named_parameters()}
        out.substituted_bytes = sum(p.numel() * p.element_size() for p in params.values())
    losses = _forwards(model, s, leaves, params)
    del params
    out.outputs += [loss.detach().clone() for loss in losses]
    if s.resize == "after_forward":
        model.free_saved()
    if device.type == "cuda":
        if off is not None:
            off.synchronize()  # resident once the copies out have finished
        gc.collect()
        out.resident_bytes.append(_allocated(device) - base)  # (synchronized there)
    if off is not None:
        stats = off.stats()
        out.offloaded_bytes = stats["offloaded_bytes"]
        out.step_stats.append(stats["groups"])
        out.plans.append(stats.get("plan"))
    model.refill()
    model.set_twist(True)
    try:
        for i in s.backward_order:
            losses[i].backward(retain_graph=s.retain_graph and i == 0)
        if s.retain_graph:
            losses[0].backward()
    except Exception as e:  # any error is observable: compared by class with no offloader
        out.error = type(e).__name__
        tb = traceback.extract_tb(e.__traceback__)[-1]
        out.error_detail = f"{type(e).__name__}: {str(e)[:300]} (at {tb.filename.split('/')[-1]}:{tb.lineno} {tb.name})"
    finally:
        model.set_twist(False)
    out.grads += [leaf.grad.clone() if leaf.grad is not None else None for leaf in leaves]
    if scale is not None:
        out.grads.append(scale.grad.clone() if scale.grad is not None else None)
    out.grads += [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    if off is not None and s.memory_budget is not None:
        out.plans[-1] = off.stats().get("plan")  # as this step's backward left it
    return out.error is None


_BUDGETS: dict[str, tuple[int, int, int]] = {}  # scenario -> (budget, smallest reachable peak, keeping everything's)


def budget_bytes(s: Scenario) -> int:
    """The memory budget ``s.memory_budget`` names: ``huge`` keeps everything (1 << 40); ``small``
    and ``mid`` are read off a run with the huge one (the plan's figures, which on the CPU
    are the bytes the groups save): ``small`` the smallest reachable peak, a little more (every
    plan misses by the margin: the least-memory plan runs, recomputing or offloading), ``mid``
    halfway to what keeping everything needs, beyond the margin (docs/budgets.md: at least
    1 MiB, a thousandth of the budget)."""
    return _sized(s)[0]


def _sized(s: Scenario) -> tuple[int, int, int]:
    """``(budget, smallest reachable peak, keeping everything's peak)`` (the peaks ``0`` where
    not read off a plan)."""
    if s.memory_budget == "huge" or s.memory_budget is None:
        return 1 << 40, 0, 0
    key = replace(s, memory_budget="huge", steps=3).to_json()
    if key not in _BUDGETS:
        sizing = run(Scenario.from_json(key), "fast")
        if sizing.error is not None:  # backward raised (as it will without an offloader: compared there)
            return 1 << 40, 0, 0
        plan = (sizing.plans or [None])[-1] or {}
        least = plan.get("smallest_reachable_bytes")
        top = plan.get("predicted_peak_bytes")
        if least is None or top is None:
            raise RuntimeError(f"a run with memory_budget=1 << 40 made no plan to size {s.memory_budget!r} from: {plan}")
        _BUDGETS.clear()  # one scenario at a time
        # On CUDA the smallest reachable peak includes the allocator's reserve, measured on the
        # steps that grow the cache: the least-memory plan, run under the small budget, may grow
        # it in a pattern the huge budget's plans never did (seen: 18 KiB more, every run of one
        # scenario); and what is allocated outside the groups differs by a few hundred bytes
        noise = 64 << 10 if s.device == "cuda" else 0
        budget = least + noise + min(1 << 19, max(top - least, 0) // 4) if s.memory_budget == "small" else \
            least + max(1 << 20, least // 1000) + max(top - least, 0) // 2
        _BUDGETS[key] = max(budget, 1), least, top  # (0 on the CPU where no group is the plan's)
    return _BUDGETS[key]


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
    fast = runs.get("fast")
    budget = fast is not None and s.memory_budget is not None
    # fast recomputing (warming up, or a budget's plan) saves other tensors than ref by design
    warming = fast is not None and s.warmup == "recompute" and s.use_wrap

    def recomputing(step: int) -> bool:
        return budget or (warming and (step >= len(fast.step_stats)
                                       or any(g.get("recomputed") for g in fast.step_stats[step].values())))

    problems = []
    for name, r in runs.items():
        if name == "none":
            continue
        if r.error != base.error:
            problems.append(f"{name}: error {r.error} where none raised {base.error} (R6/R10): "
                            f"{r.error_detail or base.error_detail}")
            continue
        if len(r.outputs) != len(base.outputs) or not all(_same(a, b) for a, b in zip(r.outputs, base.outputs)):
            problems.append(f"{name}: outputs differ from none (R1)")
        if base.error is None and (len(r.grads) != len(base.grads) or not all(_same(a, b) for a, b in zip(r.grads, base.grads))):
            bad = [i for i, (a, b) in enumerate(zip(r.grads, base.grads)) if not _same(a, b)]
            problems.append(f"{name}: gradients {bad[:5]} of {len(base.grads)} differ from none (R1)")
        if r.host_bytes_after_free != 0:
            problems.append(f"{name}: {r.host_bytes_after_free} host bytes still in use after the graph was freed (R8)")
        if base.error is None:
            for step, resident in enumerate(r.resident_bytes):
                expected = (base if name != "ref" and budget else runs["ref"]).resident_bytes[step]
                slack = 0.01 * max(expected, 1) + 4096
                if name != "ref" and recomputing(step):
                    # recomputed groups hold their inputs at most, and what functional_call put in
                    # place of the parameters (docs/semantics.md, "Recomputed groups")
                    if resident > expected + slack + r.substituted_bytes:
                        problems.append(f"{name}: {resident} bytes resident after step {step}'s forward while "
                                        f"recomputing, more than {'none' if budget else 'ref'}'s {expected} (R9)")
                elif abs(resident - expected) > slack:
                    problems.append(f"{name}: {resident} bytes resident after step {step}'s forward, ref {expected} (R9)")
    if fast is not None and not budget:
        ref = runs["ref"]
        for step, (a, b) in enumerate(zip(fast.step_stats, ref.step_stats)):
            if not recomputing(step) and a != b:
                problems.append(f"fast: stats after step {step}'s forward differ from ref: {a} vs {b}")
                break
        if not warming and fast.stats != ref.stats:
            problems.append(f"fast: stats differ from ref: {fast.stats} vs {ref.stats}")
    # (a first forward that raised is a step of its own: the warm-up may be over after it)
    outside_regions = set(range(len(s.positions()) + s.deep)) - {
        p for r in s.regions for p in range(r["first"], r["last"] + 1)}
    if ((warming or (budget and s.use_wrap)) and base.error is None and s.raise_in_group is None
            and outside_regions and fast.step_stats
            and not any(g.get("recomputed") for g in fast.step_stats[0].values())):
        problems.append("fast: " + ("a budget's profiling step" if budget else "warmup='recompute'")
                        + " recomputed no wrapped group")
    if budget and base.error is None:
        problems += _budget_problems(s, fast)
    return problems


def _budget_problems(s: Scenario, fast: Outcome) -> list[str]:
    """After its two profiling steps, a budget runs a plan: keep everything for ``huge``, not for
    ``small`` (the least-memory plan) where that peaks lower."""
    plan = fast.plans[-1] if fast.plans else None
    # (a plan of no groups is one: every group of the step opened inside activation checkpointing)
    if not plan or "groups" not in plan or plan.get("state") in ("profiling", "re-planning"):
        state = plan.get("state") if plan else None
        return [f"fast: memory_budget={s.memory_budget}: no plan after {s.steps} steps (state {state})"]
    actions = [g["action"] for g in plan["groups"]]
    if s.memory_budget == "huge" and not set(actions) <= {"keep"}:
        return [f"fast: memory_budget=1 << 40 planned {actions}, not keeping everything"]
    budget, least, top = _sized(s)
    if s.memory_budget == "small" and budget < top and set(actions) == {"keep"}:
        return [f"fast: memory_budget={budget} (about the smallest reachable peak, {least}; keeping everything "
                f"peaks at {top}) kept everything"]
    return []


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
