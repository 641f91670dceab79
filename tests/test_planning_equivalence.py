"""benchmarks/planning_equivalence.py, the check that a planner change kept every plan and
choice: a dump says the same of the same tree, and a comparison finds a change."""

import importlib.util
import json
from pathlib import Path

from actoffload.tools.provenance import write_results

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "planning_equivalence.py"


def _module():
    spec = importlib.util.spec_from_file_location("planning_equivalence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path, cases):
    write_results(path, {"tree": "", "cases": cases})


def test_the_planner_says_the_same_twice_and_a_changed_plan_is_found(tmp_path, capsys):
    eq = _module()
    profiles = {"synthetic": eq.synthetic(6, True, 0, True), "random": eq._random(7), "identical": eq._identical(3)}
    cases = {name: eq.measured(p) for name, p in profiles.items()}
    assert cases == {name: eq.measured(p) for name, p in profiles.items()}
    assert all(r["candidates"] and r["choices"] for r in cases.values())
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    _write(a, cases)
    _write(b, cases)
    assert eq.compare(str(a), str(b)) == 0
    changed = json.loads(json.dumps(cases))
    time_hex = changed["random"]["candidates"][0][4]
    changed["random"]["candidates"][0][4] = float.hex(float.fromhex(time_hex) * (1 + 2 ** -52))  # one ulp
    _write(b, changed)
    assert eq.compare(str(a), str(b)) == 1
    assert "differs: random (candidates)" in capsys.readouterr().out
    _write(b, {"synthetic": cases["synthetic"]})
    assert eq.compare(str(a), str(b)) == 2  # another corpus
