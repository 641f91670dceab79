"""Bugs planted in fast on purpose: the suite must catch each (proof that it can fail).

Each is a context manager that patches ``FastOffloader`` for its duration.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch

import sys

from actoffload import marks, multibuffer
from actoffload.fast import FastOffloader
from actoffload.sharing import SharedStorages
from actoffload.records import MultiHandle, SavedBuffer


@contextlib.contextmanager
def free_source_before_copy_done():
    """(a) Release a copy's sources as soon as it is enqueued, with no wait, and without
    telling the allocator that the copy stream still reads them."""

    def reap(self):
        with self._inflight_lock:
            while self._inflight:
                self._release_sources(self._inflight.popleft())

    with mock.patch.object(FastOffloader, "_reap", reap), \
            mock.patch.object(torch.Tensor, "record_stream", lambda self, stream: None):
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
        if type(handle) is MultiHandle and all(p is None or (isinstance(p, SavedBuffer) and p.view is None)
                                               for p in handle.parts):
            return handle.parts[0].tensor
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


@contextlib.contextmanager
def drop_conj_neg_bits():
    """(e) Rebuild moved tensors with set_() alone, losing their conjugate and negative bits."""
    restore = FastOffloader._restore

    def buggy_restore(self, group, s):
        out = restore(self, group, s)
        if out.is_neg():
            out = out.neg().neg()  # materialised: the same values, but not the lazy view
            out = out.resolve_neg().neg()  # and then negated: what dropping the bit gives
        return out.conj() if out.is_conj() else out

    with mock.patch.object(FastOffloader, "_restore", buggy_restore):
        yield


@contextlib.contextmanager
def hold_detached_parameters():
    """(f) Keep a saved parameter as the detach() alias taken at save time, so a later
    ``.data`` replacement goes unseen by backward."""
    add = FastOffloader._add

    def buggy_add(self, group, t):
        s = add(self, group, t)
        if s.tensor is t:
            s.tensor = t.detach()
        return s

    with mock.patch.object(FastOffloader, "_add", buggy_add):
        yield


@contextlib.contextmanager
def parameters_only_through_base():
    """(g) Recognise parameters only through ``_base``: a detached weight view moves."""
    plan, add, flags_of = FastOffloader._plan, FastOffloader._add, marks.flags_of

    def buggy_plan(self, group, committed):
        with mock.patch.object(marks, "flags_of", lambda key: flags_of(key) & ~marks.PARAMETER):
            return plan(self, group, committed)

    def buggy_add(self, group, t):
        with mock.patch.object(marks, "is_parameter_storage", lambda t: False):
            return add(self, group, t)

    with mock.patch.object(FastOffloader, "_plan", buggy_plan), mock.patch.object(FastOffloader, "_add", buggy_add):
        yield


@contextlib.contextmanager
def wrap_fails_inside_except():
    """(h) Judge a wrapped module's forward failed whenever an exception is being handled."""
    from actoffload import wrapping

    close = wrapping._close

    def buggy_close(group, failed):
        fast = group._offloader.impl == "fast"
        return close(group, failed or (fast and sys.exc_info()[0] is not None))

    with mock.patch.object(wrapping, "_close", buggy_close):
        yield


@contextlib.contextmanager
def move_shared_storage_twice():
    """(i) Copy out a storage that an earlier group already moved. ref and fast share the
    registry of moved storages (``actoffload.sharing``): only fast's instance forgets."""
    copy_of, init = SharedStorages.copy_of, FastOffloader.__init__

    def forgetting(self: SharedStorages, key: int, aliases: object):
        return None if getattr(self, "_planted_in_fast", False) else copy_of(self, key, aliases)

    @functools.wraps(init)  # the offloader checks settings against the signature
    def fast_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._shared._planted_in_fast = True

    with mock.patch.object(SharedStorages, "copy_of", forgetting), mock.patch.object(FastOffloader, "__init__", fast_init):
        yield


@contextlib.contextmanager
def subclass_as_plain_tensor():
    """(j) Treat a wrapper subclass as one plain tensor instead of its inner tensors."""
    pack, is_multibuffer = FastOffloader._pack, multibuffer.is_multibuffer

    def buggy_pack(self, group, t):
        with mock.patch.object(multibuffer, "is_multibuffer", multibuffer.speaks_r7):
            return pack(self, group, t)

    with mock.patch.object(FastOffloader, "_pack", buggy_pack):
        yield


BUGS = {
    "free_source_before_copy_done": (free_source_before_copy_done, "cuda"),
    "ignore_veto": (ignore_veto, "any"),
    "skip_restore_when_nothing_moved": (skip_restore_when_nothing_moved, "any"),
    "use_reload_before_done": (use_reload_before_done, "cuda"),
    "drop_conj_neg_bits": (drop_conj_neg_bits, "any"),
    "hold_detached_parameters": (hold_detached_parameters, "any"),
    "parameters_only_through_base": (parameters_only_through_base, "any"),
    "wrap_fails_inside_except": (wrap_fails_inside_except, "any"),
    "move_shared_storage_twice": (move_shared_storage_twice, "any"),
    "subclass_as_plain_tensor": (subclass_as_plain_tensor, "any"),
}
