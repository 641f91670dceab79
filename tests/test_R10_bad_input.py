"""R10: misuse gets a clear error naming the problem; faults never corrupt or drop data."""

import gc
import re

import pytest
import torch

import actoffload as ao
from actoffload import HostMemoryError
from helpers import CUDA, DEVICES, IMPLS, assert_bitwise, grads_of, mlp_stack, off_for, reference_grads


def test_R10_unknown_impl_argument_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown impl 'turbo'; valid implementations are: ref, fast"):
        ao.Offloader(impl="turbo", device="cpu")


def test_R10_unknown_impl_in_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("OFFLOAD_IMPL", "nope")
    with pytest.raises(ValueError, match=r"unknown OFFLOAD_IMPL 'nope'; valid implementations are: ref, fast"):
        ao.Offloader(device="cpu")


def test_R10_environment_selects_the_implementation(monkeypatch):
    monkeypatch.setenv("OFFLOAD_IMPL", "ref")
    assert ao.Offloader(device="cpu").impl == "ref"
    monkeypatch.delenv("OFFLOAD_IMPL")
    assert ao.resolve_impl() == ("fast" if CUDA else "ref")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "some"}, "unknown policy 'some'; valid policies are: all, marked"),
        ({"keep_last": -1}, "keep_last must be an int >= 0, got -1"),
        ({"keep_last": True}, "keep_last must be an int >= 0, got True"),
        ({"min_offload_bytes": "1M"}, "min_offload_bytes must be an int >= 0, got '1M'"),
        ({"device": "gpu0"}, "device 'gpu0' is not a torch device"),
        ({"device": "meta"}, "device meta is not supported"),
        ({"host_budget": "12 parsecs"}, "host_budget '12 parsecs' is not a size"),
        ({"host_budget": 0}, "host_budget must be positive, got 0"),
    ],
)
def test_R10_bad_arguments_name_the_problem(impl, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ao.Offloader(impl=impl, **{"device": "cpu", **kwargs})


@pytest.mark.parametrize("impl", IMPLS)
def test_R10_counts_take_any_integer_type(impl):
    """A count read from a config through NumPy (``numpy.int64``) is a count; a bool, a float or a
    tensor is not."""
    np = pytest.importorskip("numpy")
    off = ao.Offloader(impl=impl, device="cpu", keep_last=np.int64(2), min_offload_bytes=np.int32(0))
    assert off.keep_last == 2 and off.min_offload_bytes == 0 and type(off.keep_last) is int
    for bad in (np.bool_(True), 2.0, torch.tensor(2)):
        with pytest.raises(ValueError, match="keep_last must be an int >= 0"):
            ao.Offloader(impl=impl, device="cpu", keep_last=bad)


@pytest.mark.parametrize("bad", ["1", 1.5, -1, [1, 1]])
def test_R10_a_bad_count_beside_a_memory_budget_says_what_a_count_is(bad):
    """keep_last is checked as a count before a memory budget's rule that it keep its default:
    "1" is no count (and not the default 1)."""
    with pytest.raises(ValueError, match=re.escape(f"keep_last must be an int >= 0, got {bad!r}")):
        ao.Offloader(impl="fast", device="cpu", memory_budget="1GiB", keep_last=bad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prefetch": 1.5}, "prefetch must be an int >= 0, got 1.5"),
        ({"max_inflight": -1}, "max_inflight must be an int >= 0, got -1"),
        ({"pack_below": None}, "pack_below must be an int >= 0, got None"),
        ({"packer": "cuda"}, "unknown packer 'cuda'; valid packers are: auto, triton, torch"),
    ],
)
def test_R10_bad_fast_settings_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ao.Offloader(impl="fast", device="cpu", **kwargs)


def test_R10_a_setting_of_the_other_implementation_says_whose_it_is():
    with pytest.raises(TypeError, match="max_inflight is a setting of the 'fast' implementation; impl 'ref'"):
        ao.Offloader(impl="ref", device="cpu", max_inflight=2)
    with pytest.raises(TypeError, match="unknown setting 'prefetch_depth'; valid ones for impl 'fast' are: .*prefetch"):
        ao.Offloader(impl="fast", device="cpu", prefetch_depth=2)


@pytest.mark.parametrize("size, expected", [(4096, 4096), ("4096", 4096), ("1.5 KiB", 1536), ("2GB", 2 * 10**9),
                                            ("1e-3GiB", 1073741), ("2e+3", 2000)])
def test_R10_host_budget_takes_bytes_or_a_size(size, expected):
    assert ao.Offloader(impl="ref", device="cpu", host_budget=size).settings["host_budget"] == expected


@pytest.mark.parametrize("ranks", [None, "4"])
def test_R10_host_budget_takes_a_share_of_the_hosts_memory_divided_among_its_ranks(monkeypatch, ranks):
    """``"50%"`` of this machine's RAM, ``"auto"`` (and ``None``) the default 80%, each divided
    among the ranks of this host, as the default is; a share out of range says what to write."""
    from actoffload.hostmem import HOST_BUDGET_FRACTION, machine_ram

    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    n = int(ranks or 1)

    def budget(spec):
        return ao.Offloader(impl="ref", device="cpu", host_budget=spec).host_budget

    assert budget("50%") == int(machine_ram() * 0.5) // n
    assert budget(" 12.5 % ") == int(machine_ram() * 0.125) // n
    assert budget("auto") == budget(None) == int(machine_ram() * HOST_BUDGET_FRACTION) // n
    for bad in ("0%", "101%", "half%"):
        with pytest.raises(ValueError, match=f"host_budget '{bad}' is not a share of this host's memory: write a "
                                             "percentage above 0 and at most 100"):
            budget(bad)
    with pytest.raises(ValueError, match="or a share of this host's memory: 'auto' or a percentage"):
        budget("lots")
    with pytest.raises(ValueError, match=r"host_budget='1e-9%' leaves \d+ bytes of this machine's .* give a larger share"):
        budget("1e-9%")  # a share that rounds to nothing: said as the offloader is made, not at the first step


@pytest.mark.parametrize("ranks", ["abc", "2.0", "0", "-1"])
def test_R10_a_local_world_size_that_is_no_count_of_ranks_says_so(monkeypatch, ranks):
    """The default host budget is a share of RAM divided among the host's ranks: a
    ``LOCAL_WORLD_SIZE`` that counts none is named, where it divided by one or raised int()'s error."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{ranks}' is not a count of ranks .* set it right or unset it"):
        ao.Offloader(impl="ref", device="cpu")
    assert ao.Offloader(impl="ref", device="cpu", host_budget="1GiB").host_budget == 1 << 30  # a size divides nothing


@pytest.mark.parametrize("size, message", [
    ("1e400", "host_budget '1e400' is too large: a size is at most 2\\*\\*63 bytes"),
    ("9" * 400, "host_budget '9999.*\\.\\.\\. is too large"),
    ("1" * 5000 + " GiB", "is too large"),
    (1e300, "host_budget 1e\\+300 is too large"),
    ((1 << 63) + 1, "is too large"),
    (float("inf"), "host_budget must be a whole number of bytes"),
    (2.5, "host_budget must be a whole number of bytes"),
    (True, "host_budget must be a number of bytes"),
    (torch.tensor(True), "host_budget must be a number of bytes"),
    (torch.tensor([1, 2]), "host_budget must be a number of bytes"),
    ("1e-3", "host_budget must be a whole number of bytes"),
    ("1.5", "host_budget must be a whole number of bytes"),  # was cut to 1 byte
    ("1000.9 B", "host_budget must be a whole number of bytes"),
    ("0.5", "host_budget must be a whole number of bytes"),  # not "must be positive"
    ("1e-3 parsecs", "host_budget '1e-3 parsecs' is not a size"),
])
def test_R10_a_size_too_large_or_not_whole_is_a_value_error(size, message):
    with pytest.raises(ValueError, match=message):
        ao.Offloader(impl="ref", device="cpu", host_budget=size)


def test_R10_integer_like_sizes_are_sizes():
    np = pytest.importorskip("numpy")
    assert ao.Offloader(impl="ref", device="cpu", host_budget=np.int64(1 << 30)).settings["host_budget"] == 1 << 30
    assert ao.Offloader(impl="ref", device="cpu", host_budget=torch.tensor(4096)).settings["host_budget"] == 4096
    assert ao.Offloader(impl="ref", device="cpu", host_budget=np.float64(2048.0)).settings["host_budget"] == 2048
    assert ao.Offloader(impl="fast", device="cpu", memory_budget=np.int32(1 << 20)).memory_budget == 1 << 20
    assert ao.Offloader(impl="ref", device="cpu", host_budget=np.float32(1e9)).settings["host_budget"] == 10**9
    assert ao.Offloader(impl="ref", device="cpu", host_budget=torch.tensor(1e9)).settings["host_budget"] == 10**9
    with pytest.raises(ValueError, match="host_budget must be a number of bytes"):
        ao.Offloader(impl="ref", device="cpu", host_budget=np.bool_(True))
    with pytest.raises(ValueError, match=r"host_budget must be a whole number of bytes .*, got tensor\(2.5000\)"):
        ao.Offloader(impl="ref", device="cpu", host_budget=torch.tensor(2.5))
    for negative in ("-1", "-2GiB", " -0 "):  # a size, not a positive one
        with pytest.raises(ValueError, match=f"host_budget must be positive, got '{negative}'"):
            ao.Offloader(impl="ref", device="cpu", host_budget=negative)


def test_R10_implementation_class_refuses_another_impl_name():
    from actoffload.fast import FastOffloader

    with pytest.raises(ValueError, match="FastOffloader is the 'fast' implementation, not 'ref'"):
        FastOffloader(impl="ref", device="cpu")


@pytest.mark.skipif(CUDA, reason="checks the message when CUDA is missing")
def test_R10_cuda_device_without_cuda_says_so():
    with pytest.raises(ValueError, match="CUDA is not available here; use device='cpu'"):
        ao.Offloader(impl="ref", device="cuda")


def test_R10_group_name_must_be_a_string():
    with pytest.raises(TypeError, match="group name must be a str, got int"):
        ao.Offloader(impl="ref", device="cpu").group(3)


def test_R10_wrap_rejects_what_is_not_a_module_or_offloader():
    off = ao.Offloader(impl="ref", device="cpu")
    with pytest.raises(TypeError, match="wrap takes nn.Modules, got function"):
        ao.wrap([lambda x: x], off)
    with pytest.raises(TypeError, match="wrap needs an offloader"):
        ao.wrap(torch.nn.Linear(2, 2), object())
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    for given in (scripted, [scripted], torch.nn.ModuleList([scripted])):
        with pytest.raises(TypeError, match="wrap cannot hook Linear: it is a TorchScript module"):
            ao.wrap(given, off)
    with pytest.raises(ValueError, match="wrap got 2 modules but 1 names"):
        ao.wrap([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], off, names=["a"])
    for what, name in ((5, "int"), (None, "NoneType"), ("blocks", "str"), ({"a": torch.nn.Linear(2, 2)}, "dict")):
        with pytest.raises(TypeError, match=f"wrap takes an nn.Module or a sequence of them .*, got {name}$"):
            ao.wrap(what, off)
    with pytest.raises(TypeError, match="wrap's parts must be a function giving a module's parts .*, got int"):
        ao.wrap(torch.nn.Linear(2, 2), off, parts=5)
    block = torch.nn.Module()
    block.attn, block.mlp = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ao.wrap(block.mlp, off)
    with pytest.raises(ValueError, match="Module holds 'mlp', which is already wrapped: groups do not nest"):
        ao.wrap(block, off)  # (found at its forward before, as group '0' inside group '0')
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    whole = ao.wrap([model], off)
    with pytest.raises(ValueError, match="Linear is inside Sequential, which is already wrapped: groups do not nest"):
        ao.wrap(model, off)  # its blocks, wrapped inside the whole (found at its forward before)
    whole.remove()
    ao.wrap(model, off).remove()  # once the outer one's handle is removed
    with pytest.raises(ValueError, match="wrap got Sequential and its '0': groups do not nest"):
        ao.wrap([model, model[0]], off)  # one inside the other, in one call
    block = torch.nn.Module()
    block.attn, block.mlp = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    block.norm = torch.nn.LayerNorm(2)  # not a part: it runs inside the block, which may run whole
    with_parts = ao.wrap([block], off, parts=lambda b: [b.attn, b.mlp])
    with pytest.raises(ValueError, match="LayerNorm is inside Module, which is already wrapped"):
        ao.wrap(block.norm, off)
    with_parts.remove()
    norm = ao.wrap(block.norm, off)
    with pytest.raises(ValueError, match="Module holds 'norm', which is already wrapped"):
        ao.wrap([block], off, parts=lambda b: [b.attn, b.mlp])
    norm.remove()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R10_host_memory_exhaustion_raises_and_keeps_data(impl, device):
    model = mlp_stack(2, 32, device)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    expected = reference_grads(model, x)

    failing = [True]

    def allocator(nbytes, pinned):  # injected: fails while failing[0] is set
        if failing[0]:
            raise RuntimeError("pinned memory exhausted (simulated)")
        return torch.empty(nbytes, dtype=torch.uint8)

    off = off_for(impl, device, keep_last=0, host_allocator=allocator)
    with pytest.raises(MemoryError, match="could not allocate .* host memory") as info:
        with off.group("0"):
            h = model[0](x)
    assert isinstance(info.value, HostMemoryError)
    failing[0] = False
    assert off.stats()["groups"]["0"]["offloaded"] == 0  # stayed resident
    with off.group("1"):
        y = model[1](h)
    y.sum().backward()
    assert_bitwise(grads_of(model, x), expected)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")
@pytest.mark.parametrize("impl", IMPLS)
def test_R10_cuda_graph_capture_raises(impl):
    off = off_for(impl, "cuda")
    lin = torch.nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        lin(x).sum().backward()  # warm up
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(graph, stream=s):
            with off.group("g"):
                lin(x)


@pytest.mark.parametrize("impl", IMPLS)
def test_R10_host_budget_exceeded_raises_and_keeps_data(impl):
    model = mlp_stack(2, 64, "cpu")
    x = torch.randn(16, 64, requires_grad=True)
    expected = reference_grads(model, x)
    off = off_for(impl, "cpu", keep_last=0, host_budget=1024)  # less than one activation
    with pytest.raises(HostMemoryError, match="would exceed the host budget of 1,024 bytes"):
        with off.group("0"):
            h = model[0](x)
    with pytest.raises(HostMemoryError):
        with off.group("1"):
            y = model[1](h)
    assert off.stats()["offloaded_bytes"] == 0 and off.stats()["host_bytes_in_use"] == 0
    y.sum().backward()
    assert_bitwise(grads_of(model, x), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_R10_a_failed_commit_holds_no_host_memory_while_its_error_is_kept(impl):
    """The second of a group's two buffers does not fit the host budget: the first, already had,
    is given back at once, though the caller keeps the error (its traceback holds the frames
    that allocated): a later commit that fits the budget moves."""
    off = off_for(impl, "cpu", keep_last=0, host_budget=6000, **({"pack_below": 0} if impl == "fast" else {}))
    a = torch.randn(1000, requires_grad=True)
    errors = []
    try:
        with off.group("g"):  # two saves of 4,000 bytes
            y, z = (a * 2).exp(), (a * 3).sin()
    except HostMemoryError as e:
        errors.append(e)
    assert errors and off.stats()["host_bytes_in_use"] == 0
    with off.group("h"):
        w = (a * 4).exp()
    assert off.stats()["groups"]["h"]["offloaded_bytes"] == 4000
    (y.sum() + z.sum() + w.sum()).backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("error", [OSError(12, "Cannot allocate memory"), MemoryError()], ids=["OSError", "MemoryError"])
def test_R10_an_allocator_failing_with_an_os_error_is_host_memory_short(impl, error):
    """A host allocator that fails as ``mmap`` does (``OSError``; the offloader's own allocator
    maps large blocks) on a group's second buffer: ``HostMemoryError``, nothing reported moved,
    the first buffer given back, and gradients as without an offloader."""
    calls = []

    def allocator(nbytes, pinned):
        calls.append(nbytes)
        if len(calls) == 2:
            raise error
        return torch.empty(nbytes, dtype=torch.uint8)

    off = off_for(impl, "cpu", keep_last=0, host_allocator=allocator, **({"pack_below": 0} if impl == "fast" else {}))
    a = torch.randn(1000, requires_grad=True)
    with pytest.raises(HostMemoryError, match="could not allocate"):
        with off.group("g"):
            y, z = (a * 2).exp(), (a * 3).sin()
    assert off.stats()["groups"]["g"] == {"saved": 2, "offloaded": 0, "offloaded_bytes": 0, "kept": {"keep_last": 2}}
    (y.sum() + z.sum()).backward()
    del y, z
    gc.collect()
    assert off.stats()["host_bytes_in_use"] == 0
    b = a.detach().requires_grad_()
    ((b * 2).exp().sum() + (b * 3).sin().sum()).backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wrong", [lambda n: torch.empty(n), lambda n: None, lambda n: bytearray(n)],
                         ids=["float32", "None", "bytearray"])
def test_R10_host_allocator_returning_the_wrong_thing_is_named(impl, wrong):
    off = off_for(impl, "cpu", keep_last=0, host_allocator=lambda n, pinned: wrong(n))
    with pytest.raises(TypeError, match="must return a 1-D uint8 CPU tensor of exactly"):
        with off.group("0"):
            (torch.randn(64, 64, requires_grad=True) * 2).exp()
    assert off.stats()["host_bytes_in_use"] == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")
@pytest.mark.parametrize("impl", IMPLS)
def test_R10_cuda_graph_capture_without_an_open_group_works(impl):
    """The other side of the refusal: an offloader in the process does not stop a capture."""
    off = off_for(impl, "cuda")
    lin = torch.nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda")
    with off.group("eager"):  # the offloader has been used
        (lin(x.requires_grad_()) * 1).sum().backward()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    static_in = torch.randn(4, 16, device="cuda")
    with torch.cuda.stream(s), torch.no_grad():
        lin(static_in)  # warm up
    with torch.cuda.graph(graph, stream=s), torch.no_grad():
        static_out = lin(static_in)
    static_in.copy_(x.detach())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, lin(x.detach()).detach())
