"""The diagnostics under benchmarks/ that benchmarks/README.md cites run on the CPU (their tiny
models): a probe the library outgrew (a helper renamed, a module moved) fails here, not on the
GPU machine in the middle of a session. Whether their figures mean anything is the GPU's to say."""

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBES = [
    ["attention_kept_probe.py", "--device", "cpu", "--rounds", "1", "--steps", "1"],
    ["copy_overlap_probe.py", "--device", "cpu", "--steps", "1"],
    ["forced_plans_model_probe.py", "--device", "cpu", "--steps", "1"],
    ["first_steps_probe.py", "--device", "cpu", "--steps", "3", "--cprofile", "0", "--budget-gib", "0.001", "--compare"],
    ["host_diff_probe.py", "--device", "cpu"],
    ["idle_cache_probe.py", "--device", "cpu", "--name", "hf_llama_sdpa", "--steps", "1"],
    ["least_memory_probe.py", "--device", "cpu", "--steps", "2", "--budget-gib", "0.001"],
    ["loop_keep_probe.py", "--device", "cpu", "--budget", "1000000"],
    ["recompute_host_probe.py", "--device", "cpu", "--rounds", "1", "--steps", "1", "--no-profile"],
    ["recompute_pace_probe.py", "--device", "cpu", "--budget-gib", "0.0004", "--steps", "6"],
    ["skipped_batch_probe.py", "--device", "cpu"],
    ["whole_vs_checkpoint_probe.py", "--device", "cpu", "--steps", "2", "--cprofile", "0"],
]

# Each probe runs as its own program, in a process of its own (probes patch the library), but
# forked from one that imported what they import once: a fresh interpreter per probe spent about
# half of each probe's time importing torch and transformers again. It forks before running any
# op, so no thread of torch's is there to be lost.
_SERVER = r"""
import json, os, runpy, sys, traceback
import torch, transformers, actoffload, actoffload.tools.loop_sweep, actoffload.tools.budget_sweep
for line in sys.stdin:
    argv, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""

pytestmark = pytest.mark.xdist_group("probes")  # one worker, one server


@pytest.fixture(scope="session")
def probe_server():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    yield server
    server.stdin.close()
    server.wait(timeout=60)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probes are forked from one process")
@pytest.mark.parametrize("argv", PROBES, ids=[a[0] for a in PROBES])
def test_probe_runs_on_the_cpu(argv, probe_server, tmp_path):
    log = tmp_path / "probe.log"
    probe_server.stdin.write(json.dumps([[str(ROOT / "benchmarks" / argv[0]), *argv[1:]], str(log)]) + "\n")
    probe_server.stdin.flush()
    if not select.select([probe_server.stdout], [], [], 300)[0]:  # (one answer a line: nothing is buffered)
        probe_server.kill()
        pytest.fail(f"{argv[0]} ran past 300 s: " + log.read_text()[-4000:])
    answer = probe_server.stdout.readline()
    assert answer, "the probes' process ended"
    assert json.loads(answer) == 0, log.read_text()[-4000:]


def test_the_copy_overlap_probe_reads_a_gap_as_waited_or_launched_late():
    """Its report on a made-up timeline: compute idles twice, once while a reload runs with the
    next kernel already launched (waited), once with the next kernel launched after the gap
    began (the host behind)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import copy_overlap_probe as probe
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def kernel(ts, dur, corr, stream=7):
        return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
                "args": {"correlation": corr}}

    events = [kernel(0, 1000, 1), kernel(6000, 1000, 2), kernel(12000, 1000, 3), kernel(0, 50, 9, stream=20),
              launch(0, 1), launch(10, 2), launch(9000, 3),
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 1000, "dur": 5000,
               "args": {"stream": 30, "bytes": 5 * 10**9, "correlation": 4}}]
    report = probe.timeline({"traceEvents": events}, backward_at=500.0)
    assert "compute stream 7: 3.0 ms busy" in report
    assert "in (HtoD): 1 copies, 4.66 GiB, 5.0 ms, 1000.0 GB/s" in report
    assert "2 compute gaps of 1 ms or more, 10.0 ms in all; waited 5.0 ms, launched late 5.0 ms" in report
    assert "idle    5.0 ms, waited; out 0.0, in 5.0 ms meanwhile; next k2" in report
    assert "launched late; out 0.0, in 0.0 ms meanwhile; next k3" in report
    assert probe.merged([probe.Span(0, 2), probe.Span(1, 3), probe.Span(5, 6)]) == [probe.Span(0, 3), probe.Span(5, 6)]
