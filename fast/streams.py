"""Copy streams and events: the only way fast/ orders work between streams.

On CUDA: a device-to-host stream and a host-to-device stream beside the compute
stream, ordered by CUDA events alone (no host synchronization in the steady state).
On the CPU the same calls run synchronously, so the logic above them is the same and
testable without a GPU.
"""

from __future__ import annotations

import contextlib

import torch


class _DoneEvent:
    """Stand-in for an event on the CPU, where every copy has finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_DONE = _DoneEvent()
_NOTHING = contextlib.nullcontext()  # where there is no stream to enter (reentrant: it does nothing)


class CopyStreams:
    """The compute stream and two copy streams of one device.

    Example::

        streams = CopyStreams(torch.device("cuda"))
        ready = streams.record()                 # on the compute stream
        with streams.on_d2h(after=ready):        # copies wait for the compute work before them
            host.copy_(src, non_blocking=True)
        done = streams.record(streams.d2h)
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h: torch.cuda.Stream | None = None
        self.h2d: torch.cuda.Stream | None = None
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def record(self, stream=None):
        """An event marking the work enqueued so far on ``stream`` (default: the current one)."""
        if not self.cuda:
            return _DONE
        return (stream or torch.cuda.current_stream(self.device)).record_event()

    def wait(self, event, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait for ``event``, without blocking the host."""
        if self.cuda and event is not None and not isinstance(event, _DoneEvent):
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    @contextlib.contextmanager
    def _on(self, stream, after):
        if not self.cuda:
            yield
            return
        for event in after:
            self.wait(event, stream)
        with torch.cuda.stream(stream):
            yield

    def on_d2h(self, *after):
        """Run the block on the device-to-host stream, after the given events."""
        return self._on(self.d2h, after) if self.cuda else _NOTHING

    def on_h2d(self, *after):
        """Run the block on the host-to-device stream, after the given events."""
        return self._on(self.h2d, after) if self.cuda else _NOTHING
