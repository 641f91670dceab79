"""The diagnostics under benchmarks/ that benchmarks/README.md cites run on the CPU (their tiny
models): a probe the library outgrew (a helper renamed, a module moved) fails here, not on the
GPU machine in the middle of a session. Whether their figures mean anything is the GPU's to say."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBES = [
    ["attention_kept_probe.py", "--device", "cpu", "--rounds", "1", "--steps", "1"],
    ["forced_plans_model_probe.py", "--device", "cpu", "--steps", "1"],
    ["first_steps_probe.py", "--device", "cpu", "--steps", "3", "--cprofile", "0", "--budget-gib", "0.001", "--compare"],
    ["host_diff_probe.py", "--device", "cpu"],
    ["least_memory_probe.py", "--device", "cpu", "--steps", "2", "--budget-gib", "0.001"],
    ["loop_keep_probe.py", "--device", "cpu", "--budget", "1000000"],
    ["recompute_host_probe.py", "--device", "cpu", "--rounds", "1", "--steps", "1", "--no-profile"],
    ["recompute_pace_probe.py", "--device", "cpu", "--budget-gib", "0.0004", "--steps", "6"],
    ["skipped_batch_probe.py", "--device", "cpu"],
    ["whole_vs_checkpoint_probe.py", "--device", "cpu", "--steps", "2", "--cprofile", "0"],
]


@pytest.mark.parametrize("argv", PROBES, ids=[a[0] for a in PROBES])
def test_probe_runs_on_the_cpu(argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
