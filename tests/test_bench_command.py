"""``actoffload bench``: writes a results file, and compares two of them figure by figure."""

import json

import pytest

from actoffload.tools import bench, cli


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


def test_bench_rejects_an_unknown_section():
    with pytest.raises(SystemExit, match=r"unknown section\(s\) \['nope'\]; valid ones are: bandwidth"):
        cli.main(["bench", "--only", "nope"])
