"""The loop sweep (actoffload.tools.loop_sweep) on the CPU: one small run of both loops,
checked for what a GPU run's figures rest on (the same lengths for every method, gradients
compared bit for bit, four forwards per optimizer step), and its measuring parts alone."""

import contextlib
import gzip
import io
import json

import pytest
import torch

from actoffload.tools import loop_sweep
from actoffload.tools.peaks import Peaks
from actoffload.tools.provenance import read_results, write_results

STEPS, OPT_STEPS = 12, 5

# one small sweep for all of them: under pytest-xdist, one worker; kept for the session, as a
# worker may run other modules' tests between this module's (a module's fixture ran twice)
pytestmark = pytest.mark.xdist_group("loop_sweep")


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("loops") / "loops.json.gz"  # compressed, as the committed results are
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = loop_sweep.main(["--small", "--steps", str(STEPS), "--opt-steps", str(OPT_STEPS), "--out", str(path)])
    assert rc == 0
    assert gzip.decompress(path.read_bytes())  # gzip's own format: zcat reads it
    return read_results(path), out.getvalue()


def test_results_have_env_every_method_and_budget_and_the_verdicts(run):
    doc, printed = run
    cuda = torch.cuda.is_available()  # the CPU has no allocator to read
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    assert {"gpu", "torch", "date", "commit"} <= set(doc["env"]) and doc["env"]["gpu"] == gpu
    assert [w["workload"] for w in doc["workloads"]] == ["llama", "gpt_moe"] == list(doc["verdicts"])
    for w in doc["workloads"]:
        assert "error" not in w
        var, acc = w["variable_length"], w["accumulation"]
        assert set(var["methods"]) == set(acc["methods"]) == {"none", "none_again", "checkpoint_all"}
        assert [b["level"] for b in var["budgets"]] == ["checkpoint_all_peak", "halfway", "none_peak",
                                                        "checkpoint_all_peak_x1.25", "smallest_reachable"]
        assert [b["level"] for b in acc["budgets"]] == ["checkpoint_all_peak", "halfway", "none_peak"]
        assert all("error" not in b and "skipped" not in b for b in var["budgets"] + acc["budgets"])
        # the device memory each method's run took and gave back: on CUDA only
        runs = [*var["methods"].values(), *acc["methods"].values(), *var["budgets"], *acc["budgets"]]
        assert all((r["device_segments"] is None) != cuda for r in runs)
        if cuda:
            assert var["smallest_reachable"]["bytes"] <= var["budgets"][4]["budget_bytes"]
        else:
            assert var["smallest_reachable"]["bytes"] == var["budgets"][4]["budget_bytes"] - (1 << 20)  # + the CPU's margin
        # a fresh offloader per budget, each budget its own
        levels = [b["budget_bytes"] for b in var["budgets"][:3]]
        if cuda:  # tiny models on a GPU: the allocator's blocks may make the peaks one
            assert levels == sorted(levels)
        else:
            assert len(set(levels)) == 3
        v = doc["verdicts"][w["workload"]]
        for loop in ("variable_length", "accumulation"):
            for cell in v[loop]["budgets"]:
                assert {"budget_bytes", "max_step_reserved_bytes", "max_step_allocated_bytes", "steps_over_budget",
                        "steps_over_budget_allocated", "total_s", "vs_checkpoint_all", "bitwise", "plan_state",
                        "plan_settled", "steps_to_settle", "planning_s", "gc_s", "cache_trims",
                        "host_allocations"} <= set(cell)
                if loop == "variable_length":
                    assert (cell["steps_over_budget_from_first_group"] is None) != cuda
                assert (cell["max_step_reserved_bytes"] is None) != cuda and (cell["steps_over_budget"] is None) != cuda
                assert cell["total_s"] > 0 and cell["vs_checkpoint_all"] > 0 and cell["plan_state"]
                assert cell["steps_to_settle"] and all(n is None or n >= 1 for n in cell["steps_to_settle"].values())
        assert set(v["asks"]) >= {"variable_length_no_step_over_budget", "variable_length_at_halfway_within_ask",
                                  "variable_length_vs_checkpoint_all_at_its_peak", "accumulation_bitwise"}
    assert "asks:" in printed and "budget halfway" in printed


def test_every_method_runs_the_same_lengths(run):
    doc, _ = run
    for w in doc["workloads"]:
        var = w["variable_length"]
        lengths = var["lengths"]
        assert len(lengths) == STEPS and set(lengths) <= {w["seq_len"] * q // 4 for q in (1, 2, 3, 4)}
        assert lengths == loop_sweep.draw_lengths(w["seq_len"], STEPS, seed=0)
        for r in [*var["methods"].values(), *var["budgets"]]:
            assert r["lengths"] == lengths and len(r["steps_s"]) == len(r["fingerprints"]) == STEPS
        # a budget's plan saw a signature per length
        assert var["budgets"][0]["plan_steps"][0]["tokens"] == w["batch"] * lengths[0]
        # and each step names the plan it ran (none while profiling): its actions, then its copy window
        steps = var["budgets"][0]["plan_steps"]
        assert steps[0]["ran"] is None and any(s["ran"] is not None for s in steps)
        assert all(s["ran"] is None or len(s["ran"]) == len(s["actions"]) + 2 for s in steps)
        settling = doc["verdicts"][w["workload"]]["variable_length"]["budgets"][0]["steps_to_settle"]
        assert len(settling) == len(set(lengths))


def test_lengths_are_quarters_of_the_full_length_or_any_padded_length_between():
    assert set(loop_sweep.draw_lengths(2048, 200)) == {512, 1024, 1536, 2048}
    any_length = loop_sweep.draw_lengths(2048, 200, spread="any")
    assert any_length == loop_sweep.draw_lengths(2048, 200, spread="any")  # seeded: every method's
    assert all(512 <= n <= 2048 and n % loop_sweep.PADDED_TO == 0 for n in any_length)
    assert len(set(any_length)) > 100  # few recur
    assert loop_sweep.draw_lengths(4, 3, spread="any") == [4, 4, 4]
    with pytest.raises(ValueError, match="spread 'all' is not one of quarters, any"):
        loop_sweep.draw_lengths(2048, 4, spread="all")


def test_the_sweep_runs_lengths_that_rarely_recur_bitwise(tmp_path):
    path = tmp_path / "any.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = loop_sweep.main(["--small", "--steps", "6", "--opt-steps", "1", "--only", "llama", "--lengths", "any",
                              "--out", str(path)])
    assert rc == 0
    doc = read_results(path)
    assert doc["settings"]["lengths"] == "any"
    var = doc["workloads"][0]["variable_length"]
    assert var["spread"] == "any" and var["lengths"] == loop_sweep.draw_lengths(var["quarters_of"], 6, spread="any")
    assert doc["verdicts"]["llama"]["asks"]["variable_length_bitwise"] is True


def test_transformers_llama_wrapped_whole_runs_both_loops_bitwise_its_lengths_predicted(tmp_path):
    """transformers' Llama, its layers wrapped whole and called by the model's own forward (with
    position ids and a mask whose last dimension is the length): every budget bitwise, and a
    length after the first two profiles is predicted, not profiled."""
    pytest.importorskip("transformers")
    path = tmp_path / "hf.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = loop_sweep.main(["--small", "--steps", "8", "--opt-steps", "1", "--only", "hf_llama_eager",
                              "--out", str(path)])
    assert rc == 0
    doc = read_results(path)
    asks = doc["verdicts"]["hf_llama_eager"]["asks"]
    assert asks["variable_length_bitwise"] is True and asks["accumulation_bitwise"] is True
    assert asks["variable_length_budgets_run"] == 5
    var = doc["workloads"][0]["variable_length"]
    predicted = [w for b in var["budgets"] for w in b["workloads"] if w["predicted_from"] is not None]
    assert predicted and all("position_ids=[1, " in w["signature"] for w in predicted)


def test_a_results_file_that_cannot_be_written_is_said_before_any_method_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop_sweep, "sweep", lambda *a, **k: pytest.fail("a method ran"))
    for out, message in ((tmp_path / "no" / "x.json", "folder"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit) as e:
            loop_sweep.main(["--small", "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--out {out}: " in err and message in err
    with pytest.raises(SystemExit):
        loop_sweep.main(["--small", "--only", "llama,,gpt_moe"])
    assert "unknown workload(s) ['']" in capsys.readouterr().err


def test_gradients_are_compared_bit_for_bit_and_equal_on_the_cpu(run):
    doc, _ = run
    for w in doc["workloads"]:
        v = doc["verdicts"][w["workload"]]
        none = w["variable_length"]["methods"]["none"]["fingerprints"]
        assert len(set(none)) == STEPS  # each step's gradients differ: a fingerprint sees them
        assert v["variable_length"]["none_repeats_bitwise"] and v["accumulation"]["none_repeats_bitwise"]
        for loop in ("variable_length", "accumulation"):
            cells = list(v[loop]["methods"].values()) + v[loop]["budgets"]
            assert all(c["bitwise"] is True for c in cells)
        for c in v["accumulation"]["budgets"]:
            assert c["bitwise_gradients_steps"] == OPT_STEPS
            assert c["bitwise_parameters_at_end"] and c["bitwise_eval_losses"]
        assert v["asks"]["variable_length_bitwise"] and v["asks"]["accumulation_bitwise"]


def test_accumulation_runs_four_forwards_per_optimizer_step_and_evaluates(run):
    doc, _ = run
    for w in doc["workloads"]:
        acc = w["accumulation"]
        for r in [*acc["methods"].values(), *acc["budgets"]]:
            assert r["forwards_per_optimizer_step"] == [4] * OPT_STEPS
            assert r["eval_forwards"] == [1] * (OPT_STEPS // 5) and len(r["eval_losses"]) == OPT_STEPS // 5
            kinds = [x["kind"] for x in r["records"]]
            assert kinds == (["micro"] * 4 + ["optimizer"]) * (OPT_STEPS - 1) + ["micro"] * 4 + ["optimizer", "eval"]
            assert len(r["grad_fingerprints"]) == OPT_STEPS
        # the gradients of successive optimizer steps differ (the parameters moved)
        assert len(set(acc["methods"]["none"]["grad_fingerprints"])) == OPT_STEPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fingerprint_changes_with_any_one_bit_and_with_a_swap(dtype):
    fp = loop_sweep.Fingerprint(torch.device("cpu"), chunk=16)  # several chunks a tensor
    a = torch.randn(7, 9, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.randn(50).to(dtype)
    base = fp([a, None, b])
    assert fp([a.clone(), None, b.clone()]) == base
    words = torch.int32 if dtype == torch.float32 else torch.int16
    for index in (0, 40, 62):
        flipped = a.clone()
        flipped.view(-1).view(words)[index] ^= 1  # one unit in the last place
        assert fp([flipped, None, b]) != base
    swapped = b.clone()
    swapped[[3, 30]] = b[[30, 3]]
    assert fp([a, None, swapped]) != base
    assert fp([a, b]) != base and fp([a.view(9, 7), None, b]) != base  # what is missing, and shapes, count


def test_peaks_read_the_counters_before_each_reset_inside_a_step():
    counters = {"reserved": 0, "allocated": 0}
    resets = []

    class FakeCuda:
        @staticmethod
        def reset_peak_memory_stats(device=None):
            resets.append(device)
            counters.update(reserved=0, allocated=0)

    fake = FakeCuda()
    original = fake.reset_peak_memory_stats
    with Peaks(torch.device("cpu"), read_peaks=lambda: (counters["reserved"], counters["allocated"]),
                          module=fake) as peaks:
        peaks.start()
        counters.update(reserved=900, allocated=700)  # the step's first part
        fake.reset_peak_memory_stats("dev")  # the offloader resets within the step
        counters.update(reserved=500, allocated=400)
        assert peaks.read() == (900, 700)
        peaks.start()  # the next step starts afresh
        counters.update(reserved=300, allocated=200)
        assert peaks.read() == (300, 200)
    assert fake.reset_peak_memory_stats == original and resets[1] == "dev"
    assert Peaks(torch.device("cpu")).read() == (None, None)  # the CPU: nothing to read
    with pytest.raises(RuntimeError, match="outside `with Peaks"):
        Peaks(torch.device("cpu"), read_peaks=lambda: (0, 0), module=fake).start()


def test_each_method_reads_its_peaks_inside_the_peaks_context(monkeypatch):
    """On a GPU every step's peaks go through Peaks.start(), which needs the context entered:
    the loop enters it for each method (checked here with a device that only pretends)."""
    w = loop_sweep.llama(torch.device("cpu"), small=True)
    loop = loop_sweep._Loop(w, log=lambda s: None)
    loop.peaks = Peaks(torch.device("cpu"), read_peaks=lambda: (0, 0), module=type("M", (), {
        "reset_peak_memory_stats": staticmethod(lambda device=None: None)})())
    with loop.method(loop_sweep.Method("none")):
        loop.timed(lambda: None)


def test_steps_over_the_budget_are_also_counted_in_the_offloaders_own_window():
    """A step that begins on a cache over the budget and gives it back as its first group opens
    is over in this sweep's window (from before its forward), within it in the offloader's."""
    budget = 100
    steps = [{"measured_reserved_peak_bytes": 120}, {"measured_reserved_peak_bytes": 90}, {}]
    assert loop_sweep._over_from_first_group(steps, budget) == 1
    assert loop_sweep._over_from_first_group([{"measured_reserved_peak_bytes": None}], budget) is None


def test_steps_to_settle_counts_each_signatures_steps():
    readings = [{"signature": "a", "settled": False}, {"signature": "b", "settled": True},
                {"signature": "a", "settled": False}, {"signature": "a", "settled": True},
                {"signature": "a", "settled": False}, {"signature": "c", "settled": False}]
    assert loop_sweep.steps_to_settle(readings) == {"a": 3, "b": 1, "c": None}


def test_each_budget_step_says_what_the_host_did_meanwhile(run):
    """Per step of a budget: the plan's running totals of planning seconds and host allocations,
    and the garbage collector's passes during the step (what a slow step spent its host time on)."""
    doc, _ = run
    for w in doc["workloads"]:
        for b in w["variable_length"]["budgets"] + w["accumulation"]["budgets"]:
            steps = b["plan_steps"]
            assert steps and all({"planning_s_all", "host_allocations", "cache_trims", "gc"} <= set(r) for r in steps)
            totals = [r["planning_s_all"] for r in steps]
            assert totals[-1] > 0 and totals == sorted(totals)  # a running total, once plans were made
            if torch.cuda.is_available():
                assert all(isinstance(r["cache_trims"], int) for r in steps)
            else:
                assert all(r["cache_trims"] is None for r in steps)  # the CPU has no cache to give back
            assert all(set(r["gc"]) == {"passes", "oldest", "seconds"} for r in steps)


def test_each_budget_records_every_signatures_controller_with_a_profile_that_rebuilds(run):
    """Per budget run, every signature seen (not only the latest step's, which ``plan`` holds):
    its steps, the plans it ran and the profile they were modelled on, which
    ``benchmarks/settle_replay.py``'s reader makes into the same Profile, plans and all."""
    import sys
    from pathlib import Path

    from actoffload.budget import search
    from actoffload.budget.costmodel import Profile
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from settle_replay import profile_of

    doc, _ = run
    for w in doc["workloads"]:
        var = w["variable_length"]
        for b in var["budgets"] + w["accumulation"]["budgets"]:
            seen = {r["signature"] for r in b["plan_steps"] if r["signature"]}
            assert {r["signature"] for r in b["workloads"]} == seen
            assert sum(r["steps"] for r in b["workloads"]) >= len(b["plan_steps"]) - 1
            for r in b["workloads"]:
                assert r["memory_budget"] == b["budget_bytes"] and r["state"]
                if not r["actions"]:  # a signature with no plan yet (a short GPU run: seen in its first steps)
                    assert r["state"] != "settled"
                    continue
                profile = profile_of(r["profile"])
                assert isinstance(profile, Profile) and len(profile.groups) == len(r["actions"])
                assert search.candidates(profile)  # a profile the search plans on, as the run's did
        assert len(var["budgets"][0]["workloads"]) == len(set(var["lengths"]))  # one signature a length


def test_the_warm_up_runs_fast_under_a_budget_before_any_method(monkeypatch):
    """What a process does once for a budget (compiling fast's kernels, measuring the bus) is
    done in the warm-up, so that the first budget measured does not pay it alone."""
    w = loop_sweep.llama(torch.device("cpu"), small=True)
    loop = loop_sweep._Loop(w, log=lambda s: None)
    made = []
    real = loop_sweep.ao.Offloader

    def recording(*args, **kwargs):
        off = real(*args, **kwargs)
        made.append((kwargs.get("memory_budget"), off))
        return off

    monkeypatch.setattr(loop_sweep.ao, "Offloader", recording)
    loop_sweep._warm_up(loop, [w.seq_len // 2, w.seq_len])
    assert [budget for budget, _ in made] == [loop_sweep.WARM_UP_BUDGET]
    assert loop.forwards[True] == 2 * 2 + 2  # plain and checkpointed at each length, two under the budget


def test_results_are_written_whole_plain_or_compressed_and_read_back_alike(tmp_path):
    doc = {"env": {"gpu": "cpu"}, "steps": [0.5, 1.25]}
    for name in ("r.json", "r.json.gz"):
        write_results(tmp_path / name, doc)
        assert read_results(tmp_path / name) == doc and not (tmp_path / (name + ".part")).exists()
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(gzip.decompress((tmp_path / "r.json.gz").read_bytes()))
