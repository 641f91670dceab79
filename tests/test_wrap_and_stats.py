"""wrap(), its handle, and the shape of stats()."""

import pytest
import torch

import actoffload as ao
from helpers import IMPLS, mlp_stack, off_for


@pytest.mark.parametrize("impl", IMPLS)
def test_wrap_makes_one_group_per_module_and_remove_undoes_it(impl):
    model = mlp_stack(3, 16, "cpu")
    off = off_for(impl, "cpu")
    attrs = [set(vars(m)) for m in model]
    handle = ao.wrap(model, off)
    assert all(isinstance(m, torch.nn.Sequential) for m in model)  # still what they were
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert sorted(off.stats()["groups"]) == ["0", "1", "2"]
    handle.remove()
    off2 = off_for(impl, "cpu")
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert off2.stats()["groups"] == {}
    assert all(type(m) is torch.nn.Sequential for m in model)  # every module has its own class back
    assert [set(vars(m)) for m in model] == attrs  # and nothing left over


@pytest.mark.parametrize("impl", IMPLS)
def test_wrap_with_names_and_single_module(impl):
    model = mlp_stack(2, 16, "cpu")
    off = off_for(impl, "cpu")
    with ao.wrap(model, off, names=["first", "second"]), ao.wrap(torch.nn.Identity(), off):
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert sorted(off.stats()["groups"]) == ["first", "second"]


@pytest.mark.parametrize("impl", IMPLS)
def test_stats_have_the_documented_keys_and_add_up(impl):
    model = mlp_stack(3, 16, "cpu")
    off = off_for(impl, "cpu", keep_last=1)
    with ao.wrap(model, off):
        y = model(torch.randn(4, 16, requires_grad=True)).sum()
    s = off.stats()
    assert {"groups", "offloaded_bytes", "host_bytes_in_use", "host_bytes_pooled"} <= set(s)
    for g in s["groups"].values():
        assert set(g) == {"saved", "offloaded", "offloaded_bytes", "kept"}
        assert g["saved"] == g["offloaded"] + sum(g["kept"].values())
        assert set(g["kept"]) <= {"parameter", "small", "vetoed", "not_marked", "device", "keep_last", "alias"}
    assert s["offloaded_bytes"] == sum(g["offloaded_bytes"] for g in s["groups"].values())
    assert s["groups"]["2"]["offloaded"] == 0 and s["groups"]["2"]["kept"]["keep_last"] > 0
    y.backward()
    assert off.stats()["groups"] == s["groups"]  # readable after backward


def test_offloader_repr_names_its_settings():
    off = ao.Offloader(impl="ref", device="cpu", keep_last=2)
    assert "keep_last=2" in repr(off) and "RefOffloader" in repr(off)


class _Heard(ao.Observer):
    def __init__(self):
        self.events = []

    def on_save(self, group, tensor):
        self.events.append(("save", group))

    def on_commit(self, group, summary):
        self.events.append(("commit", group, summary["offloaded"]))


def _two_groups(off):
    """A step of two groups, each saving one tensor of its own."""
    x = torch.randn(100, requires_grad=True)
    with off.group("g0"):
        y = (x * 2).exp()
    with off.group("g1"):
        z = (y * 3).sin()
    z.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_an_observer_removed_as_it_hears_leaves_the_others_hearing(impl):
    """One observer stops listening on its first event: the next one still hears that event,
    and every later one; the removed one hears nothing more."""
    off = off_for(impl, "cpu", keep_last=0)

    class OneShot(_Heard):
        handle = None

        def on_save(self, group, tensor):
            super().on_save(group, tensor)
            self.handle.remove()

    first, second = OneShot(), _Heard()
    first.handle = off.add_observer(first)
    off.add_observer(second)
    _two_groups(off)
    assert first.events == [("save", "g0")]
    assert second.events == [("save", "g0"), ("commit", "g0", 1), ("save", "g1"), ("commit", "g1", 1)]


@pytest.mark.parametrize("impl", IMPLS)
def test_observers_hear_of_every_group_decided_also_those_kept_for_keep_last(impl):
    """``on_commit`` for each group ``stats()`` lists: the last group of a forward, which backward
    reaches before any commit (``keep_last=1``), is heard of too, with what ``stats()`` says of it."""
    off = off_for(impl, "cpu", keep_last=1)
    heard = _Heard()
    off.add_observer(heard)
    _two_groups(off)
    assert [e for e in heard.events if e[0] == "commit"] == [("commit", "g0", 1), ("commit", "g1", 0)]
    assert off.stats()["groups"]["g1"]["kept"] == {"keep_last": 1}

