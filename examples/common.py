"""What every distributed example shares: launching, modes, measuring, comparing, reporting.

An example script defines one function, ``build(ctx, args, mode) -> Trainee``, that makes a
fresh model for one mode (same seed every time) and says which modules are its blocks and
how one training step runs; :func:`main` does the rest on every rank:

- launching: under ``torchrun`` it runs as the rank torchrun made; otherwise it spawns
  ``--nproc`` processes (default 2) with ``torch.multiprocessing``, so
  ``python examples/fsdp2.py --device cpu`` works on a laptop;
- ``init_process_group``: gloo on the CPU, NCCL on CUDA (one GPU per rank), NVLink
  multicast kept off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``);
- deterministic algorithms (``CUBLAS_WORKSPACE_CONFIG=:4096:8``), so modes compare bit for bit;
- modes, each on a fresh model: ``none``; ``offload`` (``ao.wrap`` on the blocks; impl
  ``fast`` on CUDA, ``ref`` on the CPU, or ``--impl``); ``checkpoint`` (activation
  checkpointing of each block, for reference; on CUDA by default); ``budget`` (``ao.wrap``
  with ``fast`` and ``--memory-budget``, each rank its own budget: every step's reserved peak
  must stay within it on CUDA; run where ``--memory-budget`` is given);
- per step: time of forward + backward (synchronize + ``perf_counter``; the optimizer step is
  not timed), a digest of every local gradient (the shard a rank holds), the loss;
  per step: peak device memory of forward and backward (``torch.cuda.max_memory_allocated``,
  read across the resets a budget makes inside a step; not measured on the CPU), and per mode
  the peak over its steps and optimizer steps; bytes offloaded per step, and an audit of every
  committed group (:class:`ActivationAudit`, offload mode);
- a table on rank 0, a results JSON (``--out``), and exit code 1 when any mode's gradients
  or losses differ from ``none`` on any rank, the audit finds more than activations moved
  or a parameter not kept, or an example's own check fails.

Run any example with ``--help`` for its options.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import gc
import hashlib
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Sequence

# NVLink multicast can take a host's shared GPUs out of service: keep it off everywhere,
# also in processes torchrun or this module starts (they inherit the environment).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import actoffload as ao  # noqa: E402
from actoffload.tools.arguments import can_write_in  # noqa: E402
from actoffload.tools.determinism import set_cublas_workspace  # noqa: E402
from actoffload.tools.models import GPTConfig  # noqa: E402
from actoffload.settings import parse_memory_budget  # noqa: E402
from actoffload.tools.peaks import Peaks  # noqa: E402

set_cublas_workspace()  # before any CUDA work here or in the ranks this module starts
from actoffload.tools.provenance import describe, results_json  # noqa: E402

MODES = ("none", "offload", "checkpoint", "budget")
MiB = 1 << 20


# ---------------------------------------------------------------- what an example provides
@dataclass
class Context:
    """This rank's place in the job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str


@dataclass
class Trainee:
    """One mode's fresh model, as :func:`run_mode` needs it.

    ``step(i)`` runs forward and backward of step ``i`` and returns the loss (``None`` on a
    rank without one, such as a first pipeline stage); gradients stay on the parameters.
    ``blocks`` are wrapped by ``ao.wrap`` (offload) or checkpointed (checkpoint), and named
    ``block_names`` (unique per offloader). ``held`` gives the tensors that are the model's
    parameters right now (for FSDP2 inside a block's forward: its unsharded parameters).
    ``report(off)`` adds example-specific facts to the mode's results (``off`` is the
    offloader, or ``None``); two keys have a meaning: ``checks`` (name -> bool, each must
    hold) and ``invariants`` (must equal the ``none`` mode's, such as a pipeline's order of
    forwards and backwards). ``on_offloader(off)`` is called once the offloader exists.
    """

    blocks: list[torch.nn.Module]
    block_names: list[str]
    step: Callable[[int], torch.Tensor | None]
    named_params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    held: Callable[[], Iterable[torch.Tensor]]
    report: Callable[[ao.Offloader | None], dict[str, Any]] = lambda off: {}
    on_offloader: Callable[[ao.Offloader], None] = lambda off: None


BuildFn = Callable[[Context, argparse.Namespace, str], Trainee]


# ---------------------------------------------------------------- command line
class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each option's default where it has a fixed one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every example takes (model size, steps, modes, offloader settings); ``doc``
    (the example's docstring) is the help text."""
    p = argparse.ArgumentParser(description=doc, formatter_class=_Help)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per rank")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not run by torchrun")
    p.add_argument("--steps", type=int, default=3, help="training steps per mode; the first is not timed")
    p.add_argument("--modes", default=None,
                   help="comma-separated, of none,offload,checkpoint,budget (default: none,offload on the CPU, "
                        "none,offload,checkpoint on CUDA; and budget where --memory-budget is given)")
    p.add_argument("--memory-budget", default=None,
                   help="the budget mode's memory_budget, each rank's own: bytes, '20GiB', '90%%' or 'auto'")
    p.add_argument("--impl", choices=list(ao.IMPLS), default=None,
                   help="offloader (default: fast on CUDA, ref on the CPU)")
    p.add_argument("--keep-last", type=int, default=1, help="groups kept on the device at the end of a forward")
    p.add_argument("--min-offload-bytes", type=int, default=None,
                   help="smaller saved tensors stay (default: 0 on the CPU, where the tiny default model's "
                        "tensors are small; 1 MiB on CUDA)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    model = p.add_argument_group("model and data (a small GPT-like decoder; the defaults are tiny)")
    model.add_argument("--vocab", type=int, default=256, help="vocabulary")
    model.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    model.add_argument("--d-model", type=int, default=64, help="width")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument("--layers", type=int, default=4, help="decoder blocks")
    model.add_argument("--batch", type=int, default=4, help="sequences per step (per rank for data parallelism)")
    model.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameters and activations")
    model.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    model.add_argument("--seed", type=int, default=0, help="weights and data")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the arguments before any process starts, and resolve the defaults that depend on
    the device."""
    for flag in ("nproc", "steps", "vocab", "seq_len", "d_model", "heads", "layers", "batch"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}: at least 1, got {getattr(args, flag)}")
    if args.steps < 2:
        raise SystemExit(f"--steps: at least 2 (the first is not timed), got {args.steps}")
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.keep_last < 0:
        raise SystemExit(f"--keep-last: at least 0, got {args.keep_last}")
    if args.min_offload_bytes is not None and args.min_offload_bytes < 0:
        raise SystemExit(f"--min-offload-bytes: at least 0, got {args.min_offload_bytes}")
    if args.out:
        existing = Path(args.out).parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if Path(args.out).is_dir():
            raise SystemExit(f"--out {args.out}: is a folder; give a file name in it")
        if not existing.is_dir():
            raise SystemExit(f"--out {args.out}: cannot make its folder: {str(existing)!r} is a file")
        if not can_write_in(existing):
            raise SystemExit(f"--out {args.out}: cannot write in {str(existing)!r} (no permission, or a file "
                             "system that takes no files)")
    cuda = args.device == "cuda"
    default = ["none", "offload", "checkpoint"] if cuda else ["none", "offload"]
    args.modes = args.modes.split(",") if args.modes else default + (["budget"] if args.memory_budget else [])
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if "budget" in args.modes and not args.memory_budget:
        raise SystemExit("mode 'budget' needs --memory-budget (bytes, '20GiB', '90%' or 'auto')")
    if args.memory_budget:
        try:  # a bad size fails here, before any process starts
            parse_memory_budget("--memory-budget", args.memory_budget)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if "none" not in args.modes:
        args.modes.insert(0, "none")  # the reference every other mode is compared with
    args.impl = args.impl or ("fast" if cuda else "ref")
    if args.min_offload_bytes is None:
        args.min_offload_bytes = 1 << 20 if cuda else 0
    return args


def world_size(args: argparse.Namespace) -> int:
    """The ranks the run will have: torchrun's, else ``--nproc``."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else args.nproc


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    # Eager attention: SDPA's fused CUDA kernels are not deterministic even without offloading.
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads,
                     n_layers=args.layers, attention="eager")


def batch(args: argparse.Namespace, step: int, stream: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets for ``step``; ``stream`` picks the data (e.g. the
    data-parallel rank). The same for every mode, so modes see the same data."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + stream * 10_007 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    # contiguous: pipelining checks an input's strides against the stage's, and a slice's are not
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def language_model(args: argparse.Namespace, ctx: Context, model: torch.nn.Module,
                   forward: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
                   data_stream: int, **extra: Any) -> Trainee:
    """A model of decoder ``model.blocks`` trained on next-token loss: ``forward(ids)`` gives
    logits (through DDP, FSDP2 or a parallel plan), ``data_stream`` picks each rank's data."""

    def step(i: int) -> torch.Tensor:
        x, y = batch(args, i, data_stream, ctx.device)
        logits = forward(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        return loss

    return Trainee(
        blocks=list(model.blocks),
        block_names=[f"block{i}" for i in range(len(model.blocks))],
        step=step,
        named_params=list(model.named_parameters()),  # DTensors (FSDP2, tensor parallel): local shards
        optimizer=optimizer,
        held=model.parameters,  # inside a block's forward: its (unsharded) parameters
        **extra,
    )


# ---------------------------------------------------------------- launching
def main(name: str, build: BuildFn, p: argparse.ArgumentParser, argv: Sequence[str] | None = None,
         check: Callable[[argparse.Namespace], None] | None = None) -> int:
    """Parse the command line (``argv``, default ``sys.argv``) with ``p`` and run ``build``'s
    model in every mode on every rank; returns the exit code. ``check``: the script's own
    arguments, checked (``SystemExit`` naming the problem) before any process starts."""
    args = finish_args(p.parse_args(argv))
    if check is not None:
        check(args)
    return launch(functools.partial(_rank_main, name, build, args), args.nproc)


def launch(fn: Callable[[], int], nproc: int) -> int:
    """Run ``fn`` on every rank: as this process under torchrun (which then ends with its exit
    code, :func:`end_rank`), else in ``nproc`` spawned processes. Returns the exit code (0 when
    every rank returned 0)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        end_rank(fn())
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ranks report their exit codes here rather than by exiting non-zero, which would make
    # mp.spawn kill the ranks still finishing.
    codes = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_spawned, args=(nproc, port, fn, codes), nprocs=nproc, join=True)
    except mp.ProcessExitedException as e:
        return e.exit_code or 1
    except mp.ProcessRaisedException as e:  # its message holds the rank's traceback
        print(f"{e}\nrank {e.error_index} raised; the other ranks were stopped", file=sys.stderr)
        return 1
    return max(codes.get() for _ in range(nproc))


def _spawned(local_rank: int, world: int, port: int, fn: Callable[[], int], codes: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    code = fn()
    codes.put(code)  # (a SimpleQueue: written to the pipe before put returns)
    end_rank(0)  # its code is reported above: mp.spawn would stop the others on a non-zero exit


def end_rank(code: int) -> NoReturn:
    """End this rank's process now, its work done, its output flushed: with ``os._exit``, not
    the interpreter's teardown. Torch's distributed objects (gloo's threads, the rendezvous
    store's) are otherwise left to the C++ runtime's teardown, which in this project's CI ended a
    rank of the tensor-parallel example with SIGABRT ("terminate called without an active
    exception") after it had written its results, its process group destroyed, in two of four
    runs of the suite on one day (as it had the Lightning example's ranks before)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_distributed(device_type: str) -> Context:
    """``init_process_group`` for this rank (gloo on the CPU, NCCL on its own GPU) and
    deterministic algorithms."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.use_deterministic_algorithms(True)
    if device_type == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise SystemExit(f"rank {rank} needs GPU {local_rank}, but {torch.cuda.device_count()} are visible; "
                             "use --device cpu or fewer processes")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=dt.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        # Share the cores among the ranks: oversubscribed intra-op threads slow gloo badly.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        dist.init_process_group("gloo", timeout=dt.timedelta(minutes=10))
    return Context(rank, world, local_rank, device, dist.get_backend())


# ---------------------------------------------------------------- one mode
@dataclass
class ModeResult:
    """What one mode did on one rank."""

    mode: str
    impl: str | None
    step_ms: list[float]
    median_step_ms: float | None
    peak_memory_bytes: int | None
    offloaded_bytes: list[int]  # per step
    audit: dict[str, Any]
    losses: list[float | None]
    loss_digests: list[str | None]
    grad_digests: list[dict[str, str | None]]  # per step: parameter name -> digest of its local gradient
    # (the results JSON holds one digest per step: combined_digest)
    extra: dict[str, Any] = field(default_factory=dict)
    # the most the caching allocator reserved in a step (forward and backward; what a budget bounds)
    step_reserved_peak_bytes: int | None = None
    bitwise_equal_to_none: bool | None = None
    first_difference: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Everything but the per-parameter digests, which become one digest per step."""
        out = dataclasses.asdict(self)
        out["grad_digests"] = [combined_digest(step) for step in self.grad_digests]
        return out

    def ok(self) -> bool:
        """Bitwise equal to ``none`` (``none`` itself counts), the audit passed, every check held."""
        checks = self.extra.get("checks", {})
        return (self.bitwise_equal_to_none is not False and (not self.audit or self.audit["ok"])
                and all(checks.values()))


def run_mode(ctx: Context, args: argparse.Namespace, mode: str, build: BuildFn) -> ModeResult:
    """Train ``args.steps`` steps of a fresh model in ``mode``; see the module docstring."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    trainee = build(ctx, args, mode)
    off: ao.Offloader | None = None
    audit: ActivationAudit | None = None
    if mode == "offload":
        # every step offloads (no recomputing warm-up): the audit and the step times are of offloading
        warmup = {"warmup": "offload"} if args.impl == "fast" else {}
        off = ao.Offloader(impl=args.impl, device=ctx.device, keep_last=args.keep_last,
                           min_offload_bytes=args.min_offload_bytes, **warmup)
        audit = ActivationAudit(trainee.held, ctx.device, off.min_offload_bytes)
        off.add_observer(audit)
        trainee.on_offloader(off)
        unwatch = audit.watch(trainee.blocks)
        unwrap = ao.wrap(trainee.blocks, off, names=trainee.block_names).remove

        def undo() -> None:
            unwrap()
            unwatch()

    elif mode == "budget":
        # (no keep_last: the budget's plan chooses what stays)
        off = ao.Offloader(impl="fast", device=ctx.device, min_offload_bytes=args.min_offload_bytes,
                           memory_budget=args.memory_budget)
        trainee.on_offloader(off)
        undo = ao.wrap(trainee.blocks, off, names=trainee.block_names).remove
    elif mode == "checkpoint":
        undo = checkpoint_each(trainee.blocks)
    else:
        def undo() -> None:
            pass
    _sync(ctx.device)
    step_ms: list[float] = []
    step_peaks: list[int] = []
    optimizer_peak = 0
    offloaded: list[int] = []
    losses: list[float | None] = []
    loss_digests: list[str | None] = []
    grads: list[dict[str, str | None]] = []
    audits: list[dict[str, Any]] = []
    step_reserved: list[int] = []  # what the allocator reserved at most in each step: what a budget bounds
    peaks = Peaks(ctx.device)  # (a budget resets the peak counters inside its steps)
    for i in range(args.steps):
        dist.barrier()  # every rank starts the step together: times are of the step, not of skew
        _sync(ctx.device)
        with peaks:
            peaks.start()
            t0 = time.perf_counter()
            loss = trainee.step(i)
            _sync(ctx.device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            reserved, allocated = peaks.read()
        if allocated is not None:
            step_peaks.append(allocated)
            step_reserved.append(reserved)
        if off is not None and audit is not None:
            off.synchronize()
            step_audit = audit.take_step()
            audits.append(step_audit)
            offloaded.append(step_audit["offloaded_bytes"])
        elif off is not None:  # a budget: what its plan moved this step
            off.synchronize()
            offloaded.append(off.stats()["offloaded_bytes"])
        else:
            offloaded.append(0)
        losses.append(None if loss is None else float(loss.detach().float().mean()))  # mean of micro-batches
        loss_digests.append(None if loss is None else digest(loss))
        grads.append({name: None if p.grad is None else digest(p.grad) for name, p in trainee.named_params})
        trainee.optimizer.step()
        trainee.optimizer.zero_grad(set_to_none=True)
        if ctx.device.type == "cuda":  # the mode's peak counts the optimizer's steps too (its state, made at the first)
            _sync(ctx.device)
            optimizer_peak = max(optimizer_peak, torch.cuda.max_memory_allocated(ctx.device))
    peak = max(step_peaks + [optimizer_peak]) if step_peaks else None
    extra = trainee.report(off)
    if mode == "budget":
        assert off is not None
        plan = off.stats()["plan"]
        extra["budget"] = {"memory_budget": plan["memory_budget"], "state": plan["state"],
                           "settled": plan["settled"], "step_peak_bytes": step_peaks,
                           "step_reserved_peak_bytes": step_reserved,
                           "actions": [g["action"] for g in plan.get("groups", [])]}
        if step_reserved:  # (the CPU has no allocator to read: the budget counts what the groups save)
            checks = extra.setdefault("checks", {})
            checks["within_budget_every_step"] = max(step_reserved) <= plan["memory_budget"]
        extra.setdefault("summary", []).append(
            f"budget {plan['memory_budget'] / MiB:,.1f} MiB, plan {plan['state']}"
            + (f", step peaks up to {max(step_reserved) / MiB:,.1f} MiB reserved" if step_reserved else ""))
    undo()
    timed = step_ms[1:] or step_ms  # the first step warms up
    return ModeResult(mode, args.impl if mode == "offload" else "fast" if mode == "budget" else None, step_ms, statistics.median(timed), peak,
                      offloaded, merge_audits(audits) if audits else {}, losses, loss_digests, grads, extra,
                      max(step_reserved) if step_reserved else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checkpoint_each(modules: Sequence[torch.nn.Module]) -> Callable[[], None]:
    """Activation checkpointing of each module (non-reentrant), by patching its forward, so it
    sits inside FSDP's and DDP's hooks; returns the undo."""
    patched: list[tuple[torch.nn.Module, Callable[..., Any], bool]] = []
    for m in modules:
        inner = m.forward

        def forward(*a: Any, _inner: Callable[..., Any] = inner, **k: Any) -> Any:
            return checkpoint(_inner, *a, use_reentrant=False, **k)

        patched.append((m, inner, "forward" in vars(m)))
        m.forward = forward

    def remove() -> None:
        for m, inner, had_own in patched:
            if had_own:
                m.forward = inner
            else:
                del m.forward

    return remove


def digest(t: torch.Tensor) -> str:
    """A hash of the bytes of ``t`` (of a DTensor: of this rank's local shard)."""
    if hasattr(t, "to_local"):  # DTensor: the shard this rank holds
        t = t.to_local()
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


def combined_digest(digests: dict[str, str | None]) -> str:
    """One digest for a step's gradients: of every parameter's name and digest, in order."""
    return hashlib.blake2b(repr(sorted(digests.items())).encode(), digest_size=16).hexdigest()


# ---------------------------------------------------------------- the audit
class ActivationAudit(ao.Observer):
    """An account, independent of the offloader's policy, of what each committed group may move.

    Every buffer saved in a group is sorted, when it is saved, into *held* (its storage is a
    parameter's storage of the model at that moment, an unsharded FSDP2 parameter included,
    or it is a leaf that requires grad, such as a pipeline stage's received input, which
    autograd holds for the whole step anyway) or *activation* (anything else on the compute
    device). At the commit the audit compares: bytes the offloader moved must equal the
    activation bytes (each storage's span its aliases cover, spans of at least
    ``min_offload_bytes``), and every held buffer must be reported kept as ``parameter``.
    A parameter moved would show as more bytes moved than activations, or fewer kept.

    Observers see group names, which repeat once a backward has begun (a pipeline's next
    micro-batch), so :meth:`watch` marks where each block's forward, hence a new group,
    begins. Exact when a group is committed (or kept for good) before a group of the same
    name opens again: with at least ``keep_last`` wrapped blocks per forward.
    """

    def __init__(self, held: Callable[[], Iterable[torch.Tensor]], device: torch.device, min_offload_bytes: int):
        self._held = held
        self._device = device
        self._min = min_offload_bytes
        self._open: dict[str, _Saves] = {}
        self._groups: list[dict[str, Any]] = []
        self._new_group = True

    def watch(self, blocks: Sequence[torch.nn.Module]) -> Callable[[], None]:
        """Mark the start of every forward of ``blocks``; returns the undo."""
        handles = [b.register_forward_pre_hook(lambda *_: self._begin_group()) for b in blocks]

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove

    def _begin_group(self) -> None:
        self._new_group = True

    def on_save(self, group: str, tensor: torch.Tensor) -> None:
        if self._new_group:  # a group's first save: what the model's parameters are right now
            self._open[group] = _Saves({_storage_key(p) for p in _plain(self._held())})
            self._new_group = False
        saves = self._open[group]
        if tensor.device.type != self._device.type or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            saves.other += 1
            return
        key = _storage_key(tensor)
        base = tensor._base if tensor._base is not None else tensor
        if key in saves.held_keys or (base.is_leaf and base.requires_grad):
            saves.held += 1
            return
        lo, hi = _extent(tensor)
        old = saves.spans.get(key)
        saves.spans[key] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    def on_commit(self, group: str, summary: dict[str, Any]) -> None:
        saves = self._open.pop(group, _Saves(set()))
        if summary.get("kept", {}).get("keep_last") and not summary["offloaded"]:
            return  # decided without a commit: backward reached it first (keep_last)
        expected = sum(hi - lo for lo, hi in saves.spans.values() if hi - lo >= self._min)
        kept_parameter = summary.get("kept", {}).get("parameter", 0)
        self._groups.append({
            "group": group,
            "offloaded_bytes": summary["offloaded_bytes"],
            "activation_bytes": expected,
            "held_saves": saves.held,
            "kept_parameter": kept_parameter,
            "kept": dict(summary.get("kept", {})),
            "ok": summary["offloaded_bytes"] == expected and kept_parameter == saves.held,
        })

    def take_step(self) -> dict[str, Any]:
        """The committed groups since the last call; forget groups that were never committed."""
        groups, self._groups, self._open = self._groups, [], {}
        return {
            "ok": all(g["ok"] for g in groups),
            "groups_committed": len(groups),
            "offloaded_bytes": sum(g["offloaded_bytes"] for g in groups),
            "activation_bytes": sum(g["activation_bytes"] for g in groups),
            "held_saves": sum(g["held_saves"] for g in groups),
            "kept_parameter": sum(g["kept_parameter"] for g in groups),
            "mismatches": [g for g in groups if not g["ok"]],
        }


@dataclass
class _Saves:
    held_keys: set[int]
    held: int = 0
    other: int = 0
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)


def merge_audits(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's audit: the last step's figures, ``ok`` over all steps."""
    last = dict(steps[-1])
    last["ok"] = all(s["ok"] for s in steps)
    last["mismatches"] = [m for s in steps for m in s["mismatches"]][:10]
    return last


def _plain(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    for t in tensors:
        yield t.to_local() if hasattr(t, "to_local") else t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[first, end)`` of its storage that ``t`` can touch."""
    es, first = t.element_size(), int(t.storage_offset())
    if t.numel() == 0:
        return first * es, first * es
    last = first + sum((int(n) - 1) * int(stride) for n, stride in zip(t.shape, t.stride()))
    return first * es, (last + 1) * es


# ---------------------------------------------------------------- comparing and reporting
def compare(results: dict[str, ModeResult]) -> None:
    """Mark each mode bitwise equal to ``none`` or not (losses and every local gradient, every
    step, and the example's invariants)."""
    ref = results["none"]
    for mode, r in results.items():
        if mode == "none":
            continue
        r.bitwise_equal_to_none, r.first_difference = True, None
        differing = [k for k, v in r.extra.get("invariants", {}).items() if ref.extra["invariants"].get(k) != v]
        if differing:
            r.bitwise_equal_to_none, r.first_difference = False, f"{differing[0]} differs from none"
            continue
        for i, (a, b) in enumerate(zip(ref.grad_digests, r.grad_digests)):
            if ref.loss_digests[i] != r.loss_digests[i]:
                r.bitwise_equal_to_none, r.first_difference = False, f"step {i}: loss"
                break
            differing = [n for n in a if a[n] != b.get(n)]
            if differing:
                r.bitwise_equal_to_none = False
                r.first_difference = f"step {i}: grad of {differing[0]} (+{len(differing) - 1} more)"
                break


def _rank_main(name: str, build: BuildFn, args: argparse.Namespace) -> int:
    ctx = init_distributed(args.device)
    mode = "setup"
    try:
        results: dict[str, ModeResult] = {}
        for mode in args.modes:
            results[mode] = run_mode(ctx, args, mode, build)
        compare(results)
    except BaseException as e:
        # Say loudly where it failed (the traceback follows from the launcher or torchrun).
        print(f"\n[rank {ctx.rank}] mode {mode!r} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    per_rank: list[Any] = [None] * ctx.world
    dist.all_gather_object(per_rank, {"rank": ctx.rank, "ok": {m: r.ok() for m, r in results.items()},
                                      "modes": {m: r.to_json() for m, r in results.items()}})
    ok = all(mode_ok for rank in per_rank for mode_ok in rank["ok"].values())
    if ctx.rank == 0:
        report = {
            "example": name,
            "ok": ok,
            "world_size": ctx.world,
            "backend": ctx.backend,
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "provenance": describe(ctx.device),
            "bitwise_equal_to_none": {m: [rank["modes"][m]["bitwise_equal_to_none"] for rank in per_rank]
                                      for m in args.modes if m != "none"},
            "ranks": per_rank,
        }
        print_table(report)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(results_json(report))
            print(f"wrote {args.out}")
    # leave together: a rank tearing gloo down while another still talks to it can abort
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def print_table(report: dict[str, Any]) -> None:
    """One row per rank and mode."""
    prov, cfg = report["provenance"], report["config"]
    print(f"\n{report['example']}: world {report['world_size']} ({report['backend']}, {prov['gpu']}), "
          f"d={cfg['d_model']} layers={cfg['layers']} seq={cfg['seq_len']} batch={cfg['batch']} {cfg['dtype']}, "
          f"{cfg['steps']} steps, torch {prov['torch']}, commit {prov['commit']}")
    head = ["rank", "mode", "impl", "step ms", "peak MiB", "offloaded MiB/step", "grads == none", "audit"]
    rows = []
    for rank in report["ranks"]:
        for m, r in rank["modes"].items():
            eq = {None: "(reference)", True: "yes (bitwise)", False: f"NO: {r['first_difference']}"}[r["bitwise_equal_to_none"]]
            a, failed = r["audit"], [k for k, v in r["extra"].get("checks", {}).items() if not v]
            audit = "-" if not a else (f"ok ({a['kept_parameter']} param saves kept)" if a["ok"] else "MISMATCH")
            if failed:
                audit += f"; FAILED: {', '.join(failed)}"
            rows.append([str(rank["rank"]), m, r["impl"] or "-", f"{r['median_step_ms']:.1f}",
                         "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / MiB:,.1f}",
                         f"{r['offloaded_bytes'][-1] / MiB:,.3f}", eq, audit])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head, *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    for rank in report["ranks"]:
        for m, r in rank["modes"].items():
            for line in r["extra"].get("summary", []):
                print(f"rank {rank['rank']} {m}: {line}")
    print("OK: every mode bitwise equal to none on every rank" if report["ok"] else "FAILED: see the rows above")
