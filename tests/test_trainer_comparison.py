"""benchmarks/trainer_comparison.py --small on the CPU: every method's code path, with the
libraries this environment has; a method that cannot run here is in the JSON with its reason."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "trainer_comparison.py"
sys.path.insert(0, str(SCRIPT.parent))
import trainer_comparison as tc  # noqa: E402

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_TRL = importlib.util.find_spec("trl") is not None
NOT_OK = {"unsupported", "unavailable", "skipped"}  # each with a reason; never "error"


def test_small_runs_every_method(tmp_path, capsys):
    out = tmp_path / "small.json"
    report = tc.main(["--small", "--out", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    methods = report["methods"]
    assert list(methods) == list(tc.METHODS)  # hf_checkpointing second: the budgets are measured on it
    assert report["env"]["isolation"] == "inprocess" and report["env"]["deterministic"]
    assert report["env"]["commit"] is None or isinstance(report["env"]["commit"], str)
    for name, r in methods.items():
        assert name in printed
        assert r["status"] == "ok" or (r["status"] in NOT_OK and r["reason"]), (name, r)
    if not HAVE_TRANSFORMERS:
        assert all(r["status"] == "unavailable" and "transformers" in r["reason"] for r in methods.values())
        return

    steps = tc.SMALL["steps"]
    always = ["none", "hf_checkpointing", "actoffload_checkpointing", "actoffload_budget",
              "actoffload_budget_1.25x", "none_repeat"]
    for name in always:
        r = methods[name]
        assert r["status"] == "ok", (name, r)
        assert len(r["losses"]) == len(r["step_s"]) == steps and r["median_step_s"] > 0
        assert r["timed_steps"] == steps - tc.SMALL["skip"]
        if name != "none":  # bitwise: the same losses and final weights as no offloading
            assert r["losses_equal_none"] and r["max_abs_loss_diff_vs_none"] == 0.0, name
            assert r["weights_equal_none"], name
        assert r["vs_hf_checkpointing"]["median_step_s"] > 0
    assert report["none_vs_none_bitwise"] is True
    assert methods["hf_checkpointing"]["checkpointed_layers"] == tc.SMALL["layers"]
    budget = report["config"]["budget_bytes"]  # on a GPU: checkpointing's measured peak
    assert budget == tc.CPU_BUDGET or torch.cuda.is_available()
    for name, factor in (("actoffload_budget", 1.0), ("actoffload_budget_1.25x", 1.25)):
        a = methods[name]["actoffload"]
        assert a["impl"] == "fast" and a["plan"]["memory_budget"] == int(budget * factor)
        if not torch.cuda.is_available():  # (on a GPU, 4 steps are too few to also time the plans)
            assert a["plan"]["settled"] and a["timed_steps_all_settled"]
    moved = methods["actoffload_checkpointing"]["actoffload"]["offloaded_bytes_last_step"]
    # (on a GPU the small model's checkpoint inputs are under the 1 MiB default: they stay)
    assert moved > 0 if not torch.cuda.is_available() else moved >= 0

    offload = methods["hf_checkpointing_offload"]  # transformers pins host memory: needs an accelerator
    assert offload["status"] in ("ok", "unsupported", "unavailable"), offload
    if offload["status"] == "unavailable":
        assert "pin" in offload["reason"]
    for name in ("trl_activation_offloading", "trl_activation_offloading_checkpointing"):
        r = methods[name]
        if not HAVE_TRL:
            assert r["status"] == "unavailable" and "does not import" in r["reason"], r
        else:  # TRL's offloading needs an accelerator: on the CPU it says so
            assert r["status"] == "ok" or (r["status"] == "unavailable" and "accelerator" in r["reason"]), r


def test_a_method_in_a_subprocess_without_datasets(tmp_path):
    """The GPU machine gets TRL's wheel alone: its activation offloading imports with no
    ``datasets`` (nor pyarrow), and each method runs in a subprocess of its own."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\nfor _n in ('datasets', 'pyarrow'):\n    sys.modules[_n] = None  # import fails\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(block), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "sub.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--isolation", "subprocess",
                           "--methods", "trl_activation_offloading", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["env"]["isolation"] == "subprocess"
    assert report["env"]["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    r = report["methods"]["trl_activation_offloading"]
    assert "trl_activation_offloading" in proc.stdout
    if not (HAVE_TRANSFORMERS and HAVE_TRL):
        assert r["status"] == "unavailable", r
    else:  # imported (no "does not import"); on the CPU its context then needs an accelerator
        assert r["status"] == "ok" or (r["status"] == "unavailable" and "accelerator" in r["reason"]), r
        assert "does not import" not in r.get("reason", "")


@pytest.mark.parametrize("argv", [["--methods", "nothing"]])
def test_unknown_methods_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        tc.main(["--small", "--out", str(tmp_path / "x.json"), *argv])
