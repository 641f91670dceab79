"""The demo command runs end to end on the CPU and reports what it promises."""

import sys

import pytest

from actoffload.tools import cli

SMALL = ["demo", "--device", "cpu", "--steps", "2", "--d-model", "32", "--layers", "2", "--seq-len", "16", "--batch", "2"]
CONFIGS = ["none", "none (again)", "save_on_cpu", "ref", "fast"]


def _rows(out: str) -> dict[str, str]:
    return {name: line for line in out.splitlines() for name in CONFIGS if line.startswith(name + "  ")}


@pytest.mark.parametrize("experts", ["0", "4"], ids=["dense", "moe"])
def test_demo_runs_every_configuration_and_every_loss_matches(capsys, experts):
    assert cli.main(SMALL + ["--experts", experts]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == CONFIGS and all(" yes " in row for row in rows.values())
    assert "GPT-MoE (4 experts" in out if experts == "4" else "GPT (dense)" in out
    assert "(host)" in out  # CPU memory figures are labelled host-side


def test_demo_impl_picks_the_configurations(capsys):
    assert cli.main(SMALL + ["--impl", "fast"]) == 0
    assert list(_rows(capsys.readouterr().out)) == ["none", "none (again)", "fast"]
    with pytest.raises(SystemExit, match="--impl: .*'bogus'.*save_on_cpu"):
        cli.main(SMALL + ["--impl", "bogus"])


def test_demo_moe_reports_bytes_by_role(capsys):
    args = SMALL + ["--experts", "4", "--offload-modules", "moe_act,expert_fc1", "--policy", "marked",
                    "--min-offload-bytes", "1024"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "offloaded MB/step by role" in out and "moe_act" in out and "expert_fc1" in out


def test_demo_rejects_an_unknown_role_and_too_few_steps():
    with pytest.raises(SystemExit, match="unknown role.*'bogus'"):
        cli.main(SMALL + ["--offload-modules", "bogus"])
    with pytest.raises(SystemExit, match="--steps: at least 2"):
        cli.main(SMALL[:3] + ["--steps", "1"])


def test_demo_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install 'actoffload[plot]')")
    png = tmp_path / "demo.png"
    assert cli.main(SMALL + ["--impl", "ref,fast", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out


def test_demo_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib.*pip install 'actoffload\[plot\]'"):
        cli.main(SMALL + ["--plot", str(tmp_path / "x.png")])


def test_progress_bar_shows_how_far_it_got(capsys):
    from actoffload.tools.progress import Progress

    bar = Progress(4, "fast", width=8)
    bar.update(2)
    bar.close("  (failed)")
    line = capsys.readouterr().err  # not a terminal: one line, written at the end
    assert line.startswith("  [####....] 2/4 steps  fast") and line.rstrip().endswith("(failed)")


def test_progress_bar_counts_failures_and_rate_and_logs_on_the_way(capsys):
    from actoffload.tools.progress import Progress

    bar = Progress(100, "fast on cpu", unit="scenarios", width=10, failures=True, rate=True, log_lines=4)
    for done in range(10, 101, 10):
        bar.update(done, failed=done // 50)
    bar.close()
    lines = capsys.readouterr().err.splitlines()  # not a terminal: a line each quarter, one at the end
    assert [ln.split()[1] for ln in lines] == ["30/100", "50/100", "80/100", "100/100"]
    assert lines[-1].startswith("  [##########] 100/100 scenarios  fast on cpu  failed=2  ") and "/s  " in lines[-1]


def test_demo_plot_labels_what_a_cpu_run_cannot_show(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install 'actoffload[plot]')")
    from actoffload.tools import plot

    seen = {}
    real = plot.save_plot
    monkeypatch.setattr(plot, "save_plot", lambda *a, **kw: (seen.update(kw), real(*a, **kw)))
    assert cli.main(SMALL + ["--impl", "ref", "--min-offload-bytes", "0", "--plot", str(tmp_path / "demo.png")]) == 0
    assert "cannot lower this curve" in seen["note"]
    assert seen["held_back"] == {"1": "kept on the device (keep_last=1)"}  # the last of 2 layers
