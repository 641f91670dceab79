"""fast/ mechanisms on their own: pool, packing decision, schedule (run on CPU and CUDA)."""

import gc
import threading

import pytest
import torch

import actoffload as ao
from actoffload.fast.pool import PinnedPool, size_class
from helpers import CUDA, DEVICES, assert_bitwise, grads_of, mlp_stack, reference_grads, run_groups, train_steps


@pytest.mark.parametrize("n", [0, 1, 4, 63, 64, 65, 1000, 4096, 123457, 1 << 20, (1 << 30) + 7])
def test_size_class_wastes_less_than_a_32nd_at_any_size(n):
    """No minimum block: R9's 5% must hold for a 4-byte tensor too."""
    c = size_class(n)
    assert n <= c <= n + n / 32 and (c == n or n >= 64)


def test_packing_adds_no_padding_and_keeps_the_widest_word_the_sizes_allow():
    from actoffload.fast.packing import Packer

    packer = Packer(torch.device("cpu"), "torch")
    assert packer.layout([4, 4, 4]) == ([0, 4, 8], 12)
    assert packer.layout([3, 16, 1]) == ([0, 3, 19], 20)
    assert packer.layout([32, 16, 48]) == ([0, 32, 48], 96)  # 16-aligned, as before
    assert packer.layout([]) == ([], 0)


def test_pool_reuses_blocks_of_a_size_class():
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    a = pool.get(5000)
    pool.put(a)
    b = pool.get(4999)  # same class (5120)
    assert b is a and pool.allocations == 1
    assert pool.in_use == size_class(5000) and pool.pooled == 0
    pool.put(b)
    assert pool.trim() == size_class(5000) and pool.pooled == 0


def test_pool_lets_its_free_blocks_go_where_an_allocation_would_pass_the_host_budget():
    """Free blocks count against the host budget: a class they cannot serve (too small to be cut
    from them) is still had within it, the free blocks given back first; with nothing free to
    give back the error stands, and nothing changed."""
    from actoffload.hostmem import HostMemory, HostMemoryError, exact_host_allocator

    host = HostMemory(exact_host_allocator, pinned=False, budget=12000)
    pool = PinnedPool(host.allocate)
    pool.put(pool.get(10000))  # a longer step's block, free now
    small = pool.get(5000)  # its class cannot be cut from it (under 1 MiB), and 10240 + 5120 > 12000
    assert small.size == size_class(5000) and pool.pooled == 0 and host.allocated == size_class(5000)
    with pytest.raises(HostMemoryError) as raised:
        pool.get(8000)  # nothing free to give back: over the budget
    assert raised.value.__context__ is None  # one error, not the retry's inside the first's
    assert pool.in_use == size_class(5000) and host.allocated == size_class(5000)
    pool.put(small)
    del small
    held = pool.get(500)  # 504 in use
    pool.put(pool.get(6000))  # 5120 and 6016 free
    with pytest.raises(HostMemoryError) as raised:
        pool.get(11600)  # both let go, and 504 + 11776 still pass 12000: the retry's error, alone
    assert raised.value.__context__ is None and pool.pooled == 0 and host.allocated == held.size


def test_fast_trains_varying_lengths_within_a_host_budget_the_longest_step_fits():
    """A shorter step after a longer one, within the host budget the longer one needed."""
    lengths = (64, 32, 64, 32)
    m = mlp_stack(4, 32, "cpu")
    off = ao.Offloader(impl="fast", device="cpu", warmup="offload", min_offload_bytes=0)
    ao.wrap(m, off)
    m(torch.randn(4, 64, 32)).sum().backward()
    need = off.stats()["offloaded_bytes"]
    m = mlp_stack(4, 32, "cpu")
    off = ao.Offloader(impl="fast", device="cpu", warmup="offload", min_offload_bytes=0, host_budget=need)
    ao.wrap(m, off)
    for t in lengths:
        m(torch.randn(4, t, 32)).square().mean().backward()  # raised HostMemoryError at t=32


def test_a_block_back_unread_keeps_its_copy_outs_event_for_whoever_frees_it():
    """A graph dropped before backward (or a group used in place) puts its blocks back unread:
    the copy out may still write them, and trim() must wait for it before letting them go."""
    off = ao.Offloader(impl="fast", device="cpu", warmup="offload", min_offload_bytes=0, keep_last=0)
    h = torch.randn(256, 256, requires_grad=True) * 2
    for i in range(3):
        with off.group(str(i)):
            h = h.sin()
    assert off.stats()["offloaded_bytes"] == 3 * 256 * 256 * 4
    del h
    gc.collect()
    free = [b for blocks in off._pool._free.values() for b in blocks]
    assert free and all(b.fence is not None for b in free)  # (on the CPU: an event already done)


class _Event:
    """A stand-in for a CUDA event: done or not, as set."""

    def __init__(self, done: bool):
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited, self.done = True, True


def test_pool_trim_waits_for_the_copies_reading_a_block_before_letting_it_go():
    """Pinned memory freed under a reload still reading it would be reused under the copy."""
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    block, done = pool.get(4 * MIB), pool.get(MIB)
    reading, read = _Event(False), _Event(True)
    block.read_until(reading)
    done.read_until(read)
    pool.put(block)
    pool.put(done)
    assert pool.trim() == 5 * MIB and reading.waited and not read.waited


MIB = 1 << 20


def test_pool_carves_a_smaller_class_out_of_a_larger_free_block_and_joins_the_pieces_again():
    """A step of another length reuses what a longer one pinned: no new allocation."""
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    whole = pool.get(32 * MIB)
    pool.put(whole)
    a = pool.get(24 * MIB)  # carved from the 32 MiB block
    b = pool.get(5 * MIB)  # from what is left of it
    assert pool.allocations == 1 and a.slab is b.slab is whole.tensor
    assert (a.offset, a.size, b.offset, b.size) == (0, 24 * MIB, 24 * MIB, 5 * MIB)
    assert a.tensor.data_ptr() == whole.tensor.data_ptr() and b.tensor.data_ptr() == whole.tensor.data_ptr() + 24 * MIB
    assert pool.in_use == 29 * MIB and pool.pooled == 3 * MIB
    pool.put(b)
    pool.put(a)
    assert pool.in_use == 0 and pool.pooled == 32 * MIB
    again = pool.get(32 * MIB)  # joined whole: served without allocating
    assert pool.allocations == 1 and (again.offset, again.size) == (0, 32 * MIB)
    pool.put(again)
    assert pool.trim() == 32 * MIB and pool.pooled == 0


def test_pool_cuts_pieces_on_page_boundaries_and_not_below_a_mebibyte():
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    pool.put(pool.get(8 * MIB))
    small = pool.get(100_000)  # under the least size worth cutting for: its own allocation
    assert pool.allocations == 2 and small.slab is small.tensor
    odd = pool.get(MIB + 1)
    assert odd.size % 4096 == 0 and size_class(MIB + 1) <= odd.size < size_class(MIB + 1) + 4096
    assert pool.allocations == 2


def test_pool_pieces_keep_the_reads_a_writer_must_wait_for():
    """A piece waits for its block's last read; a joined block for its pieces' reads not yet
    done; a new read stands for the earlier ones (it ran after its writer waited for them)."""
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    whole = pool.get(16 * MIB)
    read = _Event(done=False)
    whole.read_until(read)
    pool.put(whole)
    a, b = pool.get(4 * MIB), pool.get(4 * MIB)
    assert a.waits() == (read,) and b.waits() == (read,)
    later, finished = _Event(done=False), _Event(done=True)
    a.read_until(later)
    b.read_until(finished)
    pool.put(b)  # joins the rest
    pool.put(a)  # joins b and the rest: the reads not known to be done stay, its own among them
    joined = pool.get(16 * MIB)
    assert set(joined.waits()) == {read, later}
    newer = _Event(done=False)
    joined.read_until(newer)
    assert joined.waits() == (newer,)


def test_pool_trims_only_whole_allocations():
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    pool.put(pool.get(8 * MIB))
    piece = pool.get(2 * MIB)
    assert pool.trim() == 0 and pool.pooled == 6 * MIB  # the rest of an allocation in use stays
    pool.put(piece)
    assert pool.trim() == 8 * MIB and pool.pooled == 0


def test_fast_steps_of_shorter_inputs_after_a_longer_one_allocate_no_host_memory():
    model = mlp_stack(3, 512, "cpu")
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, pack_below=0)
    first = train_steps(off, model, 1, "cpu", batch=1024)[-1]["host_allocations"]
    for batch in (768, 512, 1024, 640):  # 1.5-3 MiB activations: carved from the longer step's blocks
        assert train_steps(off, model, 1, "cpu", batch=batch)[-1]["host_allocations"] == first
    assert off.stats()["host_bytes_in_use"] == 0


def test_owned_lock_runs_what_its_own_thread_hands_it_before_letting_go_and_makes_others_wait():
    from actoffload.locks import OwnedLock

    lock, ran = OwnedLock(), []
    with lock:
        assert lock.held_here()
        lock.run(ran.append, "inside")  # a finalizer's work, on the holding thread
        assert ran == []
        other = threading.Thread(target=lambda: ran.append(lock.held_here()))
        other.start()
        other.join()
    assert ran == [False, "inside"] and not lock.held_here()


def test_pool_a_block_freed_inside_a_section_holding_its_lock_goes_back_as_the_section_ends():
    """A collection pass that begins at an allocation inside the pool's lock may free a copy
    record, whose finalizer puts its blocks back: on that thread, put() must not wait for the
    lock (it would wait forever)."""
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    pool.put(pool.get(8 * MIB))
    block = pool.get(2 * MIB)
    with pool._lock:  # as get() would hold it
        pool.put(block)  # the finalizer's put, inside
        assert pool.in_use == 2 * MIB  # not yet: handed over
    assert pool.in_use == 0 and pool.pooled == 8 * MIB


def test_host_memory_a_buffer_freed_inside_a_section_holding_its_lock_is_counted_as_it_ends():
    from actoffload.hostmem import HostMemory, exact_host_allocator

    host = HostMemory(exact_host_allocator, pinned=False, budget=1 << 30)
    seen = []

    def section():
        buf = host.allocate(4096)
        with host._lock:
            del buf  # its finalizer runs here, on the thread holding the lock
            seen.append(host.allocated)
        seen.append(host.allocated)

    worker = threading.Thread(target=section, daemon=True)
    worker.start()
    worker.join(60)
    assert seen == [4096, 0], "the finalizer waited for the lock its own thread held"


@pytest.mark.parametrize("where", ["pool", "inflight", "host"])
def test_fast_graphs_freed_by_the_garbage_collector_never_hang_a_lock(where):
    """Forward outputs in reference cycles, dropped: their copy records are freed by a
    collection pass, which may begin at any allocation, here made to begin each time a lock
    that a finalizer takes is taken (the pool's: carving and joining allocate there; the
    copies in flight; the host memory's count)."""
    from actoffload.locks import OwnedLock

    class CollectingLock(OwnedLock):
        def __enter__(self):
            super().__enter__()
            gc.collect()  # a pass that begins inside the section
            return self

    model = mlp_stack(2, 256, "cpu")
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, pack_below=0)
    if where == "pool":
        off._pool._lock = CollectingLock()
    elif where == "inflight":
        off._inflight_lock = CollectingLock()
    else:
        off._host._lock = CollectingLock()
    done = []

    def steps():
        for i in range(8):
            x = torch.randn((1024, 768, 1536, 640)[i % 4], 256, requires_grad=True)
            holder = {"y": run_groups(model, x, off)}
            holder["self"] = holder  # freed only by the collector
            del holder, x
        done.append(True)

    worker = threading.Thread(target=steps, daemon=True)
    worker.start()
    worker.join(60)
    assert done, "a step hung: a finalizer waited for the lock its own thread held"
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fast_pool_stops_allocating_after_the_first_step_and_does_not_grow(device):
    model = mlp_stack(4, 64, device)
    off = ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=1)
    stats = train_steps(off, model, 20, device, batch=64)
    allocs = [s["host_allocations"] for s in stats]
    peaks = [s["host_bytes_in_use"] + s["host_bytes_pooled"] for s in stats]
    assert allocs[0] > 0 and allocs[-1] == allocs[0]
    assert max(peaks) == peaks[0]
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pack_below", [0, 1 << 30], ids=["no_packing", "all_packed"])
def test_fast_packed_and_direct_copies_give_identical_gradients(device, pack_below):
    model = mlp_stack(3, 48, device)
    x = torch.randn(16, 48, device=device, requires_grad=True)
    expected = reference_grads(model, x)
    off = ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=0, pack_below=pack_below,
                       max_inflight=2)
    run_groups(model, x, off).sum().backward()
    assert_bitwise(grads_of(model, x), expected)
    s = off.stats()
    spans = sum(g["offloaded"] for g in s["groups"].values())
    assert spans == 8  # group 0: fc1's and GELU's outputs (x is a leaf); 1, 2: their input too
    c = s["copies"]
    # up to max_inflight groups may still be copying out when backward starts (CUDA): then
    # they are used in place, not reloaded; on the CPU copies are synchronous, never in flight
    reused = c.get("reused_in_flight_groups", 0)
    assert reused <= off.max_inflight and (device == "cuda" or reused == 0)
    if pack_below:  # one packed copy per group out, one per reloaded group back
        assert c["packed_spans"] == 8 and c["d2h_copies"] == 3 and c["h2d_copies"] == 3 - reused
    else:  # one copy per span, each way
        assert c.get("packed_spans", 0) == 0 and c["d2h_copies"] == 8 and c["h2d_copies"] == 8 - 3 * reused
    assert s["packer"] == {"cuda": "triton", "cpu": "torch-reference"}[device]  # packer="auto"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_fast_prefetches_the_groups_before_the_one_in_backward(device, prefetch):
    model = mlp_stack(5, 32, device)
    off = ao.Offloader(impl="fast", device=device, min_offload_bytes=0, keep_last=1, prefetch=prefetch)
    run_groups(model, torch.randn(8, 32, device=device, requires_grad=True), off).sum().backward()
    got = off.stats()["copies"].get("prefetched_groups", 0)
    assert got == (0 if prefetch == 0 else 4)  # groups 0..3 were offloaded; 4 stayed (keep_last)


class _Pending:
    """An event that never completes by itself: every offload copy looks in flight."""

    def query(self):
        return False

    def synchronize(self):
        pass


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_fast_in_flight_groups_are_bounded_and_reused_in_place(monkeypatch, max_inflight):
    from actoffload.fast.streams import CopyStreams

    monkeypatch.setattr(CopyStreams, "record", lambda self, stream=None: _Pending())
    model = mlp_stack(5, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=1, prefetch=1,
                       max_inflight=max_inflight)
    y = run_groups(model, x, off).sum()
    assert len(off._inflight) == max_inflight  # older copies made compute wait
    assert off.stats()["copies"]["compute_waits"] == 4 - max_inflight  # of groups 0..3
    y.backward()
    c = off.stats()["copies"]
    # still in flight when backward reached them: used in place; the others came back
    assert c["reused_in_flight_groups"] == max_inflight
    assert c["h2d_copies"] == 4 - max_inflight
    assert_bitwise(grads_of(model, x), expected)
    del y
    gc.collect()
    assert len(off._inflight) == 0  # the reused group's sources went with its graph


@pytest.mark.parametrize("packer, name", [
    pytest.param("triton", "triton-interpreter", marks=pytest.mark.skipif(
        CUDA, reason="Triton's interpreter runs only where no GPU is visible (a GPU runs the kernels natively)")),
    ("torch", "torch-reference"),
])
def test_fast_packer_is_chosen_explicitly_and_both_give_identical_gradients(packer, name):
    # the Triton kernels' integration test on the CPU: packed offload and reload through
    # the interpreter (the kernels themselves are tested in test_triton_pack.py)
    model = mlp_stack(3, 48, "cpu")
    x = torch.randn(16, 48, requires_grad=True)
    expected = reference_grads(model, x)
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, pack_below=1 << 30,
                       packer=packer)
    run_groups(model, x, off).sum().backward()
    assert_bitwise(grads_of(model, x), expected)
    s = off.stats()
    assert s["packer"] == name and s["copies"]["packed_spans"] == 8


def test_pool_reserves_blocks_on_a_background_thread_and_serves_requests_from_them():
    calls = []

    def allocate(n):
        calls.append((n, threading.current_thread() is threading.main_thread()))
        return torch.empty(n, dtype=torch.uint8)

    pool = PinnedPool(allocate)
    pool.reserve([5000, 5000, 70000])
    pool.wait_reserved()
    assert sorted(calls) == sorted([(size_class(5000), False)] * 2 + [(size_class(70000), False)])
    assert pool.reserving == 0 and pool.pooled == 2 * size_class(5000) + size_class(70000)
    blocks = [pool.get(4999), pool.get(5000), pool.get(70000)]  # served by the reserved blocks
    assert len(calls) == 3 and pool.pooled == 0 and pool.allocations == 3
    pool.get(5000)  # a miss: allocated on the caller's thread
    assert calls[-1] == (size_class(5000), True)
    pool.put_all(blocks)


def test_pool_reserving_stops_at_the_first_failure_and_keeps_it():
    def allocate(n):
        if n > 10000:
            raise MemoryError("no room for it")
        return torch.empty(n, dtype=torch.uint8)

    pool = PinnedPool(allocate)
    pool.reserve([5000, 20000, 5000])
    pool.wait_reserved()
    assert pool.reserving == 0 and pool.pooled == size_class(5000)  # the one after the failure was dropped
    assert "no room" in str(pool.reserve_error)


def test_pool_reserving_survives_an_allocator_that_raises_anything():
    def allocate(n):
        raise OSError("mlock failed")

    pool = PinnedPool(allocate)
    pool.reserve([5000])
    pool.wait_reserved()  # returns: the worker is gone and says why
    assert pool.reserving == 0 and isinstance(pool.reserve_error, OSError)


def test_pool_expects_blocks_in_use_together_and_reserves_only_what_it_lacks():
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
    first = pool.expect([5000, 5000])
    pool.wait_reserved()
    assert pool.pooled == 2 * size_class(5000)
    first()  # that group is gone: a later one reuses its blocks
    pool.expect([5000, 5000])
    pool.wait_reserved()
    assert pool.allocations == 2


def test_fast_reloads_ahead_only_what_backward_needs_first_and_the_rest_on_arrival():
    """A prefetched group comes back in two parts: the spans its forward saved last (about
    half its bytes) ahead, the rest when backward reaches it; every byte exactly once."""
    from actoffload.fast import offloader as fast_offloader

    model = mlp_stack(4, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, prefetch=1, pack_below=0)
    calls = []
    reload = off._reload

    def recording(group, share=1.0):
        before = off.counters.get("h2d_bytes", 0)
        left = reload(group, share)
        calls.append((group.name, share, off.counters.get("h2d_bytes", 0) - before, left))
        return left

    off._reload = recording
    run_groups(model, x, off).sum().backward()
    assert_bitwise(grads_of(model, x), expected)
    share = fast_offloader.PREFETCH_SHARE
    ahead = [c for c in calls if c[1] == share]
    assert [c[0] for c in ahead] == ["2", "1", "0"]  # each reached group prefetches the one before
    assert all(c[3] for c in ahead)  # each left some spans for later
    for name, _, nbytes, _ in ahead:
        total = off.stats()["groups"][name]["offloaded_bytes"]
        rest = sum(c[2] for c in calls if c[0] == name and c[1] == 1.0)
        assert 0 < nbytes < total and nbytes + rest == total and nbytes >= share * total
    assert off.counters["h2d_bytes"] == off.stats()["offloaded_bytes"]


def test_fast_reloads_ahead_by_forward_order_not_by_the_order_spans_were_planned():
    """A memory plan lists a group's spans largest first; what backward needs first is what
    forward saved last, whatever the list's order."""
    from types import SimpleNamespace

    from actoffload.fast.offloader import _first_needed

    spans = [SimpleNamespace(nbytes=n, packed_offset=None, name=name)
             for n, name in ((600, "big, saved first"), (400, "saved last"), (200, "saved second"))]
    saved_at = [0, 9, 4]
    first, rest = _first_needed(spans, saved_at, 0.5)  # whole spans until 600 of 1200 bytes
    assert [m.name for m in first] == ["saved last", "saved second"] and [m.name for m in rest] == ["big, saved first"]
    packed = SimpleNamespace(nbytes=10, packed_offset=0, name="packed, saved first")
    first, _ = _first_needed(spans + [packed], saved_at + [-1], 0.5)
    assert "packed, saved first" in [m.name for m in first]  # one copy brings every packed span
