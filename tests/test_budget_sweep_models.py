"""The budget sweep's transformers workloads and its alternatives to a budget (selective
activation checkpointing, checkpointing with the inputs on the host), on the CPU with tiny
models: they build, each method runs and its gradients are bitwise equal to no offloading's,
and ``--only hf_llama_eager --small`` runs end to end."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import actoffload as ao
from actoffload.tools import budget_sweep as bs
from actoffload.tools import sweep_models as sm
from actoffload.tools.plan_trace import PlanTrace

CPU = torch.device("cpu")
needs_transformers = pytest.mark.skipif(not sm.have_transformers(), reason="transformers is not installed")


class _OpCounts(TorchDispatchMode):
    """How often each aten op ran (forward, recomputation and backward)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _hf(name="hf_llama_eager"):
    return dict(sm.workloads(CPU, small=True, models="hf"))[name]()


def _step(w, method, counts=None):
    run = bs._Runner(w, method, CPU)
    if counts is None:
        run.step(0)
    else:
        with counts:
            run.step(0)
    return [t.grad.clone() for t in w.trainable], run


@needs_transformers
def test_tiny_transformers_workloads_build():
    assert [name for name, _ in sm.workloads(CPU, small=True, models="hf")] == list(sm.HF_WORKLOADS)
    for name in sm.HF_WORKLOADS:
        w = _hf(name)
        assert w.name == name and w.blocks is w.model.model.layers and len(w.blocks) == 2
        assert w.parts is None and w.repeat_none and w.scale is None  # whole layers; --small: the default scale
        assert w.info["attn_implementation"] == sm.HF_SHAPES[name].attention and w.info["hidden"] == 64
        assert w.model.training and torch.isfinite(w.loss(sm.plain, 0))
    assert {sm.HF_SHAPES[n].seq for n in ("hf_8b_8k", "hf_8b_32k")} == {8192, 32768}
    assert set(sm.HF_SCALES) == set(sm.HF_WORKLOADS)


@needs_transformers
@pytest.mark.parametrize("label", ["checkpoint_all", "sac", "checkpoint_offload", "checkpoint_1"])
def test_each_checkpointing_method_is_bitwise_and_recomputes_what_it_says(label, monkeypatch):
    w = _hf()
    methods = bs._methods(w, CPU)
    base_counts, counts = _OpCounts(), _OpCounts()
    base, _ = _step(w, methods["none"], base_counts)
    entered = []
    original = torch.autograd.graph.save_on_cpu

    class Counting(original):  # the checkpoint's inputs go through save_on_cpu, one layer at a time
        def __init__(self, *args, **kwargs):
            entered.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    grads, _ = _step(w, methods[label], counts)
    assert len(grads) == len(base) and all(torch.equal(a, b) for a, b in zip(grads, base))
    layers = 1 if label == "checkpoint_1" else 2
    # the MLP's SiLU is recomputed by every kind of checkpointing, once per checkpointed layer
    assert counts.counts["silu"] == base_counts.counts["silu"] + layers
    if label == "sac":  # its matmuls are kept, not run again
        assert counts.counts["mm"] == base_counts.counts["mm"] and counts.counts["bmm"] == base_counts.counts["bmm"]
    else:
        assert counts.counts["mm"] > base_counts.counts["mm"]
    assert entered == ([{"pin_memory": False}] * 2 if label == "checkpoint_offload" else [])


@needs_transformers
def test_a_budget_wraps_whole_layers_and_stays_bitwise():
    w = _hf()
    base, _ = _step(w, bs.Method("none"))
    # the least a plan of whole layers holds, from its profiling steps; then that as the budget
    profile = bs._Runner(w, bs.Method("p", parts=True, offloader=lambda: ao.Offloader(
        impl="fast", device=CPU, min_offload_bytes=0, memory_budget=1 << 50)), CPU)
    for i in range(3):
        profile.step(i)
    least = profile.off.stats()["plan"]["smallest_reachable_bytes"]
    run = bs._Runner(w, bs.Method("b", parts=True, offloader=lambda: ao.Offloader(
        impl="fast", device=CPU, min_offload_bytes=0, memory_budget=least)), CPU)
    for i in range(4):
        run.step(i)
        assert all(torch.equal(t.grad, g) for t, g in zip(w.trainable, base))
    plan = run.off.stats()["plan"]
    assert len(plan["groups"]) == 2  # one group a layer
    assert {g["action"] for g in plan["groups"]} != {"keep"}


def test_fastest_fitting_takes_the_new_alternatives_and_leaves_out_failures():
    def method(name, ms, gib):
        return {"method": name, "step_ms": ms, "peak_bytes": gib << 30}

    m = {"none": method("none", 100, 9), "checkpoint_all": method("checkpoint_all", 140, 4),
         "sac": method("sac", 120, 5), "checkpoint_offload": method("checkpoint_offload", 130, 3),
         "save_on_cpu": method("save_on_cpu", 700, 3), "ref": method("ref", 50, 1), "fast": method("fast", 300, 5)}
    workload = {"methods": m, "selective": [method("checkpoint_1", 125, 5)]}
    assert bs._fastest_fitting(workload, 5 << 30)["method"] == "sac"
    assert bs._fastest_fitting(workload, 3 << 30)["method"] == "checkpoint_offload"  # ref never counts
    m["sac"] = {"method": "sac", "error": "RuntimeError: no"}
    assert bs._fastest_fitting(workload, 5 << 30)["method"] == "checkpoint_1"
    del m["checkpoint_offload"]  # an older sweep's results
    assert bs._fastest_fitting(workload, 3 << 30)["method"] == "save_on_cpu"


def test_without_transformers_its_workloads_are_skipped(monkeypatch):
    monkeypatch.setattr(bs, "have_transformers", lambda: False)
    lines = []
    out = bs.sweep(CPU, True, log=lines.append, only={"hf_llama_eager"})
    assert out == [{"workload": "hf_llama_eager", "skipped": True, "error": "skipped: transformers is not installed"}]
    assert any("transformers is not installed" in line for line in lines)


def test_only_names_a_workload_of_any_set(capsys):
    with pytest.raises(SystemExit):
        bs.main(["--only", "hf_llama_eagr", "--small"])
    assert "hf_llama_eager" in capsys.readouterr().err
    names = sm.workload_names(small=True)
    assert set(sm.HF_WORKLOADS) <= set(names) and "stack_small" in names


@pytest.mark.parametrize("flags,message", [
    (["--out", "{tmp}/no/such/x.json"], "--out {tmp}/no/such/x.json: folder '{tmp}/no/such' does not exist"),
    (["--out", "{tmp}"], "--out {tmp}: is a folder"),
    (["--plot", "{tmp}/no/x.png"], "--plot {tmp}/no/x.png: folder '{tmp}/no' does not exist"),
    (["--only", ","], "--only: no workload ''"),
    # a loop sweep's results have workloads too, not a budget sweep's
    (["--include", "{tmp}/loops.json"], "--include {tmp}/loops.json: not a budget sweep's results (its workloads"),
    (["--include", "{tmp}/dict.json"], "--include {tmp}/dict.json: not a budget sweep's results (its workloads"),
])
def test_results_paths_and_names_are_checked_before_any_workload_runs(tmp_path, monkeypatch, capsys, flags, message):
    """A results file that cannot be written, or one to include that is another tool's, is said
    before the sweep, not as a traceback when the first workload's results are saved (hours in
    on a GPU)."""
    (tmp_path / "loops.json").write_text('{"workloads": [{"workload": "llama", "variable_length": {}}]}')
    (tmp_path / "dict.json").write_text('{"workloads": {"llama": 1}}')
    monkeypatch.setattr(bs, "sweep", lambda *a, **k: pytest.fail("a workload ran"))
    with pytest.raises(SystemExit) as e:
        bs.main(["--small"] + [f.format(tmp=tmp_path) for f in flags])
    assert e.value.code == 2 and message.format(tmp=tmp_path) in capsys.readouterr().err


@needs_transformers
def test_small_sweep_of_hf_llama_eager_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(bs, "PAIRED_S", 0.0)
    monkeypatch.setattr(bs, "PAIRED_ROUNDS", (3, 3))
    monkeypatch.setattr(bs, "PAIRED_MAX_S", 0.0)
    out = tmp_path / "sweep.json"
    assert bs.main(["--only", "hf_llama_eager", "--small", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (w,) = doc["workloads"]
    assert w["workload"] == "hf_llama_eager" and w["budget_parts"] is False
    assert w["config"]["attn_implementation"] == "eager"
    methods = w["methods"]
    for name in ("none", "none_repeat", "checkpoint_all", "sac", "checkpoint_offload", "save_on_cpu", "ref", "fast"):
        assert "error" not in methods[name] and methods[name]["bitwise"], name
        assert {"step_ms", "peak_bytes", "reserved_peak_bytes"} <= set(methods[name])
    assert w["none_vs_none_bitwise"] is True
    v = doc["verdicts"]["hf_llama_eager"]
    assert v["none_vs_none_bitwise"] is True and set(v["methods"]) == {*methods, "checkpoint_1"}
    # the CPU has no allocator to read: one budget; on a GPU the sweep's levels, those under the
    # smallest reachable peak saying so
    cells = [c for c in v["cells"] if "error" not in c]
    assert cells and len(cells) == len(v["cells"]) - sum("no plan fits" in c.get("error", "") for c in v["cells"])
    if not torch.cuda.is_available():
        assert len(v["cells"]) == 1
    for cell in cells:
        assert cell["bitwise"] and cell["fastest_fitting_alternative"] in (*bs.ALTERNATIVES, "checkpoint_1")
    budget = next(b for b in w["budgets"] if "error" not in b)
    early = budget["early_steps"]  # each warm-up step says what its plan was: which went over, running what
    assert len(early) == len(budget["early_steps_ms"]) and all(e["plan"] is not None for e in early)
    assert early[0]["plan"]["state"] == "profiling" and early[0]["plan"]["ran"] is None  # no plan of its own yet
    last = early[-1]["plan"]
    assert last["state"] == "settled" and last["ran"][:-2] == last["actions"]  # the settled plan ran (and its copy window)
    assert methods["checkpoint_all"]["early_steps"][0]["plan"] is None  # no budget, no plan


def test_a_step_says_which_plan_ran_per_workload():
    """The plan a step ran is its workload's tried plan whose steps grew (the plan after it may
    already be another, chosen at its end); ``None`` while profiling. Each workload (signature)
    keeps its own count."""
    def plan(signature, state, *steps):
        return {"state": state, "workload": {"signature": signature},
                "tried": [{"actions": a, "max_inflight": 0, "prefetch": 0, "steps": n}
                          for a, n in zip((["keep", "recompute"], ["keep", "keep"]), steps)]}

    trace = PlanTrace()
    steps = [plan("long", "profiling"), plan("long", "exploring", 1), plan("short", "exploring", 1),
             plan("long", "exploring", 1, 1), plan("long", "settled", 1, 2), plan("short", "exploring", 2)]
    assert [trace.ran(p) for p in steps] == [None, ["keep", "recompute", 0, 0], ["keep", "recompute", 0, 0],
                                             ["keep", "keep", 0, 0], ["keep", "keep", 0, 0], ["keep", "recompute", 0, 0]]


def test_a_workloads_scale_sets_its_alternating_rounds():
    class Fake:
        reserved = 0  # what _Runner reads after each step
        note = None  # and its budget's plan after it
        off = None  # no offloader: no cache given back

        def __init__(self, label):
            self.method = bs.Method(label)

        def step(self, step):
            return 0.5, 0

        def warming_up(self):
            return False

    # 1 s a round: 2 s fill 2 rounds, under the fewest (3); the interval is exact, no more
    p = bs.paired(Fake("a"), Fake("b"), warmup=1, first_step=0, scale=bs.Scale(3, 1, 3, 2.0, (3, 8), 5.0))
    assert p["rounds"] == 3 and p["ratio"] == 1.0
