"""Recomputation the library chooses is invisible: a wrapped module that fast recomputes on its
own initiative (the warm-up, a memory budget's first steps) recomputes in backward with the
state its forward saw: the parameters and buffers it was called with (``functional_call``),
its training flags, and its immutable plain attributes. Each step is compared bit for bit with
the same one without an offloader (R1)."""

import contextlib

import pytest
import torch
from torch.func import functional_call

import actoffload as ao
from helpers import assert_bitwise

D = 16
SETTINGS = [pytest.param({"warmup": "recompute"}, id="warmup"),
            pytest.param({"memory_budget": 1 << 40}, id="budget")]


def _off(settings):
    return ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, **settings)


class Block(torch.nn.Module):
    """Reads plain attributes (a float, a str, a tuple) and its training flag in forward, and
    counts its calls."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)
        self.drop = torch.nn.Dropout(0.5)
        self.register_buffer("shift", torch.linspace(-1, 1, 2 * D))
        self.scale, self.act, self.bounds, self.calls = 2.0, "tanh", (-0.5, 0.5), 0

    def forward(self, x):
        self.calls += 1
        h = self.fc1(x) * self.scale + self.shift
        h = torch.tanh(h) if self.act == "tanh" else torch.sigmoid(h)
        return x + self.fc2(self.drop(h.clamp(*self.bounds)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(3)])


def _x(step=0):
    return torch.randn(8, D, generator=torch.Generator().manual_seed(step), requires_grad=True)


def _wrapped_step(model, settings, step_fn):
    """``step_fn(model)`` (returning the tensors to compare) under a fresh offloader wrapping the
    blocks; asserts that its first step recomputed every block."""
    off = _off(settings)
    with ao.wrap(model, off):
        got = step_fn(model)
        groups = off.stats()["groups"]
        assert groups and all(g.get("recomputed") for g in groups.values()), groups
    return got


def _same_rng(fn):
    def run(model):
        torch.manual_seed(1)
        return fn(model)
    return run


@pytest.mark.parametrize("settings", SETTINGS)
def test_functional_call_recomputes_with_the_tensors_it_was_called_with(settings):
    @_same_rng
    def step(model):
        scale = torch.tensor(0.75, requires_grad=True)  # a hypernetwork's output: tensors with a history
        tensors = {n: p.detach() * scale for n, p in model.named_parameters()}
        tensors |= {n: b + 1 for n, b in model.named_buffers()}
        x = _x()
        y = functional_call(model, tensors, (x,))
        y.square().sum().backward()
        assert all(p.grad is None for p in model.parameters())  # nothing reached the module's own
        return [y.detach(), x.grad, scale.grad]

    expected = step(_model())
    assert_bitwise(_wrapped_step(_model(), settings, step), expected)


@pytest.mark.parametrize("settings", SETTINGS)
def test_eval_between_loss_and_backward_recomputes_in_training_mode(settings):
    @_same_rng
    def step(model):
        x = _x()
        loss = model(x).square().sum()
        model.eval()  # dropout off in the recomputation would change every gradient
        loss.backward()
        assert not any(m.training for m in model.modules())  # as the caller left them
        return [x.grad] + [p.grad for p in model.parameters()]

    expected = step(_model())
    assert_bitwise(_wrapped_step(_model(), settings, step), expected)


@pytest.mark.parametrize("settings", SETTINGS)
def test_plain_attributes_changed_before_backward_are_the_forwards_in_the_recomputation(settings):
    @_same_rng
    def step(model):
        x = _x()
        loss = model(x).square().sum()
        for b in model:
            b.scale, b.act, b.bounds = 3.0, "sigmoid", (-1.0, 1.0)
            b.extra = 1  # a new attribute stays
        loss.backward()
        assert all((b.scale, b.act, b.bounds, b.extra) == (3.0, "sigmoid", (-1.0, 1.0), 1) for b in model)
        # the recomputation's own change to a plain attribute is undone: one call per forward
        assert [b.calls for b in model] == [1, 1, 1]
        return [x.grad] + [p.grad for p in model.parameters()]

    expected = step(_model())
    assert_bitwise(_wrapped_step(_model(), settings, step), expected)


@pytest.mark.parametrize("settings", SETTINGS)
def test_swapped_parameters_come_back_after_the_recomputation(settings):
    """Parameters replaced between forward and backward: the recomputation uses those of the
    forward, and afterwards the module holds the new ones again."""
    @_same_rng
    def step(model):
        x = _x()
        loss = model(x).square().sum()
        old = model[0].fc1.weight
        new = torch.nn.Parameter(old.detach() * 2)
        model[0].fc1.weight = new
        loss.backward()
        assert model[0].fc1.weight is new and new.grad is None
        return [x.grad, old.grad] + [p.grad for p in model[1:].parameters()]

    expected = step(_model())
    assert_bitwise(_wrapped_step(_model(), settings, step), expected)


class Flagged(torch.nn.Module):
    """Takes keyword arguments named as ``torch.utils.checkpoint``'s own settings."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, x, *, gain=None, **flags):
        y = torch.tanh(self.fc(x))
        for k in sorted(flags):  # each flag that is set changes the output
            if flags[k]:
                y = y * 2 + len(k)
        return y if gain is None else y * gain


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("flags", [{"use_reentrant": True}, {"debug": True}, {"preserve_rng_state": True},
                                   {"determinism_check": "none"}, {"context_fn": 1}])
def test_keyword_arguments_reach_the_recomputed_module(settings, flags):
    """Keyword arguments go to the module, in its forward and its recomputation, whatever
    they are called: not to the checkpointing the library recomputes it under (R1)."""
    def step(model):
        x = _x()
        gain = torch.tensor(1.5, requires_grad=True)  # a tensor keyword argument with a history
        y = x
        for m in model:
            y = m(y, gain=gain, **flags)
        y.square().sum().backward()
        return [y.detach(), x.grad, gain.grad] + [p.grad for p in model.parameters()]

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[Flagged() for _ in range(3)])

    assert_bitwise(_wrapped_step(model(), settings, step), step(model()))


class Ema(torch.nn.Module):
    """Adds a running mean of its inputs, updated in place in its forward (training only)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.register_buffer("mean", torch.zeros(D))

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return x + torch.tanh(self.fc(x) + self.mean)


@pytest.mark.parametrize("settings", SETTINGS)
def test_buffers_a_forward_writes_in_place_are_written_once_and_the_recomputation_is_the_forward(settings):
    """Spectral normalization's power iteration and a running mean write their buffers in the
    forward: recomputed, the forward runs on copies of them as they were before it, so the
    gradients and the buffers stay those without an offloader, step after step (a second backward
    over one forward recomputes again, from the same copies; an evaluation forward writes none)."""
    from torch.nn.utils.parametrizations import spectral_norm

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(spectral_norm(torch.nn.Linear(D, D)), Ema(), Ema())

    def steps(m, off=None):
        out = []
        with ao.wrap(m, off) if off is not None else contextlib.nullcontext():
            for step in range(4):
                m.train(step != 2)  # an evaluation step: its forward writes nothing
                x = _x(step)
                loss = m(x).square().sum()
                loss.backward(retain_graph=step == 1)
                if step == 1:
                    loss.backward()  # recomputed again, from the same copies
                out += [x.grad] + [p.grad.clone() for p in m.parameters()]
                out += [b.clone() for b in m.buffers()]
                m.zero_grad()
                if off is not None and step == 0:
                    groups = off.stats()["groups"]
                    assert groups and all(g.get("recomputed") for g in groups.values()), groups
        return out

    assert_bitwise(steps(model(), _off(settings)), steps(model()))
