"""The distributed examples (examples/*.py), each run on the CPU: gloo, 2 processes, a tiny model.

Each test calls the example's ``run(argv)`` (it spawns the 2 ranks itself) and reads back
the results JSON it writes: the run succeeded, every rank's gradients and losses were
bitwise equal to the run without offloading, and the audit found only activations moved.
About 30 s in all on a 2-core machine, most of it the ranks importing torch.

    pytest tests/test_examples.py
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = ["--device", "cpu", "--nproc", "2", "--steps", "2", "--vocab", "64", "--seq-len", "16", "--d-model", "32",
        "--heads", "2", "--layers", "2", "--batch", "2"]


@pytest.fixture(scope="module", autouse=True)
def examples_importable():
    """The examples import their ``common`` module as a sibling; spawned ranks inherit sys.path."""
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


@pytest.fixture
def run_example(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """``run_example(name, argv) -> report``: runs it, asserts it succeeded (showing the ranks'
    output if not) and returns its results JSON."""

    def run(name: str, argv: list[str]) -> dict[str, Any]:
        out = tmp_path / f"{name}.json"
        code = importlib.import_module(name).run([*argv, "--out", str(out)])
        printed = "".join(capfd.readouterr())
        assert code == 0 and out.exists(), f"{name} exited {code}; its output ends:\n{printed[-4000:]}"
        return json.loads(out.read_text())

    return run


def offload_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [rank["modes"]["offload"] for rank in report["ranks"]]


def assert_bitwise_and_audited(report: dict[str, Any]) -> None:
    assert report["ok"], report["bitwise_equal_to_none"]
    assert report["world_size"] == 2
    for mode, per_rank in report["bitwise_equal_to_none"].items():
        assert per_rank == [True, True], mode
    for row in offload_rows(report):
        assert row["audit"]["ok"], row["audit"]["mismatches"]
        assert row["offloaded_bytes"][-1] > 0
        assert row["audit"]["offloaded_bytes"] == row["audit"]["activation_bytes"]


def test_fsdp2_offloads_activations_only_and_gradient_shards_are_bitwise_equal(run_example):
    # with a memory budget too: each rank plans its own (on a GPU every step's peak is checked)
    report = run_example("fsdp2", [*TINY, "--steps", "4", "--memory-budget", "256KiB"])
    assert_bitwise_and_audited(report)
    for row in offload_rows(report):
        # the unsharded weights each block's ops save were kept, every one of them
        assert row["audit"]["kept_parameter"] == row["audit"]["held_saves"] > 0
    assert report["bitwise_equal_to_none"]["budget"] == [True, True]
    for rank in report["ranks"]:
        budget = rank["modes"]["budget"]
        assert budget["impl"] == "fast" and budget["extra"]["budget"]["memory_budget"] == 256 << 10
        assert budget["extra"]["budget"]["state"] != "profiling"  # two steps profiled, then planned


def test_the_budget_mode_needs_a_budget_and_a_bad_one_fails_before_any_process_starts():
    import common

    args = common.parser("x").parse_args(["--device", "cpu", "--modes", "none,budget"])
    with pytest.raises(SystemExit, match="needs --memory-budget"):
        common.finish_args(args)
    args = common.parser("x").parse_args(["--device", "cpu", "--memory-budget", "lots"])
    with pytest.raises(SystemExit, match="is not a size"):
        common.finish_args(args)
    args = common.finish_args(common.parser("x").parse_args(["--device", "cpu", "--memory-budget", "auto"]))
    assert args.modes == ["none", "offload", "budget"]


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "0"], "--nproc: at least 1, got 0"),
    (["--steps", "1"], "--steps: at least 2 (the first is not timed), got 1"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 must be a multiple of --heads 4"),
    (["--out", "{tmp}"], "is a folder"),
    (["--out", "{tmp}/a-file/x.json"], "cannot make its folder"),
    (["--keep-last", "-1"], "--keep-last: at least 0, got -1"),
    (["--min-offload-bytes", "-5"], "--min-offload-bytes: at least 0, got -5"),
    pytest.param(["--out", "/proc/results.json"], "cannot write in '/proc'",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux's /proc takes no files")),
])
def test_bad_arguments_fail_before_any_process_starts(tmp_path, flags, message):
    """(They crashed inside the ranks, or after training: no median of no steps, a shape error,
    a folder that could not be made.)"""
    import common

    (tmp_path / "a-file").write_text("")
    args = common.parser("x").parse_args(["--device", "cpu"] + [f.replace("{tmp}", str(tmp_path)) for f in flags])
    with pytest.raises(SystemExit, match=re.escape(message)):
        common.finish_args(args)


@pytest.mark.parametrize("script, flags, message", [
    ("pipeline_parallel", ["--microbatches", "0"], "--microbatches: at least 1, got 0"),
    ("pipeline_parallel", ["--layers", "3"], "--layers (3) must be a multiple of 2 stages"),
    ("tensor_parallel", ["--heads", "3", "--d-model", "63"], "--heads (3) and --seq-len (32) must be multiples of 2"),
])
def test_a_scripts_own_arguments_fail_before_any_process_starts(script, flags, message, monkeypatch):
    """(They failed in every rank, after the processes started: a division by zero, a message
    printed once per rank.)"""
    monkeypatch.setattr(importlib.import_module("common"), "launch", lambda *a: pytest.fail("processes started"))
    with pytest.raises(SystemExit, match=re.escape(message)):
        importlib.import_module(script).run(["--device", "cpu"] + flags)


def test_ddp_offloads_activations_only_and_gradients_are_bitwise_equal_also_with_checkpointing(run_example):
    report = run_example("ddp", [*TINY, "--modes", "none,offload,checkpoint"])
    assert_bitwise_and_audited(report)
    assert report["bitwise_equal_to_none"]["checkpoint"] == [True, True]


def test_tensor_parallel_moves_dtensor_activations_by_local_shard_bitwise(run_example):
    report = run_example("tensor_parallel", TINY)
    assert_bitwise_and_audited(report)
    for row in offload_rows(report):
        # the residual stream between blocks is a sequence-sharded DTensor
        assert all(v.startswith("DTensor(Shard(dim=1),)") for v in row["extra"]["block_inputs"].values())


@pytest.mark.parametrize("schedule, layers", [("1f1b", 4), ("interleaved", 8)])  # 2 blocks per stage
def test_pipeline_groups_per_microbatch_reloaded_in_schedule_order_bitwise(run_example, schedule, layers):
    argv = [*TINY, "--layers", str(layers), "--batch", "4", "--microbatches", "4", "--schedule", schedule,
            "--impl", "fast"]  # fast counts its reloads: the test can see which micro-batch they went to
    report = run_example("pipeline_parallel", argv)
    assert_bitwise_and_audited(report)
    first_stage = report["ranks"][0]["modes"]["offload"]["extra"]
    assert first_stage["max_microbatches_in_flight"]["0"] >= 2  # 1F1B: several micro-batches in flight
    for rank in report["ranks"]:
        none, off = rank["modes"]["none"]["extra"], rank["modes"]["offload"]["extra"]
        assert off["order"] == none["order"]  # backwards in the schedule's order, offloaded or not
        assert off["checks"]["no reload for another micro-batch"]
        for mb in off["microbatches"]:
            assert mb["reloaded_bytes"] == mb["offloaded_bytes"]  # on the CPU no group is used in place


def test_bus_contention_says_it_needs_cuda_and_exits_0(capsys):
    if importlib.import_module("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the measurement would run (see examples/README.md)")
    assert importlib.import_module("bus_contention").run([]) == 0
    assert "needs CUDA" in capsys.readouterr().out
