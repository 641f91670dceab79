"""The layers scenarios are built from: each maps ``[B, T, D] -> [B, T, D]``.

Every layer that saves an interesting activation ``h`` calls ``self.hooks.on_saved(h)``
right after the ops that save it (and ``before_save(h)`` before them), where the
scenario places marks (R4) or an in-place write after the save (R6).
"""

from __future__ import annotations

import contextlib

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.testing._internal.two_tensor import TwoTensor

import actoffload as ao
from actoffload.tools.models import Attention, GPTConfig


class Hooks:
    """Per-layer events: marks before/after the save, an in-place write after it."""

    def __init__(self, mark: str | None = None, inplace_after_save: bool = False):
        self.mark = mark
        self.inplace_after_save = inplace_after_save

    def before_save(self, h: torch.Tensor) -> None:
        if self.mark in ("veto_before", "optin_before"):
            (ao.mark_not_offload if self.mark == "veto_before" else ao.mark_activation_offload)(h)

    def on_saved(self, h: torch.Tensor) -> None:
        if self.mark in ("veto_after", "optin_after"):
            (ao.mark_not_offload if self.mark == "veto_after" else ao.mark_activation_offload)(h)
        if self.inplace_after_save:
            with torch.no_grad():
                h.add_(0)  # same values, new version: backward must raise (R6)


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.hooks = Hooks()


class Linear(Layer):
    def __init__(self, d):
        super().__init__(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = x.tanh()
        self.hooks.before_save(h)
        y = self.fc(h)  # saves h and weight.t()
        self.hooks.on_saved(h)
        return y


class Norm(Layer):
    def __init__(self, d, kind):
        super().__init__(d)
        self.norm = nn.LayerNorm(d) if kind == "layernorm" else nn.RMSNorm(d)

    def forward(self, x):
        h = x * 1.5
        self.hooks.before_save(h)
        y = self.norm(h)
        self.hooks.on_saved(h)
        return y


class Attn(Layer):
    def __init__(self, d):
        super().__init__(d)
        self.attn = Attention(GPTConfig(d_model=d, n_heads=2))

    def forward(self, x):
        h = x.sin()
        self.hooks.before_save(h)
        # the math backend: deterministic on CUDA too (R1 needs none-vs-none equality)
        ctx = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH) if x.is_cuda else contextlib.nullcontext()
        with ctx:
            y = self.attn(h)
        self.hooks.on_saved(h)
        return y


class MLP(Layer):
    def __init__(self, d, kind):
        super().__init__(d)
        self.kind = kind
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(d if kind == "swiglu_mlp" else 2 * d, d)  # swiglu halves fc1's output

    def forward(self, x):
        h = self.fc1(x)
        self.hooks.before_save(h)
        if self.kind == "swiglu_mlp":
            a, b = h.chunk(2, dim=-1)  # views of h
            z = F.silu(a) * b
        else:
            z = F.gelu(h)
        self.hooks.on_saved(h)
        return self.fc2(z)


class Views(Layer):
    """Saves several aliases of one activation (R5)."""

    def __init__(self, d, kind):
        super().__init__(d)
        self.kind = kind

    def forward(self, x):
        B, T, D = x.shape
        h = x.sigmoid()
        self.hooks.before_save(h)
        if self.kind == "transpose":
            y = x + (h @ h.transpose(-1, -2)) @ h / T
        elif self.kind == "slice":
            y = torch.cat([h[..., : D // 2] * h[..., D // 2 :], h[..., 1 : D // 2 + 1]], dim=-1)
        elif self.kind == "reshape":
            y = (h.reshape(B * T, D) * h.reshape(B * T, D)).reshape(B, T, D) + x
        elif self.kind == "expand":
            m = h.mean(1, keepdim=True).exp()
            y = x * m.expand(B, T, D)
        else:  # as_strided: overlapping windows of h, starting one element in
            a = h.as_strided((B, T - 1, D), (T * D, D, 1), h.storage_offset() + 1)
            y = x + F.pad(a * a, (0, 0, 0, 1))
        self.hooks.on_saved(h)
        return y


class InplaceBeforeSave(Layer):
    def forward(self, x):
        h = x * 1
        h.mul_(0.5)  # modified before the save: fine
        self.hooks.before_save(h)
        y = h.exp()
        self.hooks.on_saved(h)
        return y


class _QuantizedScale(torch.autograd.Function):
    """y = x * c with c = dequantize(quantize(x)) held constant; saves c as a QuantizedTensor."""

    @staticmethod
    def forward(ctx, x):
        q = ao.quantize(x.reshape(-1, x.shape[-1]), with_transpose=True)
        ctx.save_for_backward(q)
        return x * q.dequantize().reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        if not isinstance(q, ao.QuantizedTensor):
            raise TypeError(f"expected a QuantizedTensor back, got {type(q).__name__}")
        assert torch.equal(q._transpose, q._data.t().contiguous())
        return g * q.dequantize().reshape(g.shape)


class Quantized(Layer):
    def forward(self, x):
        return _QuantizedScale.apply(x.float()).to(x.dtype)


class _GroupedScale(torch.autograd.Function):
    """y = x * c with c a copy of x held in a GroupedTensor with uneven (and empty) groups."""

    @staticmethod
    def forward(ctx, x):
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        sizes = [n // 3, 0, n - n // 3]
        g = ao.GroupedTensor.from_tensors(list(torch.split(rows.detach().clone(), sizes)))
        ctx.save_for_backward(g)
        return x * g.data_buffer.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        if not isinstance(g, ao.GroupedTensor):
            raise TypeError(f"expected a GroupedTensor back, got {type(g).__name__}")
        return grad * torch.cat(g.split()).reshape(grad.shape)


class Grouped(Layer):
    def forward(self, x):
        return _GroupedScale.apply(x)


class Experts(Layer):
    """The fused MoE expert block on the flattened tokens, uneven splits with an empty expert."""

    def __init__(self, d, selected=()):
        super().__init__(d)
        self.mlp = ao.ops.GroupedMLP(4, d, d, activation="swiglu")
        ao.select_modules(self.mlp, set(selected))

    def forward(self, x):
        B, T, D = x.shape
        n = B * T
        sizes = [n // 3, 0, n - n // 3 - n // 4, n // 4]
        return x + self.mlp(x.reshape(n, D), sizes).reshape(B, T, D)


class Complex(Layer):
    """Complex activations with lazy conjugate and negative bits saved (R5's exact restore):
    ``h.conj() * w`` saves a conjugate view, ``.conj().imag`` a negative view."""

    def __init__(self, d):
        super().__init__(d)
        self.w = nn.Parameter(torch.randn(d // 2) / d**0.5)

    def forward(self, x):
        B, T, D = x.shape
        h = torch.view_as_complex(x.float().reshape(B, T, D // 2, 2).contiguous())
        self.hooks.before_save(h)
        c = h.conj() * self.w.float()  # saves h.conj() (conj bit) and w
        n = (h * 1).conj().imag  # a view with the negative bit
        m = n * n.detach().sigmoid()  # saves the negative view
        self.hooks.on_saved(h)
        return (torch.view_as_real(c).reshape(B, T, D) + m.repeat_interleave(2, dim=-1)).to(x.dtype)


class _TwoTensorScale(torch.autograd.Function):
    """y = x * c with c saved as a TwoTensor (a wrapper subclass speaking __tensor_flatten__,
    as DTensor and torchao's Float8 do): it must come back as one, both halves intact."""

    @staticmethod
    def forward(ctx, x):
        c = x.detach().tanh()
        t = TwoTensor(c, c.clone())
        ctx.save_for_backward(t)
        return x * c

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        if not isinstance(t, TwoTensor) or not torch.equal(t.a, t.b):
            raise TypeError(f"expected a TwoTensor with equal halves back, got {type(t).__name__}")
        return g * t.a


class Wrapper(Layer):
    def forward(self, x):
        return _TwoTensorScale.apply(x)


class ForwardAD(Layer):
    """Forward-mode AD inside the group: dual tensors and a ZeroTensor are saved."""

    def __init__(self, d):
        super().__init__(d)
        self.w = nn.Parameter(torch.randn(d) / d**0.5)

    def forward(self, x):
        with fwAD.dual_level():
            d = fwAD.make_dual(x * 1, torch.ones_like(x))
            y = (d * self.w).sin()  # saves d's primal and w's tangent (a ZeroTensor)
            primal = fwAD.unpack_dual(y).primal
        return primal


class Nested(Layer):
    """A strided nested tensor saved for backward (stays resident: reason device)."""

    def __init__(self, d):
        super().__init__(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        n = x.shape[0] * x.shape[1]
        nt = torch.nested.nested_tensor(list(x.detach().flatten(0, 1).split([1, n - 1])))
        y = torch.nested.to_padded_tensor(self.fc(nt), 0.0)  # fc saves nt
        return x + y.sum() * 1e-3


class ParameterSwap(Layer):
    """Saves the parameter itself (``x * w``), then replaces its ``.data``: backward sees the
    new values, as in PyTorch."""

    def __init__(self, d):
        super().__init__(d)
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        y = x * self.w
        self.w.data = self.w.data * 0.5
        return y


class DetachedWeight(Layer):
    """``F.linear`` with a detached weight saves ``weight.detach().t()``: a parameter's
    storage without ``_base``; it must stay (reason parameter)."""

    def __init__(self, d):
        super().__init__(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return F.linear(x, self.fc.weight.detach(), self.fc.bias)


class Compiled(Layer):
    """An MLP compiled with torch.compile (AOTAutograd saves its activations; backend
    aot_eager, so no code generation slows the suite down)."""

    def __init__(self, d):
        super().__init__(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.compiled = torch.compile(self.mlp, backend="aot_eager", dynamic=False)

    def forward(self, x):
        return self.compiled(x)


class Dropout(Layer):
    """Reads the training flag: a recomputation must draw the forward's mask (the flag as it
    was, the RNG state checkpointing restores) even after ``model.eval()``."""

    def __init__(self, d):
        super().__init__(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(F.dropout(x.tanh(), 0.25, self.training))


class Attribute(Layer):
    """Reads plain attributes in forward (a float, a str, a tuple): the runner changes them
    between the loss and backward, where a recomputation must still see the forward's."""

    def __init__(self, d):
        super().__init__(d)
        self.fc = nn.Linear(d, d)
        self.scale, self.act, self.bounds = 1.5, "tanh", (-0.75, 0.75)

    def forward(self, x):
        h = self.fc(x) * self.scale
        h = h.tanh() if self.act == "tanh" else h.sigmoid()
        return h.clamp(*self.bounds)

    def change(self) -> None:
        self.scale, self.act, self.bounds = 0.5, "sigmoid", (-0.25, 0.25)

    def restore(self) -> None:
        self.scale, self.act, self.bounds = 1.5, "tanh", (-0.75, 0.75)


class Resizable(Layer):
    """Saves a tensor (``fc``'s input) the runner frees with ``untyped_storage().resize_(0)``
    after forward and refills, same bytes, before backward (as FSDP does with what it
    gathered): ``saved`` lists those tensors, forward by forward."""

    def __init__(self, d):
        super().__init__(d)
        self.fc = nn.Linear(d, d)
        self.saved: list[torch.Tensor] = []

    def forward(self, x):
        h = x * 2  # nothing saves x; fc saves h
        y = self.fc(h)
        self.saved.append(h)
        return y


class Chain(Layer):
    """A long chain of small ops in one group: ``n`` saves, consecutive ones sharing storages
    (tanh saves its output, which sin then saves as its input)."""

    def __init__(self, d, n):
        super().__init__(d)
        self.n = n

    def forward(self, x):
        h = x
        for k in range(self.n):
            h = h.sin() if k % 2 else h.tanh()
        return x + h


class Tiny(nn.Module):
    """One of many tiny groups: a residual tanh (saves its output)."""

    def forward(self, x, fail=False):
        return x + 0.5 * x.tanh()


def build(kind: str, d: int, chain: int = 0) -> Layer:
    if kind == "linear":
        return Linear(d)
    if kind in ("layernorm", "rmsnorm"):
        return Norm(d, kind)
    if kind == "attention":
        return Attn(d)
    if kind in ("gelu_mlp", "swiglu_mlp"):
        return MLP(d, kind)
    if kind in ("transpose", "slice", "reshape", "expand", "as_strided"):
        return Views(d, kind)
    if kind == "inplace_before_save":
        return InplaceBeforeSave(d)
    if kind == "quantized":
        return Quantized(d)
    if kind == "grouped":
        return Grouped(d)
    if kind == "grouped_mlp":
        return Experts(d)
    if kind == "grouped_mlp_selected":
        return Experts(d, selected={"moe_act"})
    if kind == "chain":
        return Chain(d, chain)
    simple = {"complex": Complex, "wrapper_subclass": Wrapper, "forward_ad": ForwardAD, "nested": Nested,
              "parameter_swap": ParameterSwap, "detached_weight": DetachedWeight, "compiled": Compiled,
              "dropout": Dropout, "attribute": Attribute, "resizable": Resizable}
    if kind in simple:
        return simple[kind](d)
    raise ValueError(f"unknown layer kind {kind!r}")
