"""pytest entry point: a fixed seed subset per device, and the planted-bug proofs."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from conformance import bugs
from conformance.runner import compare, init_worker, minimize, settle
from conformance.scenario import Scenario, generate

CUDA = torch.cuda.is_available()
N_SEEDS = int(os.environ.get("CONFORMANCE_SEEDS", "300"))
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.fixture(scope="module", autouse=True)
def _scenario_process():
    init_worker()


@pytest.fixture(autouse=True)
def _settle():
    yield
    settle()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(N_SEEDS))
def test_fast_matches_ref_and_no_offloader(seed, device):
    s = generate(seed, device)
    problems = compare(s, "fast")
    if problems:
        small = minimize(s, "fast", budget=15)
        pytest.fail(
            f"seed {seed}: {s}\n  " + "\n  ".join(problems)
            + f"\n  minimal reproduction: python -m conformance --impl fast --scenario '{small.to_json()}'"
        )


def _targeted(device: str, **kw) -> list[Scenario]:
    """Scenarios aimed at the planted bugs: several groups of big enough saves, and one
    of every kind of saved tensor that once went wrong."""
    base = Scenario(seed=7, device=device, groups=[["gelu_mlp", "linear"], ["swiglu_mlp"], ["attention", "quantized"], ["grouped"]],
                    keep_last=1, prefetch=1, min_offload_bytes=0, width=64, seq=64, batch=4)
    kinds = Scenario(seed=8, device=device, groups=[["complex", "parameter_swap"], ["detached_weight", "wrapper_subclass"],
                                                    ["inplace_before_save"], ["gelu_mlp", "forward_ad", "nested"]],
                     keep_last=0, min_offload_bytes=0, width=32, seq=8, batch=2)
    return [
        replace(base, **kw),
        replace(base, pack_below=0, **kw),
        replace(base, marks={"0.0": "veto_before", "1.0": "veto_after", "2.0": "veto_after"}, **kw),
        replace(base, min_offload_bytes=1 << 30, **kw),  # nothing moves: multi-buffer wrappers still rebuilt
        replace(kinds, **kw),
        replace(kinds, use_wrap=True, in_except=True, same_names=True, **kw),
    ]


@pytest.mark.parametrize("groups,layer", [([["complex"]], "0.0"), ([["linear"], ["complex"]], "1.0")],
                         ids=["one_group", "behind_an_earlier_group"])
def test_R8_measured_once_pytorch_lets_go_of_a_failed_backward(groups, layer):
    """Seed 2852, minimized: R6 raises in a checkpointed layer whose output sums two branches.
    The branch already queued when the error came stays queued on this thread, holding the
    checkpoint's saved input (and the graph behind it) until the next backward: no leak."""
    s = Scenario(seed=2852, device="cpu", groups=groups, checkpoint=[layer], inplace_after_save=layer,
                 keep_last=0, min_offload_bytes=0, width=32, seq=8, batch=2)
    assert compare(s, "fast") == []


@pytest.mark.parametrize("bug", list(bugs.BUGS))
@pytest.mark.parametrize("device", DEVICES)
def test_planted_bug_is_caught(bug, device):
    patch, needs = bugs.BUGS[bug]
    if needs == "cuda" and device != "cuda":
        pytest.skip("a race between streams: only real CUDA streams can show it (CPU copies are synchronous)")
    delay = {"free_source_before_copy_done": "d2h", "use_reload_before_done": "h2d"}.get(bug)
    scenarios = _targeted(device, delay=delay) + [generate(seed, device) for seed in range(10)]
    for s in scenarios:
        assert not compare(s, "fast"), f"the unpatched fast fails: {s}"
    with patch():
        caught = [s for s in scenarios if compare(s, "fast")]
    assert caught, f"planted bug {bug!r} went unnoticed by every scenario"


def test_a_run_cut_short_by_max_seconds_reports_what_ran(tmp_path):
    """--max-seconds with several workers: the chunks not started are cancelled, the ones
    that ran are reported, and nothing is lost to the cancellation."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "conformance", "--device", "cpu", "--seeds", "400", "--jobs", "2",
                          "--max-seconds", "0", "--out", str(tmp_path)], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-conformance.json")]
    assert 0 < result["scenarios"] < 400 and result["failed"] == 0
