"""benchmarks/first_step_shares.py reads a plan's first steps out of loop sweeps' results."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import first_step_shares  # noqa: E402

GiB = 1 << 30


def _doc(loop: str, steps: list[tuple[int, int, dict]]) -> dict:
    cell = {"budget_bytes": 10 * GiB, "plan_steps": [p for _, _, p in steps]}
    if loop == "variable_length":
        cell["reserved_bytes"], cell["allocated_bytes"] = [r for r, _, _ in steps], [a for _, a, _ in steps]
    else:  # an optimizer step between the micro-batches runs no plan
        cell["records"] = [{"kind": "micro", "reserved_bytes": r, "allocated_bytes": a} for r, a, _ in steps[:1]]
        cell["records"] += [{"kind": "optimizer", "reserved_bytes": 0, "allocated_bytes": 0}]
        cell["records"] += [{"kind": "micro", "reserved_bytes": r, "allocated_bytes": a} for r, a, _ in steps[1:]]
    return {"workloads": [{loop: {"budgets": [cell, {"skipped": "no budget"}]}}]}


def _plan(state: str, ran: tuple, reserve: int, tokens: int = 8192) -> dict:
    return {"state": state, "ran": list(ran), "allocator_reserve_bytes": reserve, "tokens": tokens}


def test_each_plans_first_step_after_profiling_counts_once_against_the_reserve_before_it():
    for loop in ("variable_length", "accumulation"):
        # (reserved, allocated, the plan's record after the step: the reserve is the next one's "before")
        steps = [(6 * GiB, 4 * GiB, _plan("profiling", (), GiB)),  # profiling: no plan of its own
                 (11 * GiB, 8 * GiB, _plan("exploring", ("keep", "recompute"), 3 * GiB)),  # first: 3/1, room 2/1
                 (11 * GiB, 8 * GiB, _plan("exploring", ("keep", "recompute"), 3 * GiB)),  # again: not first
                 (10 * GiB, 9 * GiB, _plan("settled", ("keep", "keep"), 3 * GiB)),  # first: 1/3, room 1/3
                 (10 * GiB, 9 * GiB, _plan("settled", ("keep", "keep"), 3 * GiB, tokens=4096))]  # another length
        rows = list(first_step_shares.first_steps(_doc(loop, steps)))
        # these records name no reasons for giving the cache back: where each began is not known
        assert rows == [(3.0, 2.0, True, None), (1 / 3, 1 / 3, False, None), (1 / 3, 1 / 3, False, None)], loop


def test_a_first_step_began_on_a_cache_given_back_as_it_began_or_as_the_step_before_went_over():
    def plan(ran: tuple, trims: dict, tokens: int = 8192) -> dict:
        return {**_plan("exploring", ran, GiB, tokens), "cache_trims_by": trims}

    steps = [(6 * GiB, 4 * GiB, {**_plan("profiling", (), GiB), "cache_trims_by": {"first": 1}}),
             (9 * GiB, 8 * GiB, plan(("keep", "recompute"), {"first": 1})),  # on the profiling's cache
             (11 * GiB, 8 * GiB, plan(("keep", "keep"), {"first": 1, "plan changed": 1})),  # over; given back as it ends
             (9 * GiB, 8 * GiB, plan(("recompute", "keep"), {"first": 1, "plan changed": 1})),  # so: on a cache given back
             (9 * GiB, 8 * GiB, plan(("recompute", "recompute"), {"first": 1, "plan changed": 1})),  # on its cache
             (9 * GiB, 8 * GiB, plan(("keep", "recompute"), {"first": 1, "plan changed": 1, "outgrown": 1}, 4096))]
    rows = list(first_step_shares.first_steps(_doc("variable_length", steps)))
    assert [(over, fresh) for _, _, over, fresh in rows] == [(False, False), (True, False), (False, True),
                                                             (False, False), (False, True)]


def test_the_committed_sweeps_are_read(capsys):
    assert first_step_shares.main([]) == 0
    out = capsys.readouterr().out
    assert "first steps of a plan after profiling" in out and "room under 1.2x the reserve" in out
    assert "on a cache given back just before it:" in out and "on a cache other steps built:" in out
