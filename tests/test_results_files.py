"""Committed results files stay compact: the repository travels whole to the GPU machine,
whose tool carries at most 64 MiB, and indented JSON made the loop sweeps' files half as large
again (the working tree reached 54 MiB and a call was refused)."""

import json
from pathlib import Path

import pytest

from actoffload.tools.provenance import results_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ("benchmarks/results", "conformance/results", "examples/results")


def test_results_json_is_compact_and_reads_back_the_same():
    doc = {"env": {"gpu": "H200", "torch": "2.11"}, "steps": [0.1, 2, None, True], "nested": {"a": [1, {"b": 2}]}}
    text = results_json(doc)
    assert "\n" not in text and ": " not in text and ", " not in text
    assert json.loads(text) == doc


def test_committed_results_json_are_compact():
    files = [p for d in RESULTS for p in sorted((ROOT / d).glob("*.json"))]
    assert files, "no results files found: is the test run from a checkout?"
    indented = [str(p.relative_to(ROOT)) for p in files if "\n " in p.read_text()]
    assert not indented, ("results JSON written indented; write them with actoffload.tools.provenance.results_json "
                          f"(or re-serialize them compactly): {indented}")


def test_a_results_file_writes_nan_as_null():
    """JSON has no NaN: Python would write a bare NaN (the CPU's pinned bandwidth), which other
    readers refuse."""
    text = results_json({"gbps": float("nan"), "runs": [1.5, float("nan")], "pair": (float("nan"), 2)})
    assert text == '{"gbps":null,"runs":[1.5,null],"pair":[null,2]}'
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a results file"))

