"""The "auto" budget check (actoffload/tools/auto_check.py) on the CPU: a tiny model, both
runs of the part that fits (no offloading, then memory_budget="auto"), bitwise, and the part
that cannot run out of memory on a CPU said to be skipped."""

from __future__ import annotations

import json

import pytest
import torch

from actoffload.tools import auto_check


def test_auto_check_runs_on_the_cpu_and_reports_both_parts(tmp_path):
    out = tmp_path / "auto.json"
    assert auto_check.main(["--small", "--steps", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    fits = res["fits"]
    assert fits["bitwise"] is True and len(fits["auto"]["steps_s"]) == 5
    assert fits["auto"]["plan"]["settled"] and fits["auto"]["settled_at"] is not None
    assert fits["auto"]["plan"]["memory_budget_setting"] == "auto"
    assert "skipped" in res["does_not_fit"] and res["env"]["device"] == "cpu"


def test_an_out_of_memory_error_is_reported_not_raised():
    def runs_out():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    assert auto_check._runs_out(runs_out) == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert auto_check._runs_out(lambda: None) is None


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--out", "{tmp}"], "is a folder"),
    (["--out", "{tmp}/no/such.json"], "does not exist"),
])
def test_auto_check_refuses_bad_arguments_before_it_runs(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(auto_check, "check", lambda *a, **k: pytest.fail("it ran"))
    with pytest.raises(SystemExit) as e:
        auto_check.main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
