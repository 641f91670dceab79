"""Memory budgets in real training loops: a plan per workload (its signature: the shapes of the
step's first inputs, its groups, its base), chosen when the step's first group opens; a budget
as a share of the device's memory; gradient accumulation and evaluation forwards
(docs/budgets.md, "A plan per workload")."""

import contextlib
import dataclasses
import doctest

import pytest
import torch

import actoffload as ao
from actoffload.budget import buckets, predict
from actoffload.budget.controller import LIGHTER_STEPS, PROFILE_STEPS
from actoffload.budget.costmodel import GroupProfile, Profile
from actoffload.budget.workloads import CAPACITY, signature_of
from actoffload.settings import AUTO_FRACTION, budget_of, parse_memory_budget
from helpers import assert_bitwise

D, H = 256, 1024


def _blocks(n=4):
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D)) for _ in range(n))


def _bytes(rows):
    """What one block saves at ``rows`` rows (fc1's input, GELU's input, fc2's input, fp32)."""
    return rows * (D + 2 * H) * 4


def _step(blocks, rows, seed=0, forwards=1):
    """``forwards`` micro-batches' forwards, then one backward; the gradients."""
    for p in blocks.parameters():
        p.grad = None
    xs, loss = [], 0
    for k in range(forwards):
        x = torch.randn(rows, D, generator=torch.Generator().manual_seed(seed * 10 + k), requires_grad=True)
        h = x * 1
        for b in blocks:
            h = h + b(h)
        loss = loss + h.square().sum()
        xs.append(x)
    loss.backward()
    return [x.grad.clone() for x in xs] + [p.grad.clone() for p in blocks.parameters()]


def _run(off, blocks, lengths, forwards=1):
    """One step per length; per step: its plan's stats and whether it profiled."""
    out = []
    with ao.wrap(blocks, off):
        for i, rows in enumerate(lengths):
            _step(blocks, rows, i, forwards)
            out.append(off.stats()["plan"])
    return out


# ---------------------------------------------------------------- a plan per signature
def test_alternating_lengths_profile_each_once_then_run_their_own_plans():
    lengths = [64, 128, 96] * 6
    budget = 3 * _bytes(64)
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    blocks = _blocks()
    plans = _run(off, blocks, lengths)
    states = [p["state"] for p in plans]
    # each length's steps: PROFILE_STEPS profiling steps (none of the others' in between count),
    # then its plan, from its first group on: no re-profiling, no re-planning; but the first
    # length's profile is made from its first step as the second length's begins, so that the
    # second may be predicted from it (here it is not: the bound, twice the rows and four times
    # the bytes, does not fit), and so is the second's, longer than the first, as the third's
    # begins (the third is not predicted from it either: the least margin, a MiB, is more than
    # this small budget leaves)
    for rows, profiling in ((64, 1), (128, 1), (96, PROFILE_STEPS)):
        mine = [s for s, n in zip(states, lengths) if n == rows]
        assert mine == ["profiling"] * profiling + ["settled"] * (6 - profiling), (rows, mine)
    # each runs its own plan: modelled on its own bytes, within the budget
    by_rows = {}
    for p, rows in zip(plans[3 * PROFILE_STEPS:], lengths[3 * PROFILE_STEPS:]):
        assert p["workload"]["tokens"] == rows and p["workload"]["predicted_from"] is None
        assert p["predicted_peak_bytes"] <= budget
        assert [sum(g["spans"]) + g["kept"] for g in p["profile"]["groups"]] == [_bytes(rows)] * 4
        by_rows.setdefault(rows, set()).add(tuple(g["action"] for g in p["groups"]))
    assert all(len(v) == 1 for v in by_rows.values())  # one plan each, the same at every step
    assert off.stats()["plan"]["workload"]["kept"] == 3


def test_steps_calling_the_first_block_with_a_leaf_requiring_grad_are_a_workload_of_their_own():
    """A gradient penalty's step calls the first block with a leaf that requires grad, which
    stays where it is (a parameter, to the offloader): it saves less than a step of the same
    shapes whose first block gets an activation. Taking turns, each is profiled once, then
    settles (as one workload they profiled each other out, step after step)."""
    blocks, states = _blocks(), []
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(64), min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for i in range(12):
            x = torch.randn(64, D, generator=torch.Generator().manual_seed(i), requires_grad=i % 2 == 0)
            h = x if i % 2 == 0 else x * 1
            for b in blocks:
                h = h + b(h)
            h.square().sum().backward()
            states.append(off.stats()["plan"]["state"])
    for parity in (0, 1):
        assert states[parity::2] == ["profiling"] * PROFILE_STEPS + ["settled"] * (6 - PROFILE_STEPS), states


class _Variants(torch.nn.Module):
    """A block that saves more while ``wide`` (a second activation on the same shapes): two
    variants of one signature, as two LoRA adapters of different ranks trained in turns."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, H), torch.nn.Linear(H, D)
        self.wide = False

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.wide:
            h = h * torch.sigmoid(h)  # saves h and its sigmoid: more bytes than the tolerance
        return self.fc2(h)


def _variants_run(wide_at, steps, budget):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Variants() for _ in range(4))
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    states = []
    with ao.wrap(blocks, off):
        for i in range(steps):
            for b in blocks:
                b.wide = wide_at(i)
            _step(blocks, 64, i)
            states.append(off.stats()["plan"]["state"])
    return states


def test_variants_of_one_signature_taking_turns_profile_once_and_settle():
    """Steps of one signature whose groups save more, then less, by turns (two adapters trained
    in alternation): the plan made for the heavier variant stays within the budget for the
    lighter, so the lighter steps do not profile again; a heavier step than profiled does, at
    once (profiling the light variant first, here, costs one profile more)."""
    budget = 3 * _bytes(64)
    states = _variants_run(lambda i: i % 2 == 1, 16, budget)  # profiled on the heavy step
    assert states[:2] == ["profiling"] * 2 and "profiling" not in states[2:], states
    assert states[-1] == "settled"
    states = _variants_run(lambda i: i % 2 == 0, 16, budget)  # profiled on the light step
    assert states.count("profiling") == 2 * PROFILE_STEPS and states[-1] == "settled", states
    assert "profiling" not in states[2 * PROFILE_STEPS + 1:], states
    # a plan keeping every group: counted against its first step under the plan, not the profile;
    # where that was the light one, the heavy step profiles once more, and its count holds after
    for heavy_first in (True, False):
        states = _variants_run(lambda i: i % 2 == (1 if heavy_first else 0), 16, 1 << 40)
        assert states.count("profiling") <= 2 * PROFILE_STEPS and states[-1] == "settled", (heavy_first, states)
        assert "profiling" not in states[2 * PROFILE_STEPS + 2:], (heavy_first, states)


def test_a_variant_lighter_than_profiled_for_steps_in_a_row_is_profiled_again():
    """A workload that for good saves less than profiled (the heavy variant gone) runs the plan
    made for more for ``LIGHTER_STEPS`` steps, then is profiled again and planned for itself."""
    states = _variants_run(lambda i: i < 4, 4 + LIGHTER_STEPS + 4, 3 * _bytes(64))
    light = states[4:]
    assert "profiling" not in light[:LIGHTER_STEPS], states
    assert light[LIGHTER_STEPS - 1] == "re-planning" and light[LIGHTER_STEPS:LIGHTER_STEPS + PROFILE_STEPS] == [
        "profiling"] * PROFILE_STEPS, states


def test_alternating_lengths_are_bitwise():
    lengths = [64, 128, 96] * 3
    blocks = _blocks()
    expected = [_step(blocks, rows, i) for i, rows in enumerate(lengths)]
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(64), min_offload_bytes=0)
    got = []
    with ao.wrap(blocks, off):
        for i, rows in enumerate(lengths):
            got.append(_step(blocks, rows, i))
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


def test_an_unseen_length_runs_a_plan_predicted_from_the_profiled_ones_and_is_not_profiled():
    budget = 4 * _bytes(128)
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [64, 128] * PROFILE_STEPS + [64, 128])  # both profiled and planned
    plans = _run(off, blocks, [112] * (PROFILE_STEPS + 2))
    first = plans[0]
    # fitted from the two (bytes linear in the rows here): 112 rows' bytes, a little above
    assert first["workload"]["predicted_from"] == f"[128, {D}] torch.float32 cpu"
    assert first["state"] == "settled" and first["predicted_peak_bytes"] <= budget
    # the prediction's time counted apart, and in the workloads' total
    assert first["planning_by"]["predicting"] > 0
    assert first["workload"]["planning_by_all"]["predicting"] >= first["planning_by"]["predicting"]
    predicted = [sum(g["spans"]) + g["kept"] for g in first["profile"]["groups"]]
    assert all(_bytes(112) <= n <= _bytes(112) * (1 + predict.FIT_SLACK) + 8 for n in predicted), predicted
    # seen again: the same predicted plan (its peak and time are measured as it runs, on a GPU)
    assert [p["state"] for p in plans[1:]] == ["settled"] * (PROFILE_STEPS + 1)
    assert all(p["workload"]["predicted_from"] == first["workload"]["predicted_from"] for p in plans)
    assert all(p["groups"] == first["groups"] for p in plans)


def test_a_new_length_whose_predicted_plan_does_not_fit_profiles_on_the_least_memory_plan():
    budget = 2 * _bytes(256)
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [64] * (PROFILE_STEPS + 1))
    plans = _run(off, blocks, [256] * (PROFILE_STEPS + 1))  # 16x the bytes by the bound: nothing fits
    assert plans[0]["workload"]["predicted_from"] is None
    assert [p["state"] for p in plans] == ["profiling"] * PROFILE_STEPS + ["settled"]


def test_a_length_longer_than_every_one_measured_plans_from_its_first_step_as_another_begins():
    """A length whose prediction, scaled up from a shorter one by the bound, fits nothing
    profiles; should another length come next (lengths that rarely recur), its first step alone
    becomes its profile, and a length between the two is predicted from it, scaled down, rather
    than profiling in turn."""
    budget = 2 * _bytes(256)
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [64] * (PROFILE_STEPS + 1))
    plans = _run(off, blocks, [256, 240, 256])
    assert plans[0]["state"] == "profiling" and plans[0]["workload"]["predicted_from"] is None
    assert plans[1]["workload"]["predicted_from"] == f"[256, {D}] torch.float32 cpu"
    assert plans[1]["state"] != "profiling" and plans[1]["predicted_peak_bytes"] <= budget
    assert plans[2]["state"] != "profiling" and plans[2]["workload"]["predicted_from"] is None  # its own profile


def test_an_evaluation_forward_with_gradients_of_more_rows_is_not_taken_for_a_longer_length():
    """An evaluation forward that keeps its graph (no ``no_grad``), of a larger batch, runs before
    a training step's forward: one step of twice the groups, under the evaluation's signature.
    Its first profiling step is another workload's, not a longer length's: the training lengths
    after it are not predicted from it (were they, a plan made for eight groups would meet steps
    of four)."""
    budget = 2 * _bytes(256)
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    blocks = _blocks()

    def forward(rows):
        h = torch.randn(rows, D, requires_grad=True) * 1
        for b in blocks:
            h = h + b(h)
        return h

    _run(off, blocks, [64] * (PROFILE_STEPS + 1))
    with ao.wrap(blocks, off):
        forward(256)  # dropped: its groups join the training step's
        forward(64).square().sum().backward()
        for rows in (96, 80):
            forward(rows).square().sum().backward()
            plan = off.stats()["plan"]
            assert plan["workload"]["groups"] == 4 and plan["workload"]["predicted_from"] != f"[256, {D}] torch.float32 cpu"


def test_workloads_are_bounded_least_recently_used_first_those_measured_last():
    off = ao.Offloader(device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    blocks = _blocks(2)
    lengths = [8 * (i + 1) for i in range(CAPACITY + 2)]
    _run(off, blocks, lengths[:1] * PROFILE_STEPS + lengths[1:2])  # the first measured, the second predicted
    workloads = off.plan.workloads
    second = workloads.workloads[1].controller
    assert second.predicted
    workloads.reserve.bind(second, True)  # (bound to the cache, as on a GPU): dropped with its workload
    _run(off, blocks, lengths[2:])
    kept = [w.signature.tokens for w in workloads.workloads]
    # the measured one stays, what the others are predicted from; the predicted ones go in turn
    assert kept == lengths[:1] + lengths[-(CAPACITY - 1):]
    assert off.stats()["plan"]["workload"]["kept"] == CAPACITY
    assert not workloads.reserve.is_bound(second)
    # where every workload kept was measured, the least recently used goes
    for w in workloads.workloads:
        w.controller.predicted = False
    _run(off, blocks, [8 * (CAPACITY + 3)])
    assert [w.signature.tokens for w in workloads.workloads] == kept[1:] + [8 * (CAPACITY + 3)]


def test_lengths_drawn_from_a_continuous_range_profile_once_and_are_predicted_after():
    """Each length seen once (dynamic padding, say): the first step's profile is made from it
    alone as the second begins, the others are predicted from it, and it is kept however many
    lengths come after; every step bitwise as without offloading."""
    lengths = [72, 40, 120, 64, 104, 48, 96, 56, 88, 112, 80, 128, 32]
    assert len(lengths) > CAPACITY + 2
    blocks = _blocks()
    expected = [_step(blocks, rows, i) for i, rows in enumerate(lengths)]
    # (a budget every predicted plan keeps everything under: a longer length's, scaled up by the
    # bound, that moved or recomputed a group would save fewer bytes than predicted, and profile)
    off = ao.Offloader(device="cpu", memory_budget=16 * _bytes(128), min_offload_bytes=0)
    got, plans = [], []
    with ao.wrap(blocks, off):
        for i, rows in enumerate(lengths):
            got.append(_step(blocks, rows, i))
            plans.append(off.stats()["plan"])
    assert [p["state"] for p in plans] == ["profiling"] + ["settled"] * (len(lengths) - 1)
    first = f"[{lengths[0]}, {D}] torch.float32 cpu"
    assert [p["workload"]["predicted_from"] for p in plans[1:]] == [first] * (len(lengths) - 1)
    workloads = off.plan.workloads.workloads
    assert len(workloads) == CAPACITY and str(workloads[0].signature) == first
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


class _Positioned(torch.nn.Module):
    """A block called as transformers calls its layers: besides the hidden states, tensors whose
    last dimension is the length (``position_ids`` ``[1, L]``, an eager mask ``[1, 1, L, L]``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, H), torch.nn.Linear(H, D)

    def forward(self, h, position_ids, attention_mask):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(h + position_ids.unsqueeze(-1) * 1e-3)))
        return attention_mask[:, 0] @ h


def test_layers_called_with_positions_and_a_mask_are_predicted_at_lengths_not_profiled():
    """Only the hidden states' last dimension says which model it is: a workload whose position
    ids and mask end with the length is predicted from another length's profile (each length
    profiled in turn before: two slow steps each, and no plan settled in a loop of lengths)."""
    from actoffload.budget import workloads

    assert doctest.testmod(workloads).failed == 0
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Positioned() for _ in range(3))

    def step(rows, seed):
        for p in blocks.parameters():
            p.grad = None
        h = torch.randn(1, rows, D, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        positions = torch.arange(rows).unsqueeze(0)
        mask = torch.ones(rows, rows).tril().div(rows)[None, None]
        x = h * 1
        for b in blocks:
            x = x + b(x, position_ids=positions, attention_mask=mask)
        x.square().sum().backward()
        return [h.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]

    lengths = [96, 40, 120, 64, 104, 48]
    expected = [step(rows, i) for i, rows in enumerate(lengths)]
    off = ao.Offloader(device="cpu", memory_budget=64 * _bytes(128), min_offload_bytes=0)
    got, plans = [], []
    with ao.wrap(blocks, off):
        for i, rows in enumerate(lengths):
            got.append(step(rows, i))
            plans.append(off.stats()["plan"])
    assert [p["state"] for p in plans] == ["profiling"] + ["settled"] * (len(lengths) - 1)
    assert all(p["workload"]["predicted_from"].startswith("[1, 96, 256]") for p in plans[1:])
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


def test_the_lengths_of_a_bucket_share_one_prediction_and_its_search():
    """Lengths never seen, within one bucket (tokens up to 80: 73 to 80 rows), are predicted at
    the bucket's tokens, one profile and one search for them all; each keeps its own workload,
    and saving fewer bytes than the bucket's (at fewer rows) is still its workload."""
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(128), min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [128] * PROFILE_STEPS)
    shared = off.plan.workloads.shared
    before = shared.searched
    plans = _run(off, blocks, [73, 76, 80, 79, 76])
    assert shared.searched == before + 1
    assert [p["state"] for p in plans] == ["settled"] * 5
    ws = {w.signature.tokens: w.controller for w in off.plan.workloads.workloads}
    assert all(ws[n].profile is ws[80].profile and ws[n].predicted for n in (73, 76, 79))
    # predicted from 128 rows at 80: bytes linear in the rows here, scaled down by the ratio
    assert [sum(g["spans"]) + g["kept"] for g in plans[0]["profile"]["groups"]] == [_bytes(80)] * 4
    assert plans[0]["groups"] == plans[2]["groups"]
    _run(off, blocks, [81])  # the next bucket (88 rows): a search of its own
    assert shared.searched == before + 2


def test_a_recomputed_group_at_the_low_end_of_a_bucket_is_still_the_workload_predicted():
    """129 rows are predicted at their bucket's 144: a recomputed group's inputs come in at
    129/144 of the prediction, under the workload tolerance, and the step is still the
    workload predicted (no re-planning, no profiling when it comes again)."""
    off = ao.Offloader(device="cpu", memory_budget=int(1.5 * _bytes(256)), min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [256] * PROFILE_STEPS)
    plans = _run(off, blocks, [129, 144, 129])
    assert [p["state"] for p in plans] == ["settled"] * 3
    assert "recompute" in {g["action"] for g in plans[0]["groups"]}
    assert all(p["workload"]["predicted_from"] is not None for p in plans)


def test_beyond_the_capacity_predicted_workloads_go_first_then_those_profiling_and_measured_last():
    """A workload still profiling (its prediction did not fit) is one step from a profile of
    its own; a predicted one is made again cheaply: it goes first."""
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(64), min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [64] * PROFILE_STEPS)
    with ao.wrap(blocks, off):  # a batch of 2 x 64: another model by its inputs' dimensions, profiling
        h = torch.randn(2, 64, D, requires_grad=True)
        for b in blocks:
            h = h + b(h)
        h.square().sum().backward()
    _run(off, blocks, [8 * (i + 1) for i in range(7)] + [60])  # predicted from 64

    def kind(w):
        c = w.controller
        return "profiling" if c.profile is None else "predicted" if c.predicted else "measured"

    workloads = off.plan.workloads.workloads
    assert [kind(w) for w in workloads] == ["measured", "profiling"] + ["predicted"] * (CAPACITY - 2)
    assert [w.signature.tokens for w in workloads[:2]] == [64, 128]


def test_more_signatures_than_are_kept_taking_turns_each_settle_or_say_the_budget_is_too_small_once():
    """Twice the capacity of batch sizes in turn, under a budget the larger ones cannot reach:
    each workload dropped from those kept is parked and taken back when its size comes again,
    so one whose prediction fitted no plan finishes profiling on its next turn rather than
    profiling again at every turn (before parking, four sizes ran the profiling plan forever)."""
    sizes = list(range(256, 256 + 32 * 2 * CAPACITY, 32))
    blocks = torch.nn.Sequential(*_blocks())
    off = ao.Offloader(device="cpu", memory_budget=6_000_000)
    raised = dict.fromkeys(sizes, 0)
    with ao.wrap(blocks, off):
        for turn in range(4):
            states = {}
            for rows in sizes:
                try:
                    blocks(torch.randn(rows, D)).square().mean().backward()
                except ao.BudgetTooSmall as e:  # (actoffload.budget's, exported)
                    assert "smallest reachable peak" in str(e)
                    raised[rows] += 1
                    continue
                states[rows] = off.stats()["plan"]["state"]
    assert set(states.values()) == {"settled"}  # the last turn: every size runs its plan
    assert set(raised.values()) == {0, 1}  # the larger sizes said so once each; the smaller, never
    assert off.stats()["plan"]["workload"]["parked"] == len(sizes) - CAPACITY


def test_a_parked_workload_of_the_steps_base_is_taken_back_before_a_kept_one_profiling_on_another(monkeypatch):
    """A step goes to the workload of its signature on its base, kept or parked; only where
    none is, to one still profiling. (A kept one profiling on another base took the step and
    profiled a second workload of that signature and base beside the parked one; with gradient
    accumulation over 20 sizes in turn each size said BudgetTooSmall at every turn.)"""
    from actoffload.budget.probe import Probe

    base = {"bytes": 0}
    monkeypatch.setattr(Probe, "allocated", lambda self: base["bytes"])
    blocks = torch.nn.Sequential(*_blocks())
    off = ao.Offloader(device="cpu", memory_budget=6_000_000)
    sizes = list(range(400, 400 + 8 * (CAPACITY + 2), 8))

    def step(rows, on=0):
        base["bytes"] = on
        blocks(torch.randn(rows, D)).square().mean().backward()
        blocks.zero_grad(set_to_none=True)
        return off.stats()["plan"]["state"]

    def of(rows):
        workloads = off.plan.workloads
        return [(e.controller.state.value, e in workloads.workloads) for e in workloads.workloads + workloads.parked
                if e.signature.tokens == rows]

    with ao.wrap(blocks, off):
        for _ in range(3):
            for rows in sizes:
                step(rows)
        assert of(sizes[0]) == [("settled", False)]  # parked
        assert step(sizes[0], on=2 << 20) == "profiling"  # another base: a workload of its own
        assert step(sizes[0]) == "settled"  # the parked one, taken back
        assert sorted(state for state, _ in of(sizes[0])) == ["profiling", "settled"]  # no second settled one


def test_a_bucket_has_at_most_four_significant_bits_and_holds_its_tokens():
    assert doctest.testmod(buckets).failed == 0
    for tokens in range(1, 5000):
        top = buckets.bucket(tokens)
        assert tokens <= top <= tokens * 1.125 and len(bin(top)[2:].rstrip("0")) <= 4
    assert [buckets.bucket(4 * n) for n in (512, 1024, 1536, 2048)] == [2048, 4096, 6144, 8192]


def test_the_signature_is_the_first_inputs_shapes_dtypes_and_devices():
    a = signature_of((torch.zeros(2, 8, 4),), {})
    assert a == signature_of((torch.ones(2, 8, 4),), {}) and a.tokens == 16
    assert a != signature_of((torch.zeros(2, 9, 4),), {})
    assert a != signature_of((torch.zeros(2, 8, 4, dtype=torch.bfloat16),), {})
    assert a != signature_of((torch.zeros(2, 8, 4),), {"mask": torch.zeros(8)})
    # a leaf that requires grad stays where it is: a step called with one saves less
    assert a != signature_of((torch.zeros(2, 8, 4, requires_grad=True),), {})
    assert a == signature_of((torch.zeros(2, 8, 4, requires_grad=True) * 1,), {})
    assert signature_of((3, "x"), {}).tokens is None
    # tensors inside tuples, lists and dicts count, named by where they are, and inside a type
    # registered with pytree by their place among its leaves (it need not give their keys)
    nested = signature_of(((torch.zeros(2, 8, 4), torch.zeros(8)),), {"state": {"h": torch.zeros(3)}})
    assert [name for name, *_ in nested.inputs] == ["[0]", "[1]", "state['h']"] and nested.tokens == 16
    assert nested != signature_of(((torch.zeros(2, 9, 4), torch.zeros(8)),), {"state": {"h": torch.zeros(3)}})
    registered = signature_of((_Registered(torch.zeros(2, 8, 4), 0.5),), {})
    assert [(name, shape) for name, shape, *_ in registered.inputs] == [(".0", (2, 8, 4))]


class _Registered:
    """A caller's own type, registered with pytree without its keys (torch allows that)."""

    def __init__(self, h, scale):
        self.h, self.scale = h, scale


torch.utils._pytree.register_pytree_node(_Registered, lambda r: ([r.h, r.scale], None), lambda c, _: _Registered(*c))


class _TupleBlock(torch.nn.Module):
    """Called with a tuple (hidden, scale) and returning one: the tensors a block is called with
    are none of its arguments themselves."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))

    def forward(self, state):
        h, scale = state
        return h + self.mlp(h) * scale, scale


def test_blocks_called_with_a_tuple_profile_each_length_once_and_are_bitwise():
    """Every group recomputed with its inputs in a tuple (checkpoint keeps those itself):
    nothing of the step goes through the offloader's hooks to be unpacked, and the
    recomputations say that the backward pass is running, so that the next step begins."""
    def run(off, lengths):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(_TupleBlock() for _ in range(3))
        states, grads = [], []
        with contextlib.nullcontext() if off is None else ao.wrap(blocks, off):
            for i, rows in enumerate(lengths):
                blocks.zero_grad(set_to_none=True)
                x = torch.randn(rows, D, generator=torch.Generator().manual_seed(i), requires_grad=True)
                state = (x, torch.tensor(0.5))
                for b in blocks:
                    state = b(state)
                state[0].square().sum().backward()
                grads += [x.grad] + [p.grad for p in blocks.parameters()]
                if off is not None:
                    states.append((rows, off.stats()["plan"]["state"], off.stats()["plan"]["workload"]["signature"]))
        return states, grads

    lengths = [64, 64, 128, 128, 64, 128, 64]
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(64), min_offload_bytes=0)
    states, grads = run(off, lengths)
    assert [s for _, s, _ in states[:4]] == ["profiling"] * 4 and {s for _, s, _ in states[4:]} == {"settled"}, states
    assert all(sig.startswith(f"[0]=[{rows}, {D}]") for rows, _, sig in states), states
    # backward reached every group, and what each saved counts its inputs (the tuple's included)
    profile = off.stats()["plan"]["profile"]["groups"]
    assert all(g["reached"] for g in profile) and all(g["inputs"] >= 64 * D * 4 for g in profile[1:]), profile
    assert_bitwise(grads, run(None, lengths)[1])


# ---------------------------------------------------------------- the prediction model
def _profile(spans, inputs=100, forward_s=1.0):
    g = GroupProfile("0", spans=tuple(spans), kept=0, inputs=inputs, forward_s=forward_s, backward_s=2 * forward_s,
                     forward_extra=sum(spans), grads=7)
    return Profile((g,), base=1000, outside_s=0.1, d2h_bps=1e9, h2d_bps=1e9, outside_extra=50)


@pytest.mark.parametrize("linear, square", [(100, 0), (0, 1), (100, 1), (3, 5)])
@pytest.mark.parametrize("t_new", [32, 100, 300])
def test_prediction_bounds_bytes_that_grow_linearly_and_with_the_square(linear, square, t_new):
    """From one profile: the bound (square up, linear down) is never below the true bytes, for
    any mix of a part linear in the tokens and a part with their square (scores); scaled down, the
    true bytes are no less than the least share of the bound that is still the workload predicted."""
    t_ref = 64

    def true(t):
        return linear * t + square * t * t

    p = predict.predicted(_profile([true(t_ref)]), t_ref, t_new, base=0)
    g = p.groups[0]
    assert g.offloadable >= true(t_new) and g.forward_extra >= true(t_new)
    if t_new < t_ref:  # down to the least share that is still the workload predicted
        assert true(t_new) >= predict.least_shares(_profile([true(t_ref)]), t_ref, t_new)[0] * g.offloadable - 1
    assert g.forward_s == pytest.approx(t_new / t_ref) and g.grads == 7  # times linear, gradients fixed
    assert p.base == 1000  # the larger of the profiled base and the step's


def test_prediction_says_how_far_under_its_bytes_a_group_may_save_and_be_the_workload():
    """Scaled down from one profile, bytes down to the ratio of tokens times the bound (the bytes'
    square part shrinks faster); fitted from two profiles, or scaled up, none beyond the
    tolerance (a group off by more is profiled)."""
    assert doctest.testmod(predict).failed == 0
    one = _profile([100 * 64 + 64 * 64])
    assert predict.least_shares(one, 64, 48) == (0.75,)
    assert predict.least_shares(one, 64, 128) == (1.0,)
    two = (_profile([100 * 32 + 32 * 32]), 32)  # the same a t + b t^2: the fit is exact
    assert predict.least_shares(one, 64, 48, two) == (1.0,)
    odd = (_profile([100 * 64 + 64 * 64 + 10_000]), 32)  # more bytes at fewer tokens: no fit, the bound
    assert predict.least_shares(one, 64, 48, odd) == (0.75,)


@pytest.mark.parametrize("t_new, host", [(16, 0.25), (32, 0.25), (128, 0.5), (256, 1.0)])
def test_prediction_keeps_the_hosts_time_at_fewer_tokens_and_scales_it_at_more(t_new, host):
    """The host's time to issue a group's ops does not shrink with the tokens (on an H200 no
    offloading and checkpointing issued the loop decoder's 1024-, 1536- and 2048-token steps in
    the same host time); where it holds waits on the device it grows with them: the bound."""
    g = dataclasses.replace(_profile([6400]).groups[0], host_s=0.25, recompute_host_s=0.125,
                            dispatch_host_s=(0.5, 0.125))
    p = predict.predicted(Profile((g,), base=0, outside_s=0.1, d2h_bps=1e9, h2d_bps=1e9), 64, t_new, base=0)
    assert p.groups[0].forward_s == pytest.approx(t_new / 64)  # the device's time scales
    assert p.groups[0].host_s == pytest.approx(host)
    assert p.groups[0].recompute_host_s == pytest.approx(host / 2)
    assert p.groups[0].dispatch_host_s == pytest.approx((2 * host, host / 2))


@pytest.mark.parametrize("linear, square", [(100, 0), (0, 1), (100, 1)])
def test_prediction_fits_each_groups_bytes_from_two_profiles(linear, square):
    def true(t):
        return linear * t + square * t * t

    p = predict.predicted(_profile([true(128)]), 128, 96, base=0, other=(_profile([true(64)]), 64))
    got = p.groups[0].offloadable
    assert true(96) <= got <= true(96) * (1 + predict.FIT_SLACK) + 1


def test_prediction_falls_back_to_the_bound_where_bytes_do_not_follow_the_model():
    # a constant part (bytes that do not grow with the tokens): the fit would go below zero
    p = predict.predicted(_profile([1000 + 64]), 64, 32, base=0, other=(_profile([1000 + 128]), 128))
    assert p.groups[0].offloadable == 532  # the bound: half (linear down), not the fit
    # (the bound itself assumes no such part: documented; the measured check still applies)


# ---------------------------------------------------------------- micro-batches and evaluation
def test_accumulation_with_an_evaluation_forward_every_five_steps_profiles_once():
    """Four micro-batches' forwards, one backward; every fifth step an evaluation forward (no_grad,
    eval()) before it: profiled once, then its plan at every step."""
    blocks = _blocks()
    budget = 6 * _bytes(32)
    expected = []
    for step in range(12):
        expected.append(_step(blocks, 32, step, forwards=4))
    off = ao.Offloader(device="cpu", memory_budget=budget, min_offload_bytes=0)
    states, got, actions = [], [], set()
    with ao.wrap(blocks, off):
        for step in range(12):
            if step % 5 == 4:
                blocks.eval()
                with torch.no_grad():
                    h = torch.randn(48, D)
                    for b in blocks:
                        h = h + b(h)
                blocks.train()
            got.append(_step(blocks, 32, step, forwards=4))
            plan = off.stats()["plan"]
            states.append(plan["state"])
            if step >= PROFILE_STEPS:
                actions.add(tuple(g["action"] for g in plan["groups"]))
                assert plan["workload"]["groups"] == 16  # 4 micro-batches of 4 groups: one workload
                assert plan["predicted_peak_bytes"] <= budget
    assert states == ["profiling"] * PROFILE_STEPS + ["settled"] * (12 - PROFILE_STEPS)
    assert len(actions) == 1 and len(off.plan.workloads.workloads) == 1
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


def test_a_forward_under_no_grad_between_steps_opens_no_group_and_no_step():
    blocks = _blocks()
    off = ao.Offloader(device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 2):
            with torch.no_grad():
                h = torch.randn(80, D)
                for b in blocks:
                    h = h + b(h)
            _step(blocks, 64, step)
    plan = off.stats()["plan"]
    assert plan["state"] == "settled" and plan["workload"]["tokens"] == 64
    assert len(off.plan.workloads.workloads) == 1


def test_a_step_with_another_micro_batch_count_runs_and_does_not_disturb_the_plan():
    """An extra forward with gradients before one backward (an evaluation without no_grad): its
    groups move all they can; the workload of four groups keeps its plan, unprofiled again."""
    blocks = _blocks()
    off = ao.Offloader(device="cpu", memory_budget=1 << 40, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            _step(blocks, 64, step)
        _step(blocks, 64, 9, forwards=2)
        states = []
        for step in range(2):
            _step(blocks, 64, step)
            states.append(off.stats()["plan"]["state"])
    assert states == ["settled", "settled"]


@pytest.mark.parametrize("turns", [(1, 2), (1, 1, 2), (1, 2, 2)])
def test_steps_taking_turns_at_forwards_per_backward_each_run_their_own_plan(turns):
    """Steps of one signature opening different numbers of groups by turns (one forward, then two
    before one backward; R8: several forwards in flight): each finds its own workload once the
    turns have recurred, so that the heavier step runs its own plan rather than the lighter one's
    with its groups past the plan, and every step settles; gradients bitwise."""
    blocks, expected = _blocks(), _blocks()
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(64), min_offload_bytes=0)
    ran = []
    with ao.wrap(blocks, off):
        for i in range(27):
            n = turns[i % len(turns)]
            for a, b in zip(_step(blocks, 64, i, n), _step(expected, 64, i, n)):
                assert_bitwise(a, b)
            plan = off.stats()["plan"]
            ran.append((n, plan["state"], len(plan.get("groups") or ())))
    late = ran[-4 * len(turns):]
    assert all(state == "settled" and groups == 4 * n for n, state, groups in late), ran


# ---------------------------------------------------------------- a share of the device's memory
def test_budget_shares_parse_and_resolve():
    assert parse_memory_budget("memory_budget", "auto") == "auto"
    assert parse_memory_budget("memory_budget", "90%") == "90%"
    assert parse_memory_budget("memory_budget", "2GiB") == 2 << 30
    for bad in ["0%", "150%", "lots%", "-1%"]:
        with pytest.raises(ValueError, match="memory_budget .* share of the device's memory"):
            parse_memory_budget("memory_budget", bad)
    with pytest.raises(ValueError, match="memory_budget 'lots' is not a size.*'auto' or a percentage"):
        parse_memory_budget("memory_budget", "lots")
    total = 80 << 30
    assert budget_of("memory_budget", "auto", total, 3 << 30) == int(AUTO_FRACTION * total) - (3 << 30)
    assert budget_of("memory_budget", "50%", total, 0) == 40 << 30
    assert budget_of("memory_budget", 1 << 30, total, 79 << 30) == 1 << 30  # bytes stand as given
    with pytest.raises(ValueError, match="memory_budget='10%' leaves nothing: 10% of the device's .* are held "
                                         "outside this process's allocator .* or free the device"):
        budget_of("memory_budget", "10%", total, 9 << 30)
    # a share that rounds to nothing, where nothing is held outside (the CPU): said as given, and
    # without the holders outside the allocator that there are none of
    with pytest.raises(ValueError, match=r"memory_budget='1e-300%' leaves nothing: 1e-300% of the device's "
                                         r"85,899,345,920 bytes is 0; give a larger share or a size in bytes$"):
        budget_of("memory_budget", "1e-300%", total, 0)
    # one that leaves nothing of all the device's memory is said as the offloader is made
    with pytest.raises(ValueError, match=r"memory_budget='1e-30%' leaves nothing: 1e-30% of the device's [0-9,]+ "
                                         r"bytes is 0; give a larger share or a size in bytes$"):
        ao.Offloader(impl="fast", device="cpu", memory_budget="1e-30%")


def test_a_share_of_memory_is_read_at_the_first_step_through_the_probe(monkeypatch):
    from actoffload.budget.probe import Probe

    reads = []

    def totals(self):
        reads.append(1)
        return 1 << 30, 1 << 26

    monkeypatch.setattr(Probe, "memory_totals", totals)
    off = ao.Offloader(device="cpu", memory_budget="50%", min_offload_bytes=0)
    assert off.memory_budget == "50%" and off.stats()["plan"]["memory_budget"] is None and not reads
    blocks = _blocks()
    plans = _run(off, blocks, [64] * (PROFILE_STEPS + 1))
    assert reads == [1]
    assert plans[-1]["memory_budget"] == (1 << 29) - (1 << 26)
    assert plans[-1]["memory_budget_setting"] == "50%" and plans[-1]["state"] == "settled"


def test_auto_on_the_cpu_is_a_share_of_the_machines_memory():
    off = ao.Offloader(device="cpu", memory_budget="auto", min_offload_bytes=0)
    plans = _run(off, _blocks(), [64] * (PROFILE_STEPS + 1))
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert plans[-1]["memory_budget"] == int(AUTO_FRACTION * ram)
    assert [g["action"] for g in plans[-1]["groups"]] == ["keep"] * 4


def _accumulation(monkeypatch, off, state_after_first=False, steps=5):
    """``steps`` optimizer steps of four micro-batches, each with its backward, zero_grad(set_to_none)
    before each, the blocks wrapped by ``off`` (``None``: plain). The CPU reads no allocator: the
    probe here counts the gradients as a GPU's would, and, ``state_after_first``, an optimizer's
    state from the second optimizer step on. Each micro-batch's plan state, and each optimizer
    step's gradients."""
    from actoffload.budget.probe import Probe

    blocks = _blocks()
    state = {"bytes": 0}
    monkeypatch.setattr(Probe, "allocated", lambda self: state["bytes"] + sum(
        p.grad.nbytes for p in blocks.parameters() if p.grad is not None))
    states, grads = [], []
    with contextlib.ExitStack() as stack:
        if off is not None:
            stack.enter_context(ao.wrap(blocks, off))
        for step in range(steps):
            blocks.zero_grad(set_to_none=True)
            for k in range(4):
                x = torch.randn(32, D, generator=torch.Generator().manual_seed(step * 4 + k), requires_grad=True)
                h = x * 1
                for b in blocks:
                    h = h + b(h)
                h.square().sum().backward()
                states.append(off.stats()["plan"]["state"] if off is not None else None)
            grads.append([p.grad.clone() for p in blocks.parameters()])
            if state_after_first:
                state["bytes"] = 2 * sum(p.nbytes for p in blocks.parameters())
    return states, grads


def test_accumulation_with_a_backward_per_micro_batch_has_two_bases_each_profiled_once(monkeypatch):
    """zero_grad(set_to_none) then four micro-batches, each with its backward: the first begins
    with no gradients allocated, the others with them (the base moves by their bytes). On a GPU
    that re-profiled at every flip; now each base is a workload. The first micro-batch's step,
    taken by the profiling of the next ones' and let go as another base's, plans its own
    workload: two profiling steps in all."""
    off = ao.Offloader(device="cpu", memory_budget="64MiB", min_offload_bytes=0)
    states, _ = _accumulation(monkeypatch, off)
    assert len(off.plan.workloads.workloads) == 2
    assert states.count("profiling") == PROFILE_STEPS
    assert states[-8:] == ["settled"] * 8


def test_accumulation_with_optimizer_state_profiles_its_first_micro_batch_once_after_the_state_appears(monkeypatch):
    """As above, with optimizer state made after the first optimizer step (a third and fourth
    base): the first micro-batch of the second optimizer step is taken by the profiling of the
    next micro-batches' new workload and let go; its own workload is planned from that step, so
    it profiles once, not three times (what the loop sweep's accumulation showed on an H200), and
    every micro-batch from the third optimizer step on runs a plan; bitwise (R1)."""
    _, expected = _accumulation(monkeypatch, None, state_after_first=True)
    off = ao.Offloader(device="cpu", memory_budget="64MiB", min_offload_bytes=0)
    states, grads = _accumulation(monkeypatch, off, state_after_first=True)
    for a, b in zip(grads, expected):
        assert_bitwise(a, b)
    first = states[::4]  # each optimizer step's first micro-batch
    assert first[:2] == ["profiling"] * 2 and "profiling" not in first[2:]
    assert states.count("profiling") == 2 * PROFILE_STEPS and "profiling" not in states[8:]


def test_a_length_after_the_first_profile_is_predicted_from_its_first_step():
    """The last profiling step's measurements become the profile when the next step begins,
    whatever its workload, so a length that comes next, before the profiled one comes again,
    runs a plan predicted from it: no profiling of its own."""
    off = ao.Offloader(device="cpu", memory_budget=4 * _bytes(128), min_offload_bytes=0)
    plans = _run(off, _blocks(), [128] * PROFILE_STEPS + [64, 96, 64])
    for p in plans[PROFILE_STEPS:]:
        assert p["workload"]["predicted_from"] == f"[128, {D}] torch.float32 cpu" and p["state"] == "settled"


def test_a_step_of_one_backward_per_micro_batch_is_profiled_whole():
    """Two micro-batches' forwards, then one backward call each (as a pipeline stage runs
    GPipe): the profile is made when the next step begins, so every group's backward counts,
    the second micro-batch's as well as the first's."""
    blocks = _blocks(2)
    off = ao.Offloader(device="cpu", memory_budget=1 << 30, min_offload_bytes=0)
    with ao.wrap(blocks, off):
        for step in range(PROFILE_STEPS + 1):
            losses = []
            for k in range(2):
                h = torch.randn(32, D, generator=torch.Generator().manual_seed(2 * step + k))
                for b in blocks:
                    h = h + b(h)
                losses.append(h.square().mean())
            for loss in losses:
                loss.backward()
    groups = off.stats()["plan"]["profile"]["groups"]
    assert len(groups) == 4 and all(g["reached"] for g in groups)


def test_a_predicted_workload_whose_bytes_are_off_is_profiled_and_says_so():
    """Scaled up, a prediction bounds the bytes by the square of the ratio: twice the rows of a
    linear model save half the bound, beyond the workload tolerance, so the workload is profiled
    after all (where its plan moves bytes; one keeping everything has nothing to gain); its stats
    then name no workload it was predicted from."""
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(128), min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [64] * (PROFILE_STEPS + 1))
    plans = _run(off, blocks, [128] * (PROFILE_STEPS + 3))
    assert plans[0]["workload"]["predicted_from"] == f"[64, {D}] torch.float32 cpu"
    assert "profiling" in [p["state"] for p in plans]
    assert plans[-1]["state"] == "settled" and plans[-1]["workload"]["predicted_from"] is None
    assert [sum(g["spans"]) + g["kept"] for g in plans[-1]["profile"]["groups"]] == [_bytes(128)] * 4


def test_a_predicted_workload_searches_only_the_copy_window_its_source_settled_on():
    """The search's paths of a predicted workload keep the window the workload it was predicted
    from settled on (the hand-written plans keep theirs): a quarter of the planning's host time."""
    off = ao.Offloader(device="cpu", memory_budget=3 * _bytes(128), min_offload_bytes=0)
    blocks = _blocks()
    _run(off, blocks, [128] * (PROFILE_STEPS + 1) + [64])
    source, predicted = (w.controller for w in off.plan.workloads.workloads)
    assert predicted.predicted and not source.predicted and source.settled
    window = (source.plan.max_inflight, source.plan.prefetch)
    families = {(0, 0), (1, 1), (2, 2)}
    assert {(p.max_inflight, p.prefetch) for p in predicted.plans} <= {window} | families
    assert len(predicted.plans) < len(source.plans)


class _Noise(torch.nn.Module):
    """Multiplicative noise in training (its product saves both factors, about half of what a
    block saves), none in evaluation."""

    def forward(self, x):
        return x * (1 + 0.1 * torch.randn_like(x)) if self.training else x


@pytest.mark.parametrize("switch", ["eval", "autocast"])
def test_steps_of_one_shape_in_two_modes_are_two_workloads_each_profiled_once(switch):
    """An adversarial perturbation's forward and backward in evaluation mode (here a block
    saves about half as much) before each training step, or steps alternating with and without
    autocast: one shape, other saves. Each mode is a workload of its own, profiled once, then
    settled; as one signature, whose saves changed by more than 10% at every step, they
    re-profiled at every other step, never settling."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), _Noise(),
                                                     torch.nn.Linear(H, D)) for _ in range(3))
    off = ao.Offloader(device="cpu", memory_budget=3 * 32 * (D + 4 * H) * 4, min_offload_bytes=0)
    states = {}
    with ao.wrap(blocks, off):
        for step in range(12):
            other = step % 2 == 0
            blocks.train(not (other and switch == "eval"))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=other and switch == "autocast"):
                _step(blocks, 32, step)
            plan = off.stats()["plan"]
            states.setdefault(plan["workload"]["signature"], []).append(plan["state"])
    assert len(states) == 2, states
    for signature, seen in states.items():
        assert seen == ["profiling"] * PROFILE_STEPS + ["settled"] * (6 - PROFILE_STEPS), (signature, seen)
    assert any(s.endswith("(eval)" if switch == "eval" else "(autocast torch.bfloat16)") for s in states)
