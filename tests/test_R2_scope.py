"""R2: only tensors saved while a group is open are candidates; groups do not nest."""

import pytest
import torch

import actoffload as ao

from helpers import DEVICES, IMPLS, off_for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_R2_outside_a_group_nothing_is_saved_or_moved(impl, device):
    off = off_for(impl, device, keep_last=0)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with off.group("inside"):
        y = x.exp()
    z = y.sin()  # saved outside any group: autograd keeps it as usual
    s = off.stats()
    assert s["groups"]["inside"]["saved"] == 1 and s["groups"]["inside"]["offloaded"] == 1
    assert list(s["groups"]) == ["inside"]
    z.sum().backward()
    assert torch.equal(x.grad, (x.exp() * x.exp().cos()).detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_R2_no_grad_and_inference_mode_do_nothing(impl, device, mode):
    off = off_for(impl, device, keep_last=0)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx, off.group("g"):
        x.exp().sin()
    s = off.stats()
    assert s["groups"] == {} and s["offloaded_bytes"] == 0 and s["host_bytes_in_use"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_R2_forwards_that_save_nothing_add_nothing(impl):
    # evaluation forwards under no_grad, and steps whose groups save nothing (so backward never
    # unpacks one of them), leave no entry behind: the stats window stays one step long
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    off = off_for(impl, "cpu")
    ao.wrap(model, off)
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()
    trained = off.stats()["groups"]
    with torch.no_grad():
        for _ in range(4):
            model(x)
    assert len(off._window) == 0  # (the evaluation began a step: it saved nothing)
    model(x).sum().backward()
    assert set(off.stats()["groups"]) == set(trained)
    for p in model.parameters():
        p.requires_grad_(False)
    for _ in range(4):  # frozen, input needing no grad: nothing saved, backward never seen
        h = model(torch.randn(2, 8))
    assert len(off._window) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_R2_nested_groups_raise_and_name_both(impl):
    off = off_for(impl, "cpu")
    with off.group("outer"):
        with pytest.raises(RuntimeError, match="inside group 'outer'.*do not nest"):
            with off.group("inner"):
                pass
    with off.group("after"):  # still usable
        pass


@pytest.mark.parametrize("impl", IMPLS)
def test_R2_nesting_across_offloaders_raises(impl):
    a, b = off_for(impl, "cpu"), off_for(impl, "cpu")
    with a.group("a"):
        with pytest.raises(RuntimeError, match="do not nest"):
            with b.group("b"):
                pass


@pytest.mark.parametrize("impl", IMPLS)
def test_R2_a_repeated_name_that_saved_nothing_leaves_no_gap_in_the_numbers(impl):
    off = off_for(impl, "cpu")
    h = torch.randn(4, requires_grad=True) * 1
    for saves in (True, False, True):
        with off.group("g"):
            h = h.sin() if saves else h * 2.0  # a product with a number saves nothing
    assert list(off.stats()["groups"]) == ["g", "g#2"]
    h.sum().backward()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap_then_backward"])
@pytest.mark.parametrize("offloader", ["ref", "fast", "budget"])
def test_R2_under_a_torch_func_transform_no_group_opens(transform, offloader):
    """torch.func's grad raised on the groups' saved-tensor hooks, jvp on a version guard's .data
    write, and a budget's recomputation of a module called under vmap, run in a backward outside
    it, met its batched tensors escaped. What a transformed function saves is autograd's."""
    from torch.func import functional_call, grad, jvp, vmap

    def run(off):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[_Block() for _ in range(3)])
        if off is not None:
            ao.wrap(m, off)
        out = []
        for step in range(3):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
            params = {k: v.detach() for k, v in m.named_parameters()}
            if transform == "grad":
                out += grad(lambda p: functional_call(m, p, (x,)).square().mean())(params).values()
            elif transform == "jvp":
                out += jvp(lambda p: functional_call(m, p, (x,)), (params,),
                           ({k: torch.ones_like(v) for k, v in params.items()},))
            else:
                m.zero_grad(set_to_none=True)
                y = vmap(m)(x.view(4, 8, 16))
                y.square().mean().backward()
                out += [y.detach()] + [p.grad.clone() for p in m.parameters()]
        return out

    made = {"ref": lambda: ao.Offloader(impl="ref", device="cpu", min_offload_bytes=0),
            "fast": lambda: ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0),
            "budget": lambda: ao.Offloader(impl="fast", device="cpu", memory_budget=64 << 10)}[offloader]()
    expected, got = run(None), run(made)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))
