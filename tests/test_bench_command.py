"""``actoffload bench``: writes a results file, and compares two of them figure by figure."""

import json

import pytest

from actoffload.tools import bench, budget_sweep, cli


def _results(gpu="cpu", **figures):
    return {"env": {"gpu": gpu, "date": "2026-11-26T00:00:00"}, **figures}


def test_figures_flattens_numbers_and_leaves_out_the_rest():
    res = _results(a={"b": 2, "c": [1, 2], "ok": True, "name": "x"}, d=float("nan"), e=3.5)
    assert bench.figures(res) == {"a.b": 2.0, "e": 3.5}


def test_format_comparison_prints_each_common_figure_with_its_change():
    old = _results(step={"fast_ms": 200.0, "none_ms": 100.0}, gone=1)
    new = _results(step={"fast_ms": 150.0, "none_ms": 100.0}, added=2)
    text = bench.format_comparison(old, new)
    line = next(ln for ln in text.splitlines() if ln.startswith("step.fast_ms"))
    assert line.split()[1:] == ["200", "150", "-25.0%"]
    assert "+0.0%" in next(ln for ln in text.splitlines() if ln.startswith("step.none_ms"))
    assert "2 figure(s) in one run only" in text and "different devices" not in text
    assert "different devices" in bench.format_comparison(old, _results(gpu="H100", step={"fast_ms": 1.0}))


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("not json", "is not JSON"),
    ('{"a": 1}', "is not a results file of 'actoffload bench'"),
])
def test_compare_names_a_bad_file_before_measuring(tmp_path, content, message):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        cli.main(["bench", "--compare", str(path), "--out", str(tmp_path)])


def test_bench_writes_results_and_compares_with_a_previous_run(tmp_path, capsys):
    args = ["bench", "--quick", "--only", "bandwidth,hooks", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    (first,) = tmp_path.glob("*.json")
    res = json.loads(first.read_text())
    assert res["quick"] and res["env"]["torch"] and "hook_overhead" in res and "step_small" not in res
    assert cli.main(args + ["--compare", str(first)]) == 0
    assert "hook_overhead.fast_kept_us_per_tensor" in capsys.readouterr().out


def test_bench_never_overwrites_results_and_prints_strict_json(tmp_path, capsys):
    """A second run the same day on the same commit, comparing with the first, writes beside it
    (it overwrote the very file it compared with); the summary is JSON any reader takes (a bare
    NaN, for a bandwidth not measured on a CPU, is not)."""
    args = ["bench", "--quick", "--only", "hooks", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    (first,) = tmp_path.glob("*.json")
    before = first.read_text()
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the summary"))
    assert cli.main(args + ["--compare", str(first)]) == 0
    assert first.read_text() == before and len(list(tmp_path.glob("*.json"))) == 2


def test_a_quick_bench_moves_bytes_and_compares_gradients_of_offloading(tmp_path):
    """The quick stack's tensors are all under the default min_offload_bytes: its steps and its
    bitwise check ran offloaders that moved nothing."""
    assert cli.main(["bench", "--quick", "--only", "steps,bitwise", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    step = json.loads(path.read_text())["step_small"]
    assert all(step[mode]["offloaded_bytes"] > 0 for mode in ("fast", "ref"))
    assert step["grads_bitwise_equal"] == {"none_vs_none": True, "fast": True, "ref": True}
    assert step["none"]["resident_bytes_after_forward"] is None  # not measured on a CPU


def test_bench_budgets_section_runs_the_budget_sweep(tmp_path, monkeypatch):
    # each cell's alternating steps: 3 rounds, no more. The sweep's own rounds fill seconds
    # (up to PAIRED_MAX_S, 24 s a workload, where noisy CPU steps never reach a 1% interval);
    # how many rounds it runs is tested below with timed fakes
    monkeypatch.setattr(budget_sweep, "PAIRED_S", 0.0)
    monkeypatch.setattr(budget_sweep, "PAIRED_ROUNDS", (3, 3))
    monkeypatch.setattr(budget_sweep, "PAIRED_MAX_S", 0.0)
    assert cli.main(["bench", "--quick", "--only", "budgets", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    sweep = json.loads(path.read_text())["budget_sweep"]
    assert {w["workload"] for w in sweep["workloads"]} == set(sweep["verdicts"]) >= {"stack_small", "llama"}
    assert all(c["bitwise"] for v in sweep["verdicts"].values() for c in v["cells"] if "error" not in c)
    # each cell ran alternating steps with the fastest alternative that fits it (the cell under
    # checkpointing every block: with that), and is judged by them
    judged = 0
    for w in sweep["workloads"]:
        for b, c in zip(w["budgets"], sweep["verdicts"][w["workload"]]["cells"]):
            if b.get("under_checkpoint_all"):
                assert b["paired"]["against"] == "checkpoint_all"
            elif c.get("fastest_fitting_alternative"):
                assert c["vs_fastest_fitting_measured"] == "alternating" and b["paired"]["rounds"] == 3
                judged += 1
    assert judged
    # settling as a user meets it: steps until each budget's plan was final, its first steps
    # against as many steady ones
    for w in sweep["workloads"]:
        v = sweep["verdicts"][w["workload"]]
        cells = [b for b in w["budgets"] if "error" not in b]
        assert v["budget_steps_to_settle"] == [len(b["early_steps_ms"]) for b in cells]
        assert [f["steps"] for f in v["budget_first_steps_vs_steady"]] == [
            min(20, len(b["early_steps_ms"]) + len(b["steps_ms"])) for b in cells]


def test_first_steps_against_steady_ones_count_the_warm_up_and_the_measured_steps_in_order():
    cell = {"early_steps_ms": [50.0] + [10.0] * 24, "steps_ms": [10.0] * 6, "step_ms": 10.0}
    assert budget_sweep.first_steps_vs_steady(cell) == {"steps": 20, "ratio": 1.2}  # 40 ms over 20 steps
    assert budget_sweep.first_steps_vs_steady({"steps_ms": [8.0, 12.0], "step_ms": 10.0}) == {"steps": 2, "ratio": 1.0}


def test_paired_alternates_the_two_methods_step_by_step(monkeypatch):
    # one step of each measures a round: 3 rounds fill PAIRED_S
    monkeypatch.setattr(budget_sweep, "PAIRED_S", 0.015)
    monkeypatch.setattr(budget_sweep, "PAIRED_ROUNDS", (2, 40))
    order = []

    class Fake:
        reserved = 0  # what _Runner reads after each step
        note = None  # and its budget's plan after it
        off = None  # no offloader: no cache given back

        def __init__(self, label, seconds):
            self.method = budget_sweep.Method(label)
            self.seconds = seconds

        def step(self, step):
            order.append((self.method.label, step))
            return self.seconds, 0

        def warming_up(self):
            return False

    p = budget_sweep.paired(Fake("a", 0.003), Fake("b", 0.002), warmup=1, first_step=10)
    assert order == [("b", 10), ("a", 11), ("a", 12), ("b", 13), ("a", 14), ("b", 15), ("a", 16), ("b", 17)]
    assert p["against"] == "b" and p["rounds"] == 3 and p["ratio"] == pytest.approx(1.5)


def test_paired_counts_the_caches_the_budget_gave_back_while_alternating():
    # a rival reserving more than the budget's plan grows the cache between the budget's steps:
    # each of them gives it back, which the alternating times include
    class Budget:
        reserved = 0
        note = None

        def __init__(self):
            self.method, self.trims, self.off = budget_sweep.Method("fast_budget"), 1, self

        def stats(self):
            return {"plan": {"cache_trims_by": {"first": 1, "grown between steps": self.trims - 1}}}

        def step(self, step):
            self.trims += step > 1  # its first step (the warm-up's round) gives back nothing new
            return 0.01, 0

        def warming_up(self):
            return False

    class Rival(Budget):
        def __init__(self):
            self.method, self.off = budget_sweep.Method("none"), None

        def step(self, step):
            return 0.01, 0

    p = budget_sweep.paired(Budget(), Rival(), warmup=1, first_step=0)
    assert p["cache_trims_by"] == {"grown between steps": p["rounds"]}
    assert budget_sweep.paired(Rival(), Rival(), warmup=1, first_step=0)["cache_trims_by"] == {}


def test_a_budgets_warm_up_lasts_until_its_plan_is_settled():
    class Settling:
        reserved = 0
        note = None  # and its budget's plan after it

        def __init__(self, settled_after):
            self.steps, self.settled_after = 0, settled_after

        def step(self, step):
            self.steps += 1
            return 0.001, 0

        def warming_up(self):
            return False

        def settling(self):
            return self.steps < self.settled_after

    assert len(budget_sweep._warm_up(Settling(9), 0, least=4, settle=True)) == 9
    assert len(budget_sweep._warm_up(Settling(2), 0, least=4, settle=True)) == 4
    assert len(budget_sweep._warm_up(Settling(9), 0, least=4)) == 4  # other methods: no plan to settle
    assert len(budget_sweep._warm_up(Settling(10**6), 0, least=4, settle=True)) == 54  # never settling: capped


def test_paired_rounds_fill_their_time_within_bounds():
    class Fake:
        reserved = 0  # what _Runner reads after each step
        note = None  # and its budget's plan after it
        off = None  # no offloader: no cache given back

        def __init__(self, label, seconds):
            self.method, self.seconds = budget_sweep.Method(label), seconds

        def step(self, step):
            return self.seconds, 0

        def warming_up(self):
            return False

    lo, hi = budget_sweep.PAIRED_ROUNDS
    assert budget_sweep.paired(Fake("a", 10.0), Fake("b", 10.0), warmup=1, first_step=0)["rounds"] == lo
    assert budget_sweep.paired(Fake("a", 1e-4), Fake("b", 1e-4), warmup=1, first_step=0)["rounds"] == hi
    pair_s = 2 * budget_sweep.PAIRED_S / (lo + hi)  # half-way
    assert budget_sweep.paired(Fake("a", pair_s / 2), Fake("b", pair_s / 2), warmup=1,
                               first_step=0)["rounds"] == round((lo + hi) / 2)


def test_paired_rounds_go_on_until_the_ratio_is_known_within_a_percent_or_time_runs_out():
    import random

    class Noisy:
        reserved = 0  # what _Runner reads after each step
        note = None  # and its budget's plan after it
        off = None  # no offloader: no cache given back

        def __init__(self, label, seconds, spread):
            self.method, self.seconds, self.spread = budget_sweep.Method(label), seconds, spread
            self.rng = random.Random(label)

        def step(self, step):
            return self.seconds * (1 + self.rng.uniform(-self.spread, self.spread)), 0

        def warming_up(self):
            return False

    lo, hi = budget_sweep.PAIRED_ROUNDS
    steady = budget_sweep.paired(Noisy("a", 1e-3, 0.0), Noisy("b", 1e-3, 0.0), warmup=1, first_step=0)
    assert steady["rounds"] == hi and steady["ratio_interval"] == [1.0, 1.0]  # known at once
    noisy = budget_sweep.paired(Noisy("a", 1e-3, 0.1), Noisy("b", 1e-3, 0.1), warmup=1, first_step=0)
    a, b = noisy["ratio_interval"]
    assert noisy["rounds"] > hi and b - a <= 2 * budget_sweep.PAIRED_PRECISION * noisy["ratio"]
    slow = budget_sweep.paired(Noisy("a", 1.0, 0.1), Noisy("b", 1.0, 0.1), warmup=1, first_step=0)
    # 2 s a round: 8 rounds (16 s), one more batch of 8 (32 s), and the time has run out
    assert slow["rounds"] == 2 * lo and 2 * lo * 2.0 > budget_sweep.PAIRED_MAX_S > lo * 2.0
    assert budget_sweep.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)


def test_paired_ratio_is_the_median_of_each_rounds_own_ratio(monkeypatch):
    # the host drifts: a round's two steps share its state, separate medians do not
    monkeypatch.setattr(budget_sweep, "PAIRED_ROUNDS", (3, 3))
    class Drifting:
        reserved = 0  # what _Runner reads after each step
        note = None  # and its budget's plan after it
        off = None  # no offloader: no cache given back

        def __init__(self, label, times):
            self.method, self.times = budget_sweep.Method(label), iter(times)

        def step(self, step):
            return next(self.times), 0

        def warming_up(self):
            return False

    # a's first step and b's warm-up step measure how long a round takes
    p = budget_sweep.paired(Drifting("a", [9.0, 3.0, 3.0, 30.0]), Drifting("b", [9.0, 2.0, 20.0, 20.0]),
                            warmup=1, first_step=0)
    assert p["ratio"] == pytest.approx(1.5) and p["ratio_of_medians"] == pytest.approx(3.0 / 20.0)


def test_verdicts_judge_a_cell_by_its_alternating_steps_where_they_ran():
    def method(name, ms, gib):
        return {"method": name, "step_ms": ms, "peak_bytes": gib << 30, "largest_group_bytes": 1 << 30,
                "first_step_ms": ms}

    m = {"none": method("none", 100, 9), "checkpoint_all": method("checkpoint_all", 140, 4),
         "save_on_cpu": method("save_on_cpu", 700, 4), "ref": method("ref", 500, 4), "fast": method("fast", 300, 5)}
    cell = {"budget_bytes": 9 << 30, "peak_bytes": 9 << 30, "step_ms": 110, "steps_ms": [110, 105, 115],
            "bitwise": True, "first_step_ms": 200, "plan": {"predicted_step_s": 0.1}}
    under = dict(cell, budget_bytes=(4 << 30) - 1, peak_bytes=(4 << 30) - 2, step_ms=160, under_checkpoint_all=True,
                 paired={"against": "checkpoint_all", "ratio": 1.05})
    workload = {"methods": m, "selective": [], "budgets": [dict(cell), under]}
    v = budget_sweep.verdicts(workload)
    assert v["cells"][0]["vs_fastest_fitting"] == pytest.approx(1.10)
    assert v["cells"][0]["vs_fastest_fitting_measured"] == "separately"
    assert v["below_checkpoint_all"] and v["below_checkpoint_all_time_ratio"] == 1.05  # 160/140 apart: 1.14
    assert v["cells"][0]["vs_predicted"] == pytest.approx(1.10)
    workload["budgets"][0]["paired"] = {"against": "none", "ratio": 1.02, "steps_ms": [95, 100, 90, 98, 99]}
    v = budget_sweep.verdicts(workload)
    assert v["cells"][0]["vs_fastest_fitting"] == 1.02
    assert v["cells"][0]["vs_fastest_fitting_separately"] == pytest.approx(1.10)
    # its step time against the model's: the median of every steady step, alone and alternating
    assert v["cells"][0]["vs_predicted"] == pytest.approx(0.995)  # 99.5 ms of 8 steps
    assert v["cells"][0]["vs_predicted_alone"] == pytest.approx(1.10)
    workload["budgets"][0]["plan"] = {"predicted_step_s": None}  # no plan predicted a time
    assert budget_sweep.verdicts(workload)["cells"][0]["vs_predicted"] is None


def test_bench_rejects_an_unknown_section():
    with pytest.raises(SystemExit, match=r"unknown section\(s\) \['nope'\]; valid ones are: bandwidth"):
        cli.main(["bench", "--only", "nope"])


def test_latest_results_goes_by_the_date_inside_not_the_name(tmp_path):
    def write(name, date, **extra):
        (tmp_path / name).write_text(json.dumps({"env": {"gpu": "H100", "date": date}, **extra}))

    write("H100-2026-11-26-0039199.json", "2026-11-26T05:03:13+00:00", quick=False)
    write("H100-2026-11-26-f52afd6.json", "2026-11-26T03:27:11+00:00", quick=False)  # last by name, older by date
    write("H100-2026-11-29-bbbbbbb-budget-sweep.json", "2026-11-29T00:00:00+00:00", workloads=[])  # another tool's
    write("H100-2026-11-27-aaaaaaa-quick.json", "2026-11-27T00:00:00+00:00", quick=True)  # quick: not a full run
    (tmp_path / "H100-2026-11-28-summary.json").write_text('{"gpu": "H100"}')  # no env: another kind of file
    assert bench.latest_results(tmp_path).name == "H100-2026-11-26-0039199.json"
    assert bench.latest_results(tmp_path / "empty") is None


def test_step_modes_build_offloaders_from_constructor_settings():
    import torch

    from actoffload.tools.models import GPTConfig
    from actoffload.tools.workloads import STEP_MODES, TrainingStep, make_stack, parse_mode

    assert parse_mode("fast:inflight=2") == ("fast", {"max_inflight": 2})
    with pytest.raises(ValueError, match="key=int"):
        parse_mode("fast:inflight")
    cfg = GPTConfig(d_model=32, n_heads=4, n_layers=2, seq_len=8)
    stack = make_stack(cfg, "cpu", torch.float32)
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    inflight = {}
    for mode in STEP_MODES:
        with TrainingStep(stack, x, mode, "cpu") as step:
            step()
            if step.off is not None:
                inflight[mode] = step.off.settings.get("max_inflight")
    # the default fast and the variant beside it differ in what they are compared on
    assert inflight["fast"] != inflight["fast:inflight=2"] == 2


def test_copy_timer_observes_fast_without_patching_it():
    import torch

    from actoffload.tools.workloads import CopyTimer, group_offloader, group_round_trip, random_bytes

    off, timer = group_offloader("cpu"), CopyTimer()
    tensors = random_bytes([4096, 100, 70000], "cpu")
    with off.add_observer(timer):
        group_round_trip(off, torch.zeros(1, requires_grad=True), tensors)
    assert off.stats()["groups"]["g"]["offloaded_bytes"] == sum(t.numel() for t in tensors)
    assert timer.copies == [] and timer.seconds("d2h") == 0  # only fast on CUDA reports copy times


def test_the_sweep_sets_and_judges_budgets_by_reserved_peaks():
    """On CUDA a method's peak, as a budget counts it, is what the allocator reserved (its early
    steps too where asked); the CPU reads no allocator, and its allocated stand-ins count."""
    gpu = {"peak_bytes": 10, "reserved_peak_bytes": 12, "early_peak_bytes": 11, "early_reserved_peak_bytes": 15}
    assert budget_sweep.budget_peak(gpu) == 12 and budget_sweep.budget_peak(gpu, every_step=True) == 15
    cpu = {"peak_bytes": 10, "reserved_peak_bytes": 0, "early_peak_bytes": 11, "early_reserved_peak_bytes": 0}
    assert budget_sweep.budget_peak(cpu) == 10 and budget_sweep.budget_peak(cpu, every_step=True) == 11
    workload = {"methods": {"none": {"method": "none", "step_ms": 1.0, **gpu}}, "selective": []}
    assert budget_sweep._fastest_fitting(workload, 12)["method"] == "none"
    assert budget_sweep._fastest_fitting(workload, 11) is None  # its allocated peak fits; what it reserved does not



def test_a_method_measured_begins_after_what_earlier_ones_left_is_let_go(monkeypatch):
    """What earlier methods leave (their gradients, and runners and offloaders dropped in
    reference cycles) is let go before the caches are emptied; else it is cached into the next
    method's first step, whose reserved peak counts it."""
    import gc
    import weakref

    import torch

    from actoffload.tools.sweep_models import workloads

    w = next(iter(workloads(torch.device("cpu"), True, "default")))[1]()

    class Cycle:  # what a dropped offloader is: freed by a collection only
        def __init__(self):
            self.me = self

    seen = {}
    runner = budget_sweep._Runner

    def first_runner(*args):  # what was there when the method's runner was made
        seen["dropped alive"] = dropped() is not None
        seen["grads"] = [t.grad for t in w.trainable]
        return runner(*args)

    monkeypatch.setattr(budget_sweep, "_Runner", first_runner)
    for t in w.trainable:
        t.grad = torch.ones_like(t)
    gc.disable()
    try:
        dropped = weakref.ref(Cycle())
        assert dropped() is not None
        budget_sweep.measure(w, budget_sweep.Method("plain"), torch.device("cpu"), 1, 1)
    finally:
        gc.enable()
    assert seen == {"dropped alive": False, "grads": [None] * len(w.trainable)}
