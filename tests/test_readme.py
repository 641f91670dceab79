"""The README's code runs as written: every Python block executes, and every shell line
names a script, example or command that exists (with arguments those accept)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [line.split("#")[0].strip() for lang, code in BLOCKS if lang == "bash" for line in code.splitlines()]
SHELL = [line for line in SHELL if line]


def test_the_readme_has_both_kinds_of_blocks():
    assert PYTHON and SHELL


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_readme_python_block_runs(i, tmp_path):
    code = PYTHON[i]
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         # PATH as the user has it: Triton builds its launcher with the C compiler
                         env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr[-3000:]
    if "Quickstart" in README.split(code)[0].rsplit("## ", 1)[-1]:
        assert re.search(r"[1-9]\d* MiB offloaded by the latest forward", out.stdout), out.stdout


def _sections(script: Path) -> set[str]:
    return set(re.findall(r"^\s{4}(\w+)\)", script.read_text(), flags=re.M))


@pytest.mark.parametrize("line", SHELL)
def test_readme_shell_line_names_what_exists(line):
    words = line.split()
    command = words[0]
    if command.startswith(("scripts/", "examples/")):
        assert (ROOT / command).is_file(), command
        if command == "scripts/gpu-results":
            assert set(w for w in words[1:] if not w.startswith("-")) <= _sections(ROOT / command)
    else:
        assert command in {"python", "torchrun", "pytest", "actoffload"}, line
