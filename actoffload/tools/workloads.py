"""What ``actoffload bench`` and the pytest-benchmark suites in benchmarks/ measure.

Each case is written once here, and both harnesses run it: bench times it with its own
loops (CUDA events, medians, memory) into the results JSON, the suites hand it to
pytest-benchmark. The cases:

- copies: one group's offload + reload round trip through fast (:func:`group_round_trip`),
  against one copy per tensor (:func:`copy_per_tensor`), with copy times read through an
  observer (:class:`CopyTimer`);
- training steps: forward + backward of a stack of blocks in a mode such as ``"fast"`` or
  ``"fast:inflight=2"`` (:class:`TrainingStep`);
- hook overhead: many tiny ops, each saving one tensor (:func:`tiny_op_stack`).
"""

from __future__ import annotations

from typing import Any

import torch

import actoffload as ao
from .models import Block, GPTConfig

# Training-step modes side by side: fast as it comes (max_inflight=1) and with two groups in flight
STEP_MODES = ("none", "fast", "fast:inflight=2", "save_on_cpu", "ref")
HOOK_MODES = ("none", "ref_kept", "fast_kept", "fast_offloaded")
_MODE_SETTINGS = {"inflight": "max_inflight"}  # short names in a mode string


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU (a no-op on the CPU), so that a host timer sees finished work."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- copies
class SaveMany(torch.autograd.Function):
    """Saves the given tensors for backward and passes the gradient through: one group of
    exactly those tensors, to time copy throughput."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g,) + (None,) * len(ctx.saved_tensors)


def random_bytes(sizes: list[int], device: torch.device | str) -> list[torch.Tensor]:
    """One uint8 tensor of each size, filled with random bytes.

    Example::

        tensors = random_bytes([64 << 10] * 1000, "cuda")
    """
    return [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in sizes]


def copy_per_tensor(tensors: list[torch.Tensor], hosts: list[torch.Tensor], direction: str) -> None:
    """One copy per tensor, as an offloader with a copy per saved tensor makes them:
    ``"d2h"`` device to host, ``"h2d"`` back. Enqueued only (``non_blocking``).

    Example::

        hosts = [torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors]
        copy_per_tensor(tensors, hosts, "d2h"); copy_per_tensor(tensors, hosts, "h2d"); sync()
    """
    for t, h in zip(tensors, hosts):
        if direction == "d2h":
            h.copy_(t, non_blocking=True)
        else:
            t.copy_(h, non_blocking=True)


def group_offloader(device: torch.device | str, **settings: Any) -> ao.Offloader:
    """fast, set to move every tensor of a group at its exit and reload it only when asked:
    one group's copies, and nothing else, in each :func:`group_round_trip`.

    Example::

        off = group_offloader("cuda", pack_below=0)   # every tensor in a copy of its own
    """
    return ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=0, prefetch=0, **settings)


def group_round_trip(off: ao.Offloader, x: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Offload ``tensors`` as one group and reload them in its backward; returns when done.

    ``x`` is a tensor that requires grad (the graph's input). The copy out finishes before
    backward starts, so backward really reloads (rather than using the sources in place).

    Example::

        x = torch.zeros(1, device="cuda", requires_grad=True)
        group_round_trip(group_offloader("cuda"), x, random_bytes([1 << 20] * 8, "cuda"))
    """
    with off.group("g"):
        y = SaveMany.apply(x, *tensors)
    off.synchronize()
    y.sum().backward()
    sync(x.device)


class CopyTimer(ao.Observer):
    """Collects the copy batches an offloader reports (fast on CUDA) and sums their times.

    Example::

        timer = CopyTimer()
        with off.add_observer(timer):
            group_round_trip(off, x, tensors)
        timer.seconds("d2h"), timer.nbytes("d2h")
    """

    def __init__(self) -> None:
        self.copies: list[tuple[str, int, Any, Any]] = []

    def on_copy(self, direction: str, nbytes: int, start: Any, end: Any) -> None:
        self.copies.append((direction, nbytes, start, end))

    def seconds(self, direction: str) -> float:
        """Copy-stream time of this direction's batches (their events must have completed)."""
        return sum(s.elapsed_time(e) for d, _, s, e in self.copies if d == direction) / 1e3

    def nbytes(self, direction: str) -> int:
        return sum(n for d, n, _, _ in self.copies if d == direction)

    def clear(self) -> None:
        self.copies.clear()


# ---------------------------------------------------------------- training steps
def make_stack(cfg: GPTConfig, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Sequential:
    """``cfg.n_layers`` transformer blocks (no embedding), from seed 0.

    Example::

        stack = make_stack(GPTConfig(d_model=64, n_heads=4, n_layers=3, seq_len=32), "cpu", torch.float32)
    """
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layers)]).to(device=device, dtype=dtype)


def parse_mode(mode: str) -> tuple[str, dict[str, int]]:
    """``"fast:inflight=2"`` -> ``("fast", {"max_inflight": 2})``: an implementation (or
    ``none``, ``save_on_cpu``) and constructor settings of the offloader.

    >>> parse_mode("fast:inflight=2,prefetch=0")
    ('fast', {'max_inflight': 2, 'prefetch': 0})
    """
    impl, _, rest = mode.partition(":")
    settings = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value.isdigit():
            raise ValueError(f"mode {mode!r}: settings are written key=int, e.g. 'fast:inflight=2'")
        settings[_MODE_SETTINGS.get(key, key)] = int(value)
    if impl in ("none", "save_on_cpu") and settings:
        raise ValueError(f"mode {mode!r}: {impl} takes no settings")
    return impl, settings


class TrainingStep:
    """Forward + backward of ``stack`` on a fresh copy of ``x`` in one mode of
    :data:`STEP_MODES`: ``none``, ``save_on_cpu``, or an implementation with settings
    (``"fast:inflight=2"`` builds ``ao.Offloader(impl="fast", max_inflight=2)``), each
    block one group.

    Example::

        with TrainingStep(stack, x, "fast", device) as step:
            step()                           # one whole step, finished on return
            out = step.forward()             # or in parts, to look in between
            step.backward(out); step.zero_grad()   # zero_grad also drops the input
    """

    def __init__(self, stack: torch.nn.Sequential, x: torch.Tensor, mode: str, device: torch.device | str,
                 keep_last: int = 1, min_offload_bytes: int | None = None):
        """``min_offload_bytes``: the offloader's, where the mode sets none (else its default:
        on a small stack, whose tensors are all under it, nothing would move)."""
        self.stack, self.x, self.mode, self.device = stack, x, mode, torch.device(device)
        impl, settings = parse_mode(mode)
        if min_offload_bytes is not None and impl not in ("none", "save_on_cpu"):
            settings.setdefault("min_offload_bytes", min_offload_bytes)
        self.off: ao.Offloader | None = None
        self._handle = None
        if impl not in ("none", "save_on_cpu"):
            if impl == "fast":  # every step offloads (no recomputing warm-up): steps of offloading are timed
                settings.setdefault("warmup", "offload")
            self.off = ao.Offloader(impl=impl, device=device, keep_last=keep_last, **settings)
            self._handle = ao.wrap(stack, self.off)
        self.inp: torch.Tensor | None = None

    def new_input(self) -> torch.Tensor:
        """A fresh copy of ``x`` for the next forward (made by :meth:`forward` if not before).

        A leaf that requires grad, as a data batch would be: autograd holds it for the whole
        step, so no offloader moves it."""
        self.inp = self.x.clone().requires_grad_(True)
        return self.inp

    def forward(self) -> torch.Tensor:
        if self.inp is None:
            self.new_input()
        if self.mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda"):
                return self.stack(self.inp)
        return self.stack(self.inp)

    def backward(self, out: torch.Tensor) -> None:
        out.float().square().mean().backward()

    def grads(self) -> list[torch.Tensor]:
        """The input's gradient, then every parameter's (after :meth:`backward`)."""
        out = []
        for g in [self.inp.grad if self.inp is not None else None] + [p.grad for p in self.stack.parameters()]:
            if g is None:
                raise RuntimeError("no gradient yet: call backward() before grads()")
            out.append(g)
        return out

    def zero_grad(self) -> None:
        for p in self.stack.parameters():
            p.grad = None
        self.inp = None

    def __call__(self) -> None:
        self.backward(self.forward())
        self.zero_grad()
        sync(self.device)

    def remove(self) -> None:
        """Unwrap the stack (it is as before)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> TrainingStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


# ---------------------------------------------------------------- hook overhead
def hook_offloader(mode: str, device: torch.device | str) -> ao.Offloader | None:
    """The offloader of a :data:`HOOK_MODES` mode: ``"none"`` (None), ``"<impl>_kept"``
    (its hooks run, nothing moves) or ``"<impl>_offloaded"`` (every saved tensor moves).

    Example::

        tiny_op_stack(torch.randn(256), hook_offloader("fast_kept", "cpu"), 400, 100)
    """
    if mode == "none":
        return None
    impl, what = mode.split("_")
    return ao.Offloader(impl=impl, device=device, keep_last=1,
                        min_offload_bytes=0 if what == "offloaded" else 1 << 40)


def tiny_op_stack(x0: torch.Tensor, off: ao.Offloader | None, ops: int, group_size: int) -> None:
    """``ops`` tiny ops, each saving one tensor, ``group_size`` to a group; then backward,
    finished on return. ``off=None`` runs without an offloader: the difference is the
    hooks' host time.

    Example::

        tiny_op_stack(torch.randn(256), None, 400, 100)
    """
    h = x0.clone().requires_grad_(True)
    x = h
    for g in range(ops // group_size):
        if off is None:
            for _ in range(group_size):
                x = x.sin()
        else:
            with off.group(str(g)):
                for _ in range(group_size):
                    x = x.sin()  # saves its input: one saved tensor per op
    x.sum().backward()
    sync(x0.device)
