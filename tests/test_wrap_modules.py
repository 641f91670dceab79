"""Wrapped modules behave as modules: copies, pickles, shared layers, ModuleDict, FSDP2-style
class swaps, and ``remove()`` undoing everything in reverse order; bad ``names``/``parts``
are refused clearly. Every computation is compared bit for bit with the same one without an
offloader."""

import copy
import io
import pickle
import types

import pytest
import torch

import actoffload as ao
import actoffload.wrapping as wrapping
from helpers import IMPLS, assert_bitwise

D = 16


def _off(impl):
    return ao.Offloader(impl=impl, device="cpu", min_offload_bytes=0, keep_last=0)


def _blocks(n=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(),
                                                     torch.nn.Linear(2 * D, D)) for _ in range(n)])


def _run(model, step=0):
    """Output and gradients (input first, then the model's parameters) of one step; grads reset."""
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
    y = model(x)
    y.square().sum().backward()
    out = [y.detach(), x.grad] + [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def _plain_twin(model):
    """An unwrapped model of the same structure holding a copy of ``model``'s weights."""
    twin = _blocks(len(model))
    twin.load_state_dict(model.state_dict())
    return twin


def _is_plain(model):
    """Every module of ``model`` of its original class, without the wrap's bookkeeping."""
    return all(type(m).__module__.startswith("torch.nn") and wrapping._WRAP not in vars(m)
               for m in model.modules())


def _snapshot(model):
    return [(m, type(m), dict(vars(m))) for m in model.modules()]


def _assert_as_before(snapshot):
    for m, cls, attrs in snapshot:
        assert type(m) is cls
        assert vars(m).keys() == attrs.keys()
        assert all(vars(m)[k] is v for k, v in attrs.items())


# ---------------------------------------------------------------- copies and pickles
@pytest.mark.parametrize("impl", IMPLS)
def test_deepcopy_of_a_module_parametrized_after_wrapping_is_plain(impl):
    # torch's parametrizations swap the class after wrapping, and gave the class they add a
    # __deepcopy__ copying the instance's dict, the wrap's offloader and its locks included
    from torch.nn.utils.parametrizations import weight_norm

    def linears():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(3)])

    model, twin = linears(), linears()
    off = _off(impl)
    ao.wrap(model, off)  # each Linear wrapped, then parametrized
    for m in (model, twin):
        for lin in m:
            weight_norm(lin)
    ema = copy.deepcopy(model)
    assert all(wrapping._WRAP not in vars(m) for m in ema.modules())
    assert_bitwise(_run(ema), _run(twin))
    assert off.stats()["groups"] == {}  # the copy opened no group
    assert_bitwise(_run(model), _run(twin))  # the original, still wrapped


def _weight_normed_pair():
    from torch.nn.utils.parametrizations import weight_norm
    torch.manual_seed(0)
    lin, twin = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
    twin.load_state_dict(lin.state_dict())
    return weight_norm(lin), weight_norm(twin)


@pytest.mark.parametrize("impl", IMPLS)
def test_parametrizations_removed_from_a_wrapped_module(impl):
    from torch.nn.utils import parametrize
    lin, twin = _weight_normed_pair()
    off = _off(impl)
    handle = ao.wrap(lin, off)
    parametrize.remove_parametrizations(twin, "weight")
    parametrize.remove_parametrizations(lin, "weight")  # (raised AttributeError from torch)
    assert isinstance(lin, torch.nn.Linear) and not parametrize.is_parametrized(lin)
    assert_bitwise(_run(lin), _run(twin))
    assert off.stats()["groups"]  # still wrapped
    handle.remove()
    assert type(lin) is torch.nn.Linear and _is_plain(lin)
    assert_bitwise(_run(lin), _run(twin))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_parametrization_added_to_a_wrapped_parametrized_module_survives_remove(impl):
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, b):
            return 2 * b

    lin, twin = _weight_normed_pair()
    handle = ao.wrap(lin, _off(impl))
    for m in (lin, twin):
        parametrize.register_parametrization(m, "bias", Double())
    assert_bitwise(_run(lin), _run(twin))  # while wrapped
    handle.remove()  # (took the new property away with the wrapper's class)
    assert wrapping._WRAP not in vars(lin) and not any(wrapping._BASE in vars(k) for k in type(lin).__mro__)
    assert parametrize.is_parametrized(lin, "bias")
    assert_bitwise(_run(lin), _run(twin))
    assert_bitwise(_run(copy.deepcopy(lin)), _run(twin))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_parametrized_module_wrapped_then_unwrapped_is_given_its_class_back_and_copies_plainly(impl):
    lin, twin = _weight_normed_pair()
    parametrized = type(lin)
    handle = ao.wrap(lin, _off(impl))
    ema = copy.deepcopy(lin)
    assert _is_plain(ema) and isinstance(ema, torch.nn.Linear)
    assert_bitwise(_run(ema), _run(twin))
    assert_bitwise(_run(lin), _run(twin))
    handle.remove()
    assert type(lin) is parametrized


@pytest.mark.parametrize("impl", IMPLS)
def test_deepcopy_of_a_wrapped_model_is_plain_and_computes_with_its_own_weights(impl):
    model = _blocks()
    off = _off(impl)
    handle = ao.wrap(model, off)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    assert _is_plain(ema)
    expected = _run(_plain_twin(ema))
    assert_bitwise(_run(ema), expected)  # its own weights, not the original's
    assert all(p.grad is None for p in model.parameters())  # nothing reached the original
    assert off.stats()["groups"] == {}  # the copy opened no group
    # the original stays wrapped and works
    assert isinstance(model[0], torch.nn.Sequential) and type(model[0]) is not torch.nn.Sequential
    assert_bitwise(_run(model), _run(_plain_twin(model)))
    assert sorted(off.stats()["groups"]) == ["0", "1", "2"]
    handle.remove()
    assert _is_plain(model) and _is_plain(ema)
    assert_bitwise(_run(ema), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_pickle_and_torch_save_of_a_wrapped_model_give_a_plain_model(impl):
    model = _blocks()
    off = _off(impl)
    with ao.wrap(model, off):
        expected = _run(_plain_twin(model))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copies = [torch.load(buf, weights_only=False)]
        copies += [pickle.loads(pickle.dumps(model, protocol)) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)]
        for c in copies:
            assert _is_plain(c)
            assert_bitwise(_run(c), expected)
        assert off.stats()["groups"] == {}
        shallow = copy.copy(model[0])  # a shallow copy: of the plain class, sharing the submodules
        assert type(shallow) is torch.nn.Sequential and wrapping._WRAP not in vars(shallow)
        assert shallow[0] is model[0][0]
        assert_bitwise(_run(model), expected)  # the original still wrapped, and working
        assert sorted(off.stats()["groups"]) == ["0", "1", "2"]


class _OwnForward(torch.nn.Linear):
    def doubled(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_forward_of_the_instance_is_what_the_group_runs_and_what_copies_and_remove_give_back(impl):
    torch.manual_seed(0)
    layer = _OwnForward(D, D)
    layer.forward = types.MethodType(_OwnForward.doubled, layer)  # an instance forward, before wrapping
    snapshot = _snapshot(layer)
    plain = copy.deepcopy(layer)
    off = _off(impl)
    handle = ao.wrap(layer, off)
    assert "forward" not in vars(layer)
    copied = copy.deepcopy(layer)
    assert type(copied) is _OwnForward and copied.forward.__self__ is copied  # its own forward, bound to it
    with torch.no_grad():
        copied.weight.mul_(0.5)
        plain_half = copy.deepcopy(plain)
        plain_half.weight.mul_(0.5)
    x = torch.randn(4, D)
    assert torch.equal(layer(x), plain(x)) and torch.equal(copied(x), plain_half(x))
    assert list(off.stats()["groups"]) == ["0"]
    handle.remove()
    _assert_as_before(snapshot)


# ---------------------------------------------------------------- remove()
@pytest.mark.parametrize("impl", IMPLS)
def test_remove_restores_every_module_exactly(impl):
    model = _blocks()
    snapshot = _snapshot(model)
    off = _off(impl)
    handle = ao.wrap(model, off, parts=lambda b: [b[0], b[2]])
    assert all(isinstance(m, cls) for m, cls, _ in snapshot)  # still instances of their classes
    assert type(model[0]).__name__ == "OffloadSequential"
    _run(model)
    handle.remove()
    _assert_as_before(snapshot)
    handle.remove()  # a second remove does nothing
    _assert_as_before(snapshot)
    with ao.wrap(model, off):
        assert not _is_plain(model)
    _assert_as_before(snapshot)


def test_remove_undoes_in_reverse_order_of_wrapping(monkeypatch):
    log = []
    wrap_one = wrapping._wrap_one

    def logged(module, off, name, parts=0):
        log.append(("wrap", name))
        restore = wrap_one(module, off, name, parts)

        def undo():
            log.append(("remove", name))
            restore()
        return undo

    monkeypatch.setattr(wrapping, "_wrap_one", logged)
    model = _blocks(2)
    ao.wrap(model, _off("ref"), parts=lambda b: [b[0], b[2]]).remove()
    wrapped = [name for what, name in log if what == "wrap"]
    assert wrapped == ["0.0", "0.1", "0", "1.0", "1.1", "1"]
    assert [name for what, name in log if what == "remove"] == wrapped[::-1]
    assert _is_plain(model)


# ---------------------------------------------------------------- shared modules, ModuleDict
@pytest.mark.parametrize("impl", IMPLS)
def test_a_module_shared_across_depth_is_wrapped_once_and_each_call_is_a_group(impl):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh())
    model = torch.nn.Sequential(*[layer] * 4)
    expected = _run(model)
    snapshot = _snapshot(model)
    off = _off(impl)
    with ao.wrap(torch.nn.ModuleList([layer] * 4), off, names=["a", "b", "c", "d"]):
        assert_bitwise(_run(model), expected)
        groups = off.stats()["groups"]
        assert list(groups) == ["a", "a#2", "a#3", "a#4"]  # the first position's name, each call a group
        assert all(g["offloaded"] > 0 for g in groups.values())
    _assert_as_before(snapshot)  # wrapped once, so removed once: nothing left over
    with ao.wrap(torch.nn.ModuleList([layer] * 2), off, parts=lambda b: [b[0]]):
        assert_bitwise(_run(model), expected)
        assert list(off.stats()["groups"]) == ["0.0", "0.0#2", "0.0#3", "0.0#4"]
    _assert_as_before(snapshot)


@pytest.mark.parametrize("impl", IMPLS)
def test_module_dict_values_are_wrapped_and_named_by_their_keys(impl):
    model = _blocks(2)
    expected = _run(model)
    blocks = torch.nn.ModuleDict({"enc": model[0], "dec": model[1]})
    off = _off(impl)
    with ao.wrap(blocks, off):
        assert_bitwise(_run(model), expected)
        assert list(off.stats()["groups"]) == ["enc", "dec"]
    with ao.wrap(blocks, off, names=["first", "second"]):
        assert_bitwise(_run(model), expected)
        assert list(off.stats()["groups"]) == ["first", "second"]
    assert _is_plain(model)


# ---------------------------------------------------------------- bad names and parts
def test_names_must_be_strings():
    model = _blocks(2)
    off = _off("ref")
    with pytest.raises(TypeError, match=r"names\[0\] is 0 \(int\)"):
        ao.wrap(model, off, names=[0, 1])
    with pytest.raises(TypeError, match=r"names\[1\] is None"):
        ao.wrap(model, off, names=["a", None])
    with pytest.raises(TypeError, match="sequence of str"):
        ao.wrap(model, off, names="ab")
    assert _is_plain(model)


@pytest.mark.parametrize("given", [None, 3, torch.zeros(2)])
def test_parts_must_return_a_sequence_of_submodules(given):
    model = _blocks(2)
    with pytest.raises(TypeError, match=r"parts\(Sequential\) must return a sequence of submodules"):
        ao.wrap(model, _off("ref"), parts=lambda b: given)
    assert _is_plain(model)


# ---------------------------------------------------------------- class swaps after wrapping
class _Sharded:
    """A mixin put in front of a module's class after wrapping, as FSDP2's fully_shard does."""


def _swap_class(module):
    cls = type(module)
    module.__class__ = type(f"Sharded{cls.__name__}", (_Sharded, cls), {})


@pytest.mark.parametrize("impl", IMPLS)
def test_a_class_swap_after_wrapping_keeps_the_group_and_remove_keeps_the_swap(impl):
    model = _blocks()
    expected = _run(model)
    off = _off(impl)
    handle = ao.wrap(model, off)
    for b in model:
        _swap_class(b)
    assert_bitwise(_run(model), expected)
    assert sorted(off.stats()["groups"]) == ["0", "1", "2"]
    handle.remove()
    for b in model:
        assert isinstance(b, _Sharded) and isinstance(b, torch.nn.Sequential)
        assert not any(wrapping._BASE in vars(k) for k in type(b).__mro__) and wrapping._WRAP not in vars(b)
    assert_bitwise(_run(model), expected)


@pytest.fixture
def one_rank():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not initialised yet")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrap_first", [True, False])
def test_fully_shard_before_or_after_wrapping_on_one_cpu_rank(one_rank, wrap_first):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = _blocks()
    expected = _run(_plain_twin(model))
    off = _off("fast")
    handle = ao.wrap(model, off) if wrap_first else None
    for b in model:
        fully_shard(b, mesh=one_rank)
    handle = handle or ao.wrap(model, off)
    assert all(isinstance(b, FSDPModule) and isinstance(b, torch.nn.Sequential) for b in model)
    got = _run(model)
    assert_bitwise([t.full_tensor() if hasattr(t, "full_tensor") else t for t in got], expected)
    assert sorted(off.stats()["groups"]) == ["0", "1", "2"]
    handle.remove()
    assert all(isinstance(b, FSDPModule) and wrapping._WRAP not in vars(b) for b in model)
    assert not any(wrapping._BASE in vars(k) for b in model for k in type(b).__mro__)
    got = _run(model)
    assert_bitwise([t.full_tensor() if hasattr(t, "full_tensor") else t for t in got], expected)


def test_fully_shard_inside_a_recomputed_block_on_one_cpu_rank(one_rank):
    """FSDP2 on the layers inside each wrapped block, with a budget whose profiling steps
    recompute the blocks: the recomputation leaves those layers' parameters to FSDP2, which
    gathers them again for it, as under torch's own checkpoint (restored to the forward's, they
    were mixed with the sharded ones: "got mixed torch.Tensor and DTensor")."""
    from torch.distributed.fsdp import fully_shard

    model = _blocks()
    expected = [_run(_plain_twin(model), step) for step in range(3)]
    for b in model:
        fully_shard(b[0], mesh=one_rank)
        fully_shard(b[2], mesh=one_rank)
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, memory_budget="1GiB")
    with ao.wrap(model, off):
        for step in range(3):
            got = _run(model, step)
            assert_bitwise([t.full_tensor() if hasattr(t, "full_tensor") else t for t in got], expected[step])
        assert off.stats()["plan"]["settled"]



def test_wrap_of_no_modules_is_refused():
    """An empty ModuleList wrapped would train with nothing offloaded and nothing said (R10)."""
    off = ao.Offloader(impl="ref", device="cpu")
    for empty in ([], torch.nn.ModuleList()):
        with pytest.raises(ValueError, match="no modules"):
            ao.wrap(empty, off)


def test_wrapping_a_parametrized_module_again_and_again_leaves_no_class_behind():
    # (the integrations wrap anew at every step; the class made again over ours is one a wrap)
    import gc
    lin, _ = _weight_normed_pair()
    off = _off("ref")
    gc.collect()
    before = len(wrapping._PLAIN)
    for _ in range(20):
        handle = ao.wrap(lin, off)
        copy.deepcopy(lin)
        _run(lin)
        handle.remove()
    gc.collect()
    assert len(wrapping._PLAIN) <= before


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("own_forward", [False, True])
def test_remove_from_a_forward_pre_hook_runs_that_call_unwrapped(impl, own_forward):
    """Torch binds ``forward`` before it runs the pre-hooks: a hook that removes the wrap leaves
    the wrapper's forward to run on an unwrapped module (it raised AttributeError). It runs the
    module's own forward, the instance's where it has one, and the step is plain PyTorch's."""
    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        if own_forward:
            inner = m[0].forward
            m[0].forward = lambda x: inner(x) * 2
        return m

    x = torch.randn(4, 16)
    plain = model()
    plain(x).square().sum().backward()
    m = model()
    handle = ao.wrap([m[0], m[2]], ao.Offloader(impl=impl, device="cpu", min_offload_bytes=0))
    hook = m[2].register_forward_pre_hook(lambda mod, args: handle.remove())
    m(x).square().sum().backward()
    hook.remove()
    assert_bitwise([p.grad for p in m.parameters()], [p.grad for p in plain.parameters()])
    assert type(m[0]) is torch.nn.Linear and type(m[2]) is torch.nn.Linear
