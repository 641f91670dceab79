"""Bugs planted in fast on purpose: the suite must catch each (proof that it can fail).

Each is a context manager that patches ``FastOffloader`` for its duration.
"""

from __future__ import annotations

import contextlib
from unittest import mock

from actoffload import marks
from actoffload.engine import _MultiHandle
from actoffload.fast import FastOffloader


@contextlib.contextmanager
def free_source_before_copy_done():
    """(a) Release a copy's sources as soon as it is enqueued, with no wait."""

    def reap(self):
        with self._inflight_lock:
            while self._inflight:
                self._release_sources(self._inflight.popleft())

    with mock.patch.object(FastOffloader, "_reap", reap):
        yield


@contextlib.contextmanager
def ignore_veto():
    """(b) Plan fast's groups as if no tensor had been vetoed."""
    plan, flags_of = FastOffloader._plan, marks.flags_of

    def buggy_plan(self, group, committed):
        with mock.patch.object(marks, "flags_of", lambda key: flags_of(key) & ~marks.VETO):
            return plan(self, group, committed)

    with mock.patch.object(FastOffloader, "_plan", buggy_plan):
        yield


@contextlib.contextmanager
def skip_restore_when_nothing_moved():
    """(c) Hand back the first raw buffer instead of rebuilding an unmoved multi-buffer tensor."""
    unpack = FastOffloader._unpack

    def buggy_unpack(self, handle):
        if type(handle) is _MultiHandle and all(s is None or s.moved is None for s in handle.saved):
            return handle.saved[0].tensor
        return unpack(self, handle)

    with mock.patch.object(FastOffloader, "_unpack", buggy_unpack):
        yield


@contextlib.contextmanager
def use_reload_before_done():
    """(d) Return a reload without making the consumer wait for its copy."""

    def device_bytes(self, group, moved):
        if moved.dev is None:
            self._reload(group)
        return moved.dev if moved.dev is not None else moved.weak.get(self.device)

    with mock.patch.object(FastOffloader, "_device_bytes", device_bytes):
        yield


BUGS = {
    "free_source_before_copy_done": (free_source_before_copy_done, "cuda"),
    "ignore_veto": (ignore_veto, "any"),
    "skip_restore_when_nothing_moved": (skip_restore_when_nothing_moved, "any"),
    "use_reload_before_done": (use_reload_before_done, "cuda"),
}
