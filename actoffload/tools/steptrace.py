"""One training step under PyTorch's profiler: its memory timeline and its bus copies.

The demo profiles one step per configuration (outside the timed steps) and reads back
from the trace:

- allocated memory after every allocation and free, on the compute device, with the
  step's forward and backward marked (for ``--plot``);
- every device-to-host and host-to-device copy, for the achieved bandwidth of each
  direction: bytes copied divided by the time the copy engines were busy with that
  direction (the union of the copies' intervals on the GPU, so copies running side by
  side are not counted twice).

Both come from the Chrome trace the profiler exports, which is where it records copy
sizes and allocator totals.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class StepTrace:
    """What one profiled step did; times in ms from the start of its forward."""

    memory: list[tuple[float, int]] = field(default_factory=list)  # (ms, bytes allocated)
    forward_ms: tuple[float, float] = (0.0, 0.0)
    backward_ms: tuple[float, float] = (0.0, 0.0)
    copies: dict[str, list[tuple[float, float, int]]] = field(default_factory=lambda: {"d2h": [], "h2d": []})

    def copied_bytes(self, direction: str) -> int:
        return sum(n for _, _, n in self.copies[direction])

    def busy_ms(self, direction: str) -> float:
        """Time at least one copy of this direction was running (overlaps counted once)."""
        busy, end = 0.0, float("-inf")
        for start, stop, _ in sorted(self.copies[direction]):
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        return busy

    def gbps(self, direction: str) -> float | None:
        """Achieved GB/s of this direction's copies; None when the step made none."""
        ms = self.busy_ms(direction)
        return self.copied_bytes(direction) / ms / 1e6 if ms > 0 else None


class StepProfiler:
    """Profile the code inside ``step()``; mark its parts with ``phase(name)``.

    Example::

        prof = StepProfiler(device, memory=True)
        with prof.step():
            with prof.phase("forward"):
                loss = model(x)
            with prof.phase("backward"):
                loss.backward()
        trace = prof.trace
    """

    def __init__(self, device: torch.device, memory: bool = True):
        self.device = device
        self.memory = memory
        self.trace: StepTrace | None = None

    @contextlib.contextmanager
    def step(self):
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, profile_memory=self.memory)
        with _quiet_native_stderr():
            prof.start()
        try:
            yield self
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            with _quiet_native_stderr():
                prof.stop()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                self.trace = parse_trace(json.load(f), self.device)
        finally:
            os.unlink(path)

    @staticmethod
    def phase(name: str):
        return record_function(name)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 for a moment: the profiler's native library logs each start
    and stop there, which would interleave with the demo's table. Python errors still raise."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def parse_trace(data: dict | list, device: torch.device) -> StepTrace:
    """The memory timeline and bus copies of a Chrome trace exported by ``torch.profiler``."""
    events = data["traceEvents"] if isinstance(data, dict) else data
    marks = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("cat") == "user_annotation" and e.get("name") in ("forward", "backward")}
    if "forward" not in marks:
        raise ValueError("the trace has no 'forward' phase: wrap the forward in StepProfiler.phase('forward')")
    t0 = marks["forward"][0]
    ms = lambda ts: (ts - t0) / 1e3  # noqa: E731  (trace times are microseconds)
    out = StepTrace(forward_ms=tuple(map(ms, marks["forward"])),
                    backward_ms=tuple(map(ms, marks.get("backward", marks["forward"]))))
    device_type = 1 if device.type == "cuda" else 0  # the profiler's numbering: 0 CPU, 1 CUDA
    for e in events:
        args = e.get("args", {})
        if e.get("name") == "[memory]" and args.get("Device Type") == device_type:
            out.memory.append((ms(e["ts"]), int(args["Total Allocated"])))
        elif e.get("cat") == "gpu_memcpy":
            direction = "d2h" if "DtoH" in e["name"] else "h2d" if "HtoD" in e["name"] else None
            if direction is None:
                continue
            nbytes = args.get("bytes")
            if nbytes is None:  # older traces give only the bandwidth
                nbytes = args.get("memory bandwidth (GB/s)", 0) * e["dur"] * 1e3
            out.copies[direction].append((ms(e["ts"]), ms(e["ts"] + e["dur"]), int(nbytes)))
    out.memory.sort()
    return out
