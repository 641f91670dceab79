"""Predicting a profile for a workload never profiled from one that was: another sequence
length (or batch) of the same model, whose plan must be chosen before its first step saves
anything (docs/budgets.md, "A plan per workload").

The model: a step's *tokens* are the product of the non-feature dimensions (all but the last)
of the first tensor the first wrapped module is called with. Compute time scales linearly with
tokens; the host's time to issue a group's work does not (the same ops, launched alike whatever
their size), except where it waits on the device (a MoE's routing read back), which grows with
the device's time: so host times are kept where the new workload is smaller and scale with the
tokens where it is larger, the bound from above of both. Saved bytes are
``a * tokens + b * tokens**2`` per group, with ``a, b >= 0`` (activations grow with the tokens,
attention scores kept by an eager attention with their square), and the saves of one profile
cannot be told apart. So:

- from **one** profiled workload, at ``ratio`` = new tokens / profiled tokens, bytes scale by
  ``ratio**2`` where the new workload is larger and by ``ratio`` where it is smaller: for any
  ``a, b >= 0`` that bounds the true bytes from above (``a r t + b r^2 t^2 <= r^2 (a t + b t^2)``
  for ``r >= 1`` and ``<= r (a t + b t^2)`` for ``r <= 1``);
- from **two** profiled workloads of the same groups at different tokens, each group's bytes
  are fitted as ``a t + b t^2`` through both; where a group's fit gives ``a < 0`` or ``b < 0``
  (its bytes do not follow the model: a part that does not grow with the tokens), that group
  falls back to the bound above.

Parameter gradients (``grads``) do not scale; the base is the larger of the profiled one and
the new step's own (a smaller base than profiled may mean gradients freed that backward makes
again, which the profile did not see). A prediction only chooses the plan a step runs until
the workload is profiled; a plan runs for it only where its modelled peak, with the margin,
fits the budget.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from .costmodel import GroupProfile, Profile, Whole, scaled_times

# Bytes fitted from two profiles may come out a little below the truth where the model is not
# exact: each fitted factor is raised by this share (still far below the bound's square).
FIT_SLACK = 0.02


def bound(ratio: float) -> float:
    """The factor that bounds saved bytes from above at ``ratio`` times the tokens (``a, b >= 0``)."""
    return ratio * ratio if ratio > 1 else ratio


def fitted_factor(t_ref: int, q_ref: int, t_other: int, q_other: int, t_new: int) -> float | None:
    """Bytes at ``t_new`` over bytes at ``t_ref``, fitting ``a t + b t^2`` (``a, b >= 0``) through
    ``(t_ref, q_ref)`` and ``(t_other, q_other)``; ``None`` where no such fit passes through both.

    >>> round(fitted_factor(100, 100, 200, 200, 150), 3)   # linear: 1.5 times the bytes
    1.5
    >>> round(fitted_factor(100, 100, 200, 400, 150), 3)   # square: 2.25 times
    2.25
    >>> fitted_factor(100, 100, 200, 150, 150) is None     # grows slower than linear: not the model
    True
    """
    if t_ref == t_other or t_ref <= 0 or t_other <= 0:
        return None
    if q_ref <= 0:
        return 1.0 if q_other <= 0 else None
    b = (q_other / t_other - q_ref / t_ref) / (t_other - t_ref)
    a = q_ref / t_ref - b * t_ref
    scale = q_ref / t_ref  # what "a little below zero" means here: rounding of whole bytes
    if a < -1e-6 * scale or b < -1e-6 * scale / max(t_ref, t_other):
        return None
    return max(0.0, a * t_new + b * t_new * t_new) / q_ref


def _up(n: int | float, f: float) -> int:
    return int(math.ceil(n * f))


def _group(g: GroupProfile, f: float, f_inputs: float, time: float) -> GroupProfile:
    host = max(1.0, time)  # (see the module: the host's time does not shrink with the tokens)
    return replace(
        g, spans=tuple(sorted((_up(s, f) for s in g.spans), reverse=True)), kept=_up(g.kept, f),
        inputs=None if g.inputs is None else _up(g.inputs, f_inputs),
        forward_s=g.forward_s * time, backward_s=g.backward_s * time,
        recompute_s=None if g.recompute_s is None else g.recompute_s * time,
        host_s=None if g.host_s is None else g.host_s * host,
        recompute_host_s=None if g.recompute_host_s is None else g.recompute_host_s * host,
        dispatch_host_s=scaled_times(g.dispatch_host_s, host),
        forward_extra=_up(g.forward_extra, f), backward_extra=_up(g.backward_extra, f),
        recompute_extra=_up(g.recompute_extra, f), costly=_each_up(g.costly, f), attention=_each_up(g.attention, f),
        inputs_moving=None if g.inputs_moving is None else _up(g.inputs_moving, f_inputs),
        costly_moving=_each_up(g.costly_moving, f), attention_moving=_each_up(g.attention_moving, f))


def _each_up(sizes: tuple[int, ...] | None, f: float) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(_up(n, f) for n in sizes)


def same_groups(a: Profile, b: Profile) -> bool:
    """Two profiles of one model's step: the same groups (each recomputable or not) and modules."""
    return (len(a.groups) == len(b.groups) and [w[:2] for w in _wholes(a)] == [w[:2] for w in _wholes(b)]
            and all((x.inputs is None) == (y.inputs is None) for x, y in zip(a.groups, b.groups)))


def _wholes(p: Profile) -> list[tuple[int, int, int]]:
    return [(w.first, w.parts, w.inputs) for w in p.wholes]


def predicted(ref: Profile, t_ref: int, t_new: int, base: int,
              other: tuple[Profile, int] | None = None) -> Profile:
    """``ref`` (profiled at ``t_ref`` tokens) as predicted at ``t_new`` tokens, on ``base`` bytes
    allocated when the step begins (the larger of it and ``ref``'s is taken); ``other``: a second
    profile of the same groups and its tokens, to fit each group's bytes (see the module).

    >>> g = GroupProfile("0", spans=(1000,), kept=10, inputs=100, forward_s=1.0, backward_s=2.0)
    >>> p = Profile((g,), base=0, outside_s=0.5, d2h_bps=1e9, h2d_bps=1e9)
    >>> q = predicted(p, 100, 200, base=0)     # twice the tokens: bytes bounded by 4x, time 2x
    >>> q.groups[0].spans, q.groups[0].forward_s
    ((4000,), 2.0)
    >>> predicted(p, 200, 100, base=0).groups[0].spans   # half: bytes bounded by half
    (500,)
    """
    ratio = t_new / t_ref
    conservative = bound(ratio)
    groups = tuple(_group(g, f, f_in, ratio) for g, (f, f_in, _) in zip(ref.groups, _factors(ref, t_ref, t_new, other)))
    wholes = tuple(Whole(w.first, w.parts, _up(w.inputs, conservative)) for w in ref.wholes)
    return replace(ref, groups=groups, base=max(base, ref.base), outside_s=ref.outside_s * ratio,
                   outside_extra=_up(ref.outside_extra, conservative), wholes=wholes)


def least_shares(ref: Profile, t_ref: int, t_new: int, other: tuple[Profile, int] | None = None) -> tuple[float, ...]:
    """Per group of :func:`predicted`'s profile (the same arguments), the least share of its
    predicted saved bytes that what it saves may turn out to be, and still be the workload
    predicted (fewer: it is profiled). Scaling down from one profile, the bound is the ratio of
    tokens times the bytes, which are at least its square times them (``a, b >= 0``): down to the
    ratio of the bound is the model's own spread (on an H200 the GPT-MoE's 768-token attention
    parts, predicted from 1024 tokens, saved 0.80 of the bound, and profiling them again cost two
    of the least-memory plan's steps, 66-92 ms over checkpointing's each, in a loop of 48).
    Bytes fitted from two profiles are near what the group saves, and scaling up, bytes at the
    inverse of the ratio of the bound (the square's) plan far more conservatively than the
    workload needs: there, 1 (off by more than the tolerance, it is profiled).

    >>> g = GroupProfile("0", spans=(1000,), kept=10, inputs=100, forward_s=1.0, backward_s=2.0)
    >>> p = Profile((g,), base=0, outside_s=0.5, d2h_bps=1e9, h2d_bps=1e9)
    >>> least_shares(p, 200, 150), least_shares(p, 100, 200)
    ((0.75,), (1.0,))
    """
    ratio = t_new / t_ref
    if ratio >= 1:
        return (1.0,) * len(ref.groups)
    return tuple(1.0 if fitted else ratio for _, _, fitted in _factors(ref, t_ref, t_new, other))


def _factors(ref: Profile, t_ref: int, t_new: int, other: tuple[Profile, int] | None) -> list[tuple[float, float, bool]]:
    """Per group of ``ref``: the factor of its saved bytes at ``t_new`` tokens, that of its
    inputs, and whether the first was fitted through two profiles (else it is the bound)."""
    conservative = bound(t_new / t_ref)
    use = other if other is not None and other[1] != t_ref and same_groups(ref, other[0]) else None
    out = []
    for i, g in enumerate(ref.groups):
        f = f_in = conservative
        fitted = False
        if use is not None:
            o, t_other = use[0].groups[i], use[1]
            fit = fitted_factor(t_ref, g.offloadable + g.kept, t_other, o.offloadable + o.kept, t_new)
            if fit is not None:
                f, fitted = min(conservative, fit * (1 + FIT_SLACK)), True
            if g.inputs is not None and o.inputs is not None:
                fit_in = fitted_factor(t_ref, g.inputs, t_other, o.inputs, t_new)
                if fit_in is not None:
                    f_in = min(conservative, fit_in * (1 + FIT_SLACK))
        out.append((f, f_in, fitted))
    return out


def tokens(shapes: Sequence[tuple[int, ...]]) -> int | None:
    """A step's tokens from the shapes of the tensors its first wrapped module is called with:
    the product of the first one's dimensions but the last (its features); ``None`` without one.

    >>> tokens([(8, 512, 1024)]), tokens([(512, 1024), (512,)]), tokens([])
    (4096, 512, None)
    """
    if not shapes:
        return None
    return math.prod(shapes[0][:-1])
