"""Whether a change to the planner kept every plan and every choice: the search's candidates
(each plan's decisions, copy window, modelled peak and time to the last bit), its improvement
within a grid of limits, its quick search and its choice at budgets from below the least
reachable peak to keeping everything, for a corpus of profiles; dumped by one tree, compared
with another's dump. A diagnostic for work on ``actoffload/budget/search.py`` and
``costmodel.py``, whose speed-ups must change no result (docs/budgets.md, "What planning
costs"); asserts nothing itself.

The corpus: ``benchmarks/bench_planning.py``'s synthetic profiles (3 to 384 groups, with and
without parts and costly ops), small random ones (costly ops and attention, ``min_move``, host
pace, modules of parts, a bus from 10^2 to 10^12 bytes/s), ones of identical groups (scores
tied), and every ``--every``-th profile recorded in ``benchmarks/results``. ``--quick``: a
small corpus, a minute or so. ``dump --processes 3``: the search side by side in three
processes (to compare with a dump of one).

    git worktree add /tmp/before <rev>
    (cd /tmp/before && PYTHONPATH=. python /path/to/benchmarks/planning_equivalence.py dump /tmp/a.json.gz)
    PYTHONPATH=. python benchmarks/planning_equivalence.py dump /tmp/b.json.gz
    python benchmarks/planning_equivalence.py compare /tmp/a.json.gz /tmp/b.json.gz
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import actoffload
from actoffload.budget import search
from actoffload.budget.costmodel import GroupProfile, MemoryPlan, Profile, Whole
from actoffload.tools.provenance import read_results, write_results

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_planning import synthetic  # noqa: E402  (beside this file)
from settle_replay import profile_of  # noqa: E402

Case = tuple[str, Callable[[], Profile]]


def _plans(plans: list[MemoryPlan]) -> list[list[Any]]:
    """Each plan as its decisions' digest, copy window, peak and time (``float.hex``: every bit)."""
    out = []
    for p in plans:
        decisions = "|".join(f"{d.action.value}:{d.fraction!r}" for d in p.groups)
        digest = hashlib.blake2b(decisions.encode(), digest_size=10).hexdigest()
        out.append([digest, p.max_inflight, p.prefetch, p.peak, float(p.step_s).hex()])
    return out


def _choice(profile: Profile, budget: int, plans: list[MemoryPlan]) -> Any:
    try:
        return _plans([search.choose(profile, budget, plans)])[0]
    except search.BudgetTooSmall as e:
        return ["too small", str(e)]


def measured(profile: Profile, grid: int = 10, processes: int = 1) -> dict[str, Any]:
    """What the planner makes of ``profile``: candidates, improvements, quick search, choices
    (the whole search in up to ``processes`` processes).

    Example::

        record = measured(synthetic(24))   # comparable with a record made by another tree
    """
    plans = search.candidates(profile, processes=processes)
    least, most = min(p.peak for p in plans), max(p.peak for p in plans)
    limits = sorted({least - 1, least, plans[0].peak} | {least + (most - least) * k // grid for k in range(grid + 1)})
    improved = []
    for limit in limits:
        within = [p for p in plans if p.peak <= limit]
        if within:
            best = min(within, key=lambda p: p.step_s)
            improved.append(_plans([search.improved_within(profile, best, limit)]))
    return {
        "candidates": _plans(plans),
        "improved": improved,
        "with_limits": _plans(search.candidates(profile, limits=limits[-2:], processes=processes)),
        "quick": _plans(search.quick_candidates(profile)),
        "quick_one_window": _plans(search.quick_candidates(profile, (0, 0))),
        "choices": [_choice(profile, b, plans) for b in sorted({least - 1, plans[0].peak, plans[0].peak + 1}
                                                               | {least + (most - least) * k // 40 for k in range(41)})],
    }


def _random(seed: int) -> Profile:
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    groups = []
    for i in range(n):
        fwd = rng.uniform(1e-4, 20e-3)
        inputs = None if rng.random() < 0.2 else rng.randint(0, 16) * MiB
        costly = attention = None
        if inputs is not None and rng.random() < 0.5:
            costly = tuple(sorted((rng.randint(1, 32) * MiB for _ in range(rng.randint(1, 4))), reverse=True))
            attention = (rng.randint(1, 16) * MiB,) if rng.random() < 0.7 else None
        groups.append(GroupProfile(
            str(i), spans=tuple(sorted((rng.randint(1, 64) * MiB for _ in range(rng.randint(0, 5))), reverse=True)),
            kept=rng.randint(0, 4) * MiB, inputs=inputs, forward_s=fwd, backward_s=fwd * rng.uniform(1, 3),
            forward_extra=rng.randint(0, 32) * MiB, backward_extra=rng.randint(0, 64) * MiB,
            grads=rng.randint(0, 8) * MiB, recompute_extra=rng.randint(0, 16) * MiB,
            recompute_s=fwd * rng.uniform(0.2, 1.0) if rng.random() < 0.5 else None,
            host_s=fwd * rng.uniform(0.5, 1.5) if rng.random() < 0.3 else None,
            costly=costly, costly_share=rng.uniform(0, 0.9) if costly else None,
            costly_calls=len(costly) if costly else None, attention=attention,
            attention_share=rng.choice([0.0, rng.uniform(0, 0.5)]) if attention else None,
            min_move=rng.choice([0, 0, 2 * MiB, 8 * MiB])))
    wholes, i = [], 0
    while rng.random() < 0.5 and i < n:
        k = min(rng.randint(1, 3), n - i)
        wholes.append(Whole(i, k, inputs=rng.randint(0, 16) * MiB))
        i += k + rng.randint(0, 1)
    bus = 10 ** rng.uniform(2, 12)
    return Profile(tuple(groups), base=rng.randint(0, 2048) * MiB, outside_s=rng.uniform(0, 5e-3), d2h_bps=bus,
                   h2d_bps=bus * rng.uniform(0.5, 2.0), outside_extra=rng.randint(0, 64) * MiB, wholes=tuple(wholes))


def _identical(seed: int) -> Profile:
    g = GroupProfile("g", spans=(32 * MiB, 16 * MiB, 4 * MiB), kept=MiB, inputs=8 * MiB, forward_s=2e-3,
                     backward_s=4e-3, forward_extra=32 * MiB, backward_extra=16 * MiB, grads=4 * MiB,
                     recompute_extra=8 * MiB, recompute_s=1.6e-3, costly=(16 * MiB, 8 * MiB) if seed % 2 else None,
                     costly_share=0.5 if seed % 2 else None)
    n = random.Random(seed).randint(2, 40)
    bus = [1e2, 1e6, 1e9, 25e9, 1e12][seed % 5]
    wholes = tuple(Whole(i, 3, 8 * MiB) for i in range(0, n - 2, 3)) if seed % 3 == 0 else ()
    return Profile(tuple(replace(g, name=str(i)) for i in range(n)), base=1 << 30, outside_s=1e-3, d2h_bps=bus,
                   h2d_bps=bus, outside_extra=64 * MiB, wholes=wholes)


def _recorded(every: int) -> Iterator[Case]:
    """Every ``every``-th distinct profile in the recorded budget and loop sweeps."""
    root = os.path.join(HERE, "results")
    files = sorted(glob.glob(os.path.join(root, "*budget-sweep*.json"))
                   + glob.glob(os.path.join(root, "*loop-sweep*.json.gz")))
    seen: set[str] = set()

    def walk(x: Any) -> Iterator[dict[str, Any]]:
        if isinstance(x, dict):
            if {"groups", "base", "outside_s", "d2h_bps"} <= x.keys() and all(isinstance(g, dict) for g in x["groups"]):
                yield x
                return
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)

    k = 0
    for f in files:
        for d in walk(read_results(f)):
            key = json.dumps(d, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            try:  # (an early result's profile may lack fields a profile now has)
                profile = profile_of(d)
            except (TypeError, KeyError):
                continue
            k += 1
            if k % every == 0:
                yield f"recorded-{k}", (lambda profile=profile: profile)


def corpus(quick: bool, every: int) -> Iterator[Case]:
    sizes = (3, 5, 8, 13, 24) if quick else (3, 5, 8, 13, 24, 48, 96, 128, 192, 384)
    for n in sizes:
        for parts in (False, True):
            for selective in (False, True):
                yield f"synthetic-{n}-{parts:d}{selective:d}", (lambda n=n, p=parts, s=selective: synthetic(n, p, 0, s))
    for seed in range(30 if quick else 300):
        yield f"random-{seed}", (lambda seed=seed: _random(seed))
    for seed in range(5 if quick else 30):
        yield f"identical-{seed}", (lambda seed=seed: _identical(seed))
    yield from _recorded(every * (10 if quick else 1))


def dump(path: str, quick: bool, every: int, processes: int = 1) -> int:
    start, out = time.perf_counter(), {}
    for name, make in corpus(quick, every):
        out[name] = measured(make(), processes=processes)
    write_results(path, {"tree": os.path.dirname(actoffload.__path__[0]), "cases": out})
    print(f"{len(out)} profiles in {time.perf_counter() - start:.0f} s: {path}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    a, b = (read_results(p)["cases"] for p in (a_path, b_path))
    if a.keys() != b.keys():
        print(f"the corpora differ: {len(a)} and {len(b)} profiles; dump both with the same options")
        return 2
    differ = [name for name in a if a[name] != b[name]]
    for name in differ[:20]:
        field = next(k for k in a[name] if a[name][k] != b[name].get(k))
        print(f"differs: {name} ({field})")
    plans = sum(len(r["candidates"]) + len(r["with_limits"]) + len(r["quick"]) + len(r["quick_one_window"])
                + len(r["improved"]) for r in a.values())
    choices = sum(len(r["choices"]) for r in a.values())
    print(f"{len(a)} profiles, {plans} plans, {choices} choices: {len(differ)} differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dump", help="what this tree's planner makes of the corpus")
    d.add_argument("out", help="a .json.gz to write")
    d.add_argument("--quick", action="store_true", help="a small corpus")
    d.add_argument("--every", type=int, default=3, help="every how many recorded profiles one is taken")
    d.add_argument("--processes", type=int, default=1, help="search in up to this many processes side by side")
    c = sub.add_parser("compare", help="two dumps: every plan and choice the same?")
    c.add_argument("a")
    c.add_argument("b")
    a = p.parse_args(argv)
    return dump(a.out, a.quick, a.every, a.processes) if a.what == "dump" else compare(a.a, a.b)


if __name__ == "__main__":
    raise SystemExit(main())
