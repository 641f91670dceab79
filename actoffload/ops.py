"""Fused ops whose saved activations can be selected for offload one by one.

``GroupedMLP`` is the MoE expert block: fc1 per expert -> activation -> fc2 per expert,
over tokens already sorted by expert, as one autograd Function. It saves exactly three
activations, each under a role name:

- ``expert_fc1``: the fc1 input ``[N, hidden]`` (a ``GroupedTensor``);
- ``moe_act``: the activation input ``[N, 2*ffn]`` for swiglu, ``[N, ffn]`` otherwise;
- ``expert_fc2``: the fc2 input ``[N, ffn]`` (a ``QuantizedTensor`` with ``fp8=True``).

If any of its roles is selected (``select_modules``), only the selected tensors are
candidates (and are opted in, so ``policy="marked"`` offloads exactly the selection
model-wide) and the others are vetoed with ``mark_not_offload``; if none is, all three
are candidates. With no offload group open the op does no marking work at all. A fused op
that saved everything whenever offloading was on, ignoring the selection, is the bug
this layout exists to avoid.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import compat, policy
from .engine import group_open
from .grouped import GroupedTensor
from .marks import mark_parameters
from .quantized import QuantizedTensor, quantize
from .roles import mark_selection, selects

ROLES = ("attn_norm", "qkv", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act", "expert_fc2")
ACTIVATIONS = ("swiglu", "gelu", "srelu")


def activation(kind: str, a: torch.Tensor) -> torch.Tensor:
    """The expert activation: swiglu (gate, up halves), gelu, or srelu (squared ReLU)."""
    if kind == "swiglu":
        gate, up = a.chunk(2, dim=-1)
        return F.silu(gate) * up
    if kind == "gelu":
        return F.gelu(a)
    if kind == "srelu":
        return F.relu(a).square()
    raise ValueError(f"unknown activation {kind!r}; valid ones are: {', '.join(ACTIVATIONS)}")


def _per_expert(x: torch.Tensor, sizes: list[int], weights: torch.Tensor) -> torch.Tensor:
    """Row block e of ``x`` times ``weights[e]``, for every expert, concatenated."""
    return torch.cat([chunk @ w for chunk, w in zip(torch.split(x, sizes), weights)])


def _values(saved: torch.Tensor) -> torch.Tensor:
    """A saved activation as a plain tensor. The op saves GroupedTensor and QuantizedTensor,
    but saved-tensor hooks that copy into new tensors (``torch.autograd.graph.save_on_cpu``)
    hand back plain tensors holding the same values."""
    if isinstance(saved, QuantizedTensor):
        return saved.dequantize()
    if isinstance(saved, GroupedTensor):
        return saved.data_buffer
    return saved


class _GroupedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, w1, w2, sizes, kind, fp8, selected):
        a = _per_expert(tokens, sizes, w1)  # activation input
        z = activation(kind, a)  # fc2 input
        if fp8:
            zq = quantize(z)
            z = zq.dequantize()  # fc2 runs on what is saved: forward and backward agree
        y = _per_expert(z, sizes, w2)
        saved = {
            "expert_fc1": GroupedTensor(tokens.detach(), sizes),
            "moe_act": GroupedTensor(a.detach(), sizes),
            "expert_fc2": zq if fp8 else GroupedTensor(z.detach(), sizes),
        }
        if selected and group_open():  # only then: no marking work outside offload groups
            mark_selection(selected, saved)
        if group_open() and policy.is_parameter(tokens):
            # the tokens are a leaf that requires grad (or a view of one), which autograd holds
            # anyway: saved as themselves by a plain op, they would stay (R3); so do these bytes
            mark_parameters(tokens)
        ctx.save_for_backward(saved["expert_fc1"], saved["moe_act"], saved["expert_fc2"], w1, w2)
        ctx.sizes, ctx.kind = sizes, kind
        # The saved GroupedTensor is a wrapper over the tokens' bytes with a version counter of
        # its own, which autograd checks: a write to the tokens after this (an in-place residual,
        # h += moe(h)) would reach backward unnoticed. Checked here, as autograd checks a tensor.
        ctx.tokens_version = compat.version_guard(tokens), tokens._version
        return y

    @staticmethod
    def backward(ctx, dy):
        guard, version = ctx.tokens_version
        if guard._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: GroupedMLP's input tokens are at version {guard._version}; expected version "
                f"{version} instead. Write the tokens out of place (h = h + moe(h)), or clone them first.")
        x, a, z, w1, w2 = ctx.saved_tensors
        sizes = ctx.sizes
        x, a, z = _values(x), _values(a), _values(z)
        dys = torch.split(dy, sizes)
        dz = torch.cat([g @ w.t() for g, w in zip(dys, w2)])
        dw2 = torch.stack([zc.t() @ g for zc, g in zip(torch.split(z, sizes), dys)])
        with torch.enable_grad():
            a_ = a.detach().requires_grad_(True)
            (da,) = torch.autograd.grad(activation(ctx.kind, a_), a_, dz)
        das = torch.split(da, sizes)
        dx = torch.cat([g @ w.t() for g, w in zip(das, w1)])
        dw1 = torch.stack([xc.t() @ g for xc, g in zip(torch.split(x, sizes), das)])
        return dx, dw1, dw2, None, None, None, None


class GroupedMLP(nn.Module):
    """MoE experts as one fused op: fc1 -> activation -> fc2 per expert.

    ``forward(tokens, split_sizes)`` takes tokens sorted by expert (``[N, hidden]``) and
    the number of tokens of each expert (a list or tensor of ``num_experts`` counts summing
    to N, zeros allowed) and returns ``[N, hidden]``.

    Example::

        mlp = ao.ops.GroupedMLP(num_experts=4, hidden_size=64, ffn_size=128)
        y = mlp(torch.randn(10, 64), [3, 0, 5, 2])
        ao.select_modules(model, {"moe_act"})   # offload only the activation input
    """

    offload_roles = ("expert_fc1", "moe_act", "expert_fc2")

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, activation: str = "swiglu",
                 fp8: bool = False, dtype=None, device=None):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"GroupedMLP needs at least one expert, got num_experts={num_experts}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid ones are: {', '.join(ACTIVATIONS)}")
        fc1_out = 2 * ffn_size if activation == "swiglu" else ffn_size
        kw = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_size, fc1_out, **kw) / hidden_size**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, ffn_size, hidden_size, **kw) / ffn_size**0.5)
        self.activation = activation
        self.fp8 = fp8
        self.offload_selected: set[str] = set()  # set by select_modules

    @selects  # its saves are its own: a module calling it (an MoE layer) leaves them to its selection
    def forward(self, tokens: torch.Tensor, split_sizes: Sequence[int] | torch.Tensor) -> torch.Tensor:
        sizes = [int(n) for n in (split_sizes.tolist() if isinstance(split_sizes, torch.Tensor) else split_sizes)]
        if len(sizes) != self.w1.shape[0] or any(n < 0 for n in sizes) or sum(sizes) != tokens.shape[0]:
            raise ValueError(
                f"split_sizes must be {self.w1.shape[0]} counts >= 0 summing to the {tokens.shape[0]} "
                f"tokens, got {sizes}"
            )
        if isinstance(tokens, GroupedTensor):
            tokens = tokens.data_buffer
        return _GroupedMLPFunction.apply(tokens, self.w1, self.w2, sizes, self.activation, self.fp8,
                                         frozenset(self.offload_selected))


def grouped_mlp_reference(tokens, split_sizes, w1, w2, activation_kind="swiglu", fp8=False):
    """What ``GroupedMLP`` computes, unfused, in plain PyTorch (autograd differentiates it)."""
    sizes = list(split_sizes)
    z = torch.cat([activation(activation_kind, x @ w) for x, w in zip(torch.split(tokens, sizes), w1)])
    if fp8:  # one scale for the whole fc2 input, as the op; the gradient passes straight through
        z = z + (quantize(z).dequantize() - z).detach()
    return torch.cat([zc @ w for zc, w in zip(torch.split(z, sizes), w2)])


def select_modules(model: nn.Module, roles: Iterable[str]) -> list[tuple[str, str]]:
    """Offload only the saved activations of these roles, in every module that has them.

    Replaces the previous selection (an empty set clears it) and returns the
    ``(module path, role)`` pairs selected. Roles: ``attn_norm``, ``qkv``, ``core_attn``,
    ``attn_proj``, ``mlp_norm``, ``expert_fc1``, ``moe_act``, ``expert_fc2``.

    Example::

        ao.select_modules(model, {"moe_act", "expert_fc1"})
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"select_modules takes the model (an nn.Module) first, got {type(model).__name__}")
    if isinstance(roles, str):  # a set of its letters is never meant
        raise TypeError(f"select_modules takes a collection of roles, got the str {roles!r}: write {{{roles!r}}}")
    roles = set(roles)
    unknown = roles - set(ROLES)
    if unknown:
        raise ValueError(f"unknown role(s) {sorted(unknown, key=repr)}; valid roles are: {', '.join(ROLES)}")
    selected = []
    for path, module in model.named_modules():
        own = getattr(module, "offload_roles", None)
        if own is None:
            continue
        module.offload_selected = roles & set(own)
        selected += [(path, role) for role in own if role in roles]
    return selected
