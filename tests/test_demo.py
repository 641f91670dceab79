"""The demo command runs end to end on the CPU and reports what it promises."""

import pytest

from actoffload import cli

SMALL = ["demo", "--device", "cpu", "--steps", "2", "--d-model", "32", "--layers", "2", "--seq-len", "16", "--batch", "2"]


def test_demo_runs_and_every_loss_matches(capsys):
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[:1] in (["none"], ["ref"], ["fast"])]
    assert len(rows) == 4 and all(" yes " in row for row in rows)


def test_demo_moe_reports_bytes_by_role(capsys):
    args = SMALL + ["--experts", "4", "--offload-modules", "moe_act,expert_fc1", "--policy", "marked",
                    "--min-offload-bytes", "1024"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "offloaded MB/step by role" in out and "moe_act" in out and "expert_fc1" in out


def test_demo_rejects_an_unknown_role():
    with pytest.raises(SystemExit, match="unknown role.*'bogus'"):
        cli.main(SMALL + ["--offload-modules", "bogus"])
