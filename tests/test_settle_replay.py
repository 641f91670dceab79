"""benchmarks/settle_replay.py replays a committed GPU sweep's budget cell on the CPU."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import settle_replay  # noqa: E402

SWEEP = ROOT / "benchmarks/results/NVIDIA-H200-2026-11-29-9aa3e0b-budget-sweep-d4096.json"


@pytest.fixture
def cells():
    sweep = json.loads(SWEEP.read_text())
    return [b for b in sweep["workloads"][0]["budgets"] if b["method"] == "fast_budget"]


def test_a_cells_profile_is_read_back_whole(cells):
    stats = cells[1]["plan"]["profile"]
    profile = settle_replay.profile_of(stats)
    assert len(profile.groups) == len(stats["groups"]) == 12 and len(profile.wholes) == 4
    assert profile.groups[1].spans == tuple(stats["groups"][1]["spans"]) and profile.base == stats["base"]


def test_a_cell_replayed_settles_and_counts_its_profiling_steps(cells, monkeypatch):
    monkeypatch.setattr(settle_replay.ReplayProbe, "asynchronous", False)  # planning in this process: no helper to start
    steps = settle_replay.replay(cells[1], sleep=False)
    assert isinstance(steps, int) and settle_replay.PROFILE_STEPS < steps <= 10


def test_a_replay_whose_plans_pin_host_memory_in_their_first_step_still_settles(cells, monkeypatch):
    monkeypatch.setattr(settle_replay.ReplayProbe, "asynchronous", False)
    unpinned = settle_replay.replay(cells[1], sleep=False)
    pinned = settle_replay.replay(cells[1], sleep=False, pin=True)
    assert isinstance(pinned, int) and pinned >= unpinned  # a first step that pinned is not timed


def test_a_cell_of_an_older_sweep_says_why_it_cannot_be_replayed(cells):
    cell = dict(cells[1], plan={k: v for k, v in cells[1]["plan"].items() if k != "profile"})
    assert settle_replay.replay(cell, sleep=False).startswith("not replayable")
