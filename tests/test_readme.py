"""README.md as written: every fenced block in it is checked here.

- ```python blocks run, on the CPU (CUDA hidden, so that the output is the one the README
  shows), and print what the ```text block right after them shows: exactly, or where the
  README says the figures vary, in the same shape (``SHAPES``).
- ```bash lines name scripts and commands that exist. ``scripts/demo`` and ``scripts/test``
  are not run in full here (each first installs torch into .venv, minutes on a fresh
  machine, and scripts/test runs this very file): they are checked for existence and
  syntax, that they set up through scripts/setup, and that the demo's command answers
  ``--help``. The install lines are tried as far as they can be offline: the wheel is built
  (without build isolation, which would fetch setuptools) from a copy of the checkout,
  installed with ``--no-deps`` into a folder of its own, and used from outside the checkout;
  the CPU build of torch it names is the one scripts/setup installs, within pyproject's
  range; the editable install's extras exist (scripts/setup runs that line itself).
- The results table matches the JSON it cites, and every relative link resolves.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actoffload.budget.actions import Action
from actoffload.tools.budget_sweep import budget_peak
from actoffload.tools.provenance import read_results

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", flags=re.M | re.S)
BLOCKS = [(m.group(1), m.group(2), m.start()) for m in FENCE.finditer(README)]
SHELL = [line.split("#")[0].strip() for lang, code, _ in BLOCKS if lang == "bash" for line in code.splitlines()]
SHELL = [line for line in SHELL if line]


def _section(at: int) -> str:
    """The ``##`` heading the README text at offset ``at`` is under."""
    headings = re.findall(r"^## (.+)$", README[:at], flags=re.M)
    return headings[-1] if headings else ""


def _python_blocks() -> list[tuple[str, str, str | None]]:
    """(section, code, the output shown right after it, or None) for each Python block."""
    out = []
    for i, (lang, code, at) in enumerate(BLOCKS):
        if lang == "python":
            shown = BLOCKS[i + 1][1] if i + 1 < len(BLOCKS) and BLOCKS[i + 1][0] == "text" else None
            out.append((_section(at), code, shown))
    return out


PYTHON = _python_blocks()
ACTIONS = "|".join(a.value for a in Action)
# Output whose figures the README says vary: the shape it must have (both the README's and the run's)
SHAPES = {
    "A memory budget": re.compile(rf"^\[(?:'(?:{ACTIONS})'(?:, )?){{4}}\] (\d+) MiB predicted, (settled|not settled)$"),
}


def test_every_block_is_of_a_kind_checked_here():
    assert BLOCKS, "README.md has no fenced blocks"
    for i, (lang, code, at) in enumerate(BLOCKS):
        assert lang in {"python", "bash", "text"}, f"a ```{lang} block under '{_section(at)}': check it here"
        if lang == "text":  # output, of the Python block right before it
            assert i > 0 and BLOCKS[i - 1][0] == "python", f"a ```text block under '{_section(at)}' follows no Python block"
    assert PYTHON and SHELL


def _run(code: str, cwd: Path, pythonpath: Path = ROOT) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(pythonpath), "PATH": os.environ.get("PATH", ""),  # Triton builds with the C compiler
           "CUDA_VISIBLE_DEVICES": "", "HOME": os.environ.get("HOME", str(cwd))}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("i", range(len(PYTHON)), ids=[f"{i}-{s}" for i, (s, _, _) in enumerate(PYTHON)])
def test_readme_python_block_runs_and_prints_what_the_readme_shows(i, tmp_path):
    section, code, shown = PYTHON[i]
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout.strip()
    if shown is None:
        return
    shown = shown.strip()
    if section in SHAPES:
        pattern = SHAPES[section]
        assert pattern.match(shown), f"the README's output under '{section}' lost its shape: {shown!r}"
        m = pattern.match(printed)
        assert m, f"printed {printed!r}, not in the shape of {shown!r}"
        if section == "A memory budget":
            assert int(m.group(1)) <= 50 and m.group(2) == "settled", printed  # the plan fits its 50MiB; CPU: settled
    else:
        assert printed == shown


def test_the_quickstart_and_the_budget_example_are_both_checked():
    sections = {s for s, _, shown in PYTHON if shown is not None}
    assert {"Quickstart", "A memory budget"} <= sections


# ------------------------------------------------------------------ shell lines
def _sections(script: Path) -> set[str]:
    return set(re.findall(r"^\s{4}(\w+)\)", script.read_text(), flags=re.M))


PIP_LINES = [line for line in SHELL if line.split()[0] in {"pip", "python"} and "pip" in line.split()[:3]]


@pytest.mark.parametrize("line", [line for line in SHELL if line not in PIP_LINES])
def test_readme_shell_line_names_what_exists(line):
    words = line.split()
    command = words[0]
    if command.startswith(("scripts/", "examples/")):
        assert (ROOT / command).is_file(), command
        if command == "scripts/gpu-results":
            assert set(w for w in words[1:] if not w.startswith("-")) <= _sections(ROOT / command)
    else:
        assert command in {"python", "torchrun", "pytest", "actoffload"}, line


@pytest.mark.parametrize("script", ["scripts/demo", "scripts/test"])
def test_the_first_screen_scripts_exist_parse_and_set_up_first(script):
    """Not run in full: each installs torch into .venv first (minutes on a fresh machine), and
    scripts/test runs this file. Checked: there, executable, valid bash, set up by scripts/setup."""
    assert f"{script}    #" in README  # the README's first block names it
    path = ROOT / script
    assert path.is_file() and os.access(path, os.X_OK), script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert re.search(r"^scripts/setup$", path.read_text(), flags=re.M), f"{script} does not run scripts/setup"


def test_the_demo_the_readme_names_answers_help(tmp_path):
    assert "exec .venv/bin/actoffload demo" in (ROOT / "scripts/demo").read_text()
    out = subprocess.run([sys.executable, "-m", "actoffload", "demo", "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0 and "usage: actoffload demo" in out.stdout, out.stderr[-2000:]


def test_every_pip_line_is_one_checked_here():
    known = {
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "pip install /path/to/actoffload",
        "python -m pip wheel . --no-deps -w dist",
        "pip install dist/actoffload-*.whl",
        "pip install -e '.[test,plot,integrations]'",
    }
    assert set(PIP_LINES) == known, set(PIP_LINES) ^ known


def test_the_cpu_torch_the_readme_names_is_the_one_setup_installs_and_pyproject_allows():
    line = next(x for x in PIP_LINES if x.startswith("pip install torch=="))
    version = re.search(r"torch==(\S+)", line).group(1)
    url = re.search(r"--index-url (\S+)", line).group(1)
    setup = (ROOT / "scripts/setup").read_text()
    assert f"torch=={version}" in setup and url.rstrip("/") in setup
    # (tomllib is Python 3.11's; the project runs on 3.10)
    low, high = re.search(r'^\s*"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).groups()

    def v(s: str) -> tuple[int, ...]:
        return tuple(int(p) for p in s.split("."))

    assert v(low) <= v(version) < v(high), (version, low, high)


def test_the_editable_install_names_extras_that_exist_and_is_what_setup_runs():
    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    for extra in ("test", "plot", "integrations"):
        assert re.search(rf"^{extra} = \[", extras, flags=re.M), (extra, extras)
    assert "pip install --quiet -e '.[test,plot,integrations]'" in (ROOT / "scripts/setup").read_text()


def test_the_wheel_builds_installs_and_works_outside_the_checkout(tmp_path):
    """``pip install /path/to/actoffload`` and ``pip wheel`` build the same wheel: built here
    offline (no build isolation), from a copy of what pyproject packages, installed without
    dependencies (torch is this environment's) into a folder of its own."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("actoffload", "ref", "fast", "triton_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    dist, site = tmp_path / "dist", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run(pip + ["wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(dist), "-q"],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = list(dist.glob("actoffload-*.whl"))
    assert len(wheels) == 1, wheels
    installed = subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), "-q", str(wheels[0])],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _run(
        "import torch, actoffload as ao, actoffload.ref, actoffload.fast, actoffload.triton_kernels, actoffload.budget\n"
        f"assert ao.__file__.startswith({str(site)!r}), ao.__file__\n"
        "blocks = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])\n"
        "off = ao.Offloader(min_offload_bytes=0)\n"
        "with ao.wrap(blocks, off):\n"
        "    blocks(torch.randn(64, 256)).sum().backward()\n"
        "assert off.stats()['offloaded_bytes'] > 0\n"
        "print('ok')\n", elsewhere, pythonpath=site)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ------------------------------------------------------------------ the results table
def _results_section() -> str:
    return README.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]


def _tables(text: str) -> list[list[str]]:
    """Each Markdown table's body rows, in order."""
    tables: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("| ") and not inside:
            tables.append([])  # its header
            inside = True
        elif line.startswith("| ") and not line.startswith("| ---"):
            tables[-1].append(line)
        elif not line.startswith("| "):
            inside = False
    return tables


def _fixed_row(w, verdict):
    """The README's fixed-shape row for one workload of a budget sweep's results: step ms /
    GiB reserved per method, the budget under checkpointing's peak, the range of ratios to the
    fastest alternative that fits (beside which more than save_on_cpu fits), the cells settled
    within ten steps, and the cells with a step over their budget (by the most)."""
    gib = 2 ** 30
    m = w["methods"]

    def method(name):
        return f"{m[name]['step_ms']:.0f} / {m[name]['reserved_peak_bytes'] / gib:.1f}"

    under = next(b for b in w["budgets"] if b.get("under_checkpoint_all") or
                 b["budget_bytes"] == budget_peak(m["checkpoint_all"]) - (1 << 20))
    under_cell = ("no plan fits" if "error" in under else
                  f"{under['step_ms']:.0f} / {under['reserved_peak_bytes'] / gib:.2f} "
                  f"({verdict['below_checkpoint_all_time_ratio']:.2f})")
    ratios = [c["vs_fastest_fitting"] for c in verdict["cells"]
              if c.get("fastest_fitting_alternative") not in (None, "save_on_cpu")]
    settle = verdict["budget_steps_to_settle"]
    over = [max(b["early_reserved_peak_bytes"], b["reserved_peak_bytes"]) - b["budget_bytes"]
            for b in w["budgets"] if "error" not in b]
    over = [o for o in over if o > 0]
    over_cell = f"{len(over)} ({max(over) / gib:.2f} GiB)" if over else "0"
    return [method("none"), method("checkpoint_all"), method("fast"), under_cell,
            f"{min(ratios):.2f}-{max(ratios):.2f}", f"{sum(s <= 10 for s in settle)} of {len(settle)}", over_cell]


def test_the_results_table_is_the_json_it_cites():
    text = _results_section()
    link = re.search(r"\]\((benchmarks/results/[^)]+-budget-sweep\.json)\)", text).group(1)
    data = json.loads((ROOT / link).read_text())
    gpu, commit = data["env"]["gpu"], data["env"]["commit"]
    assert f"**{gpu}**" in text and f"commit {commit}" in text and f"torch {data['env']['torch'][:4]}" in text
    png = re.search(r"!\[[^\]]*\]\((benchmarks/results/[^)]+\.png)\)", text).group(1)
    assert (ROOT / png).is_file() and commit in png and gpu.replace(" ", "-") in png
    rows = _tables(text)[0]
    assert len(rows) == len(data["workloads"])
    for row, w in zip(rows, data["workloads"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        expected = _fixed_row(w, data["verdicts"][w["workload"]])
        assert cells[1:] == expected, (w["workload"], cells[1:], expected)
        # "gradients bitwise equal to no offloading's in every cell"
        assert all(c.get("bitwise", True) for c in data["verdicts"][w["workload"]]["cells"]), w["workload"]


def test_the_loops_table_is_the_json_it_cites():
    """Each row, a workload's loop: no offloading's and checkpointing's loop seconds, then per
    budget level the loop's time x checkpointing's and the steps whose reserved peak went over
    (the smallest reachable led by its budget). Where several runs of a workload are cited,
    each cell gives theirs in the order cited, " / " between them; every workload cited has
    both its loops in the table."""
    text = _results_section()
    links = re.findall(r"\]\((benchmarks/results/[^)]+-loop-sweep(?:-[a-z_-]+)?\.json\.gz)\)", text)
    runs = {link: read_results(ROOT / link) for link in links}
    assert runs and all(data["env"]["commit"] in link for link, data in runs.items())
    rows = _tables(text)[1]
    names = {"decoder": "llama", "GPT-MoE": "gpt_moe", "transformers' Llama": "hf_llama_eager"}
    loops = {"lengths": "variable_length", "accumulation": "accumulation"}
    levels = ("checkpoint_all_peak", "halfway", "none_peak", "checkpoint_all_peak_x1.25", "smallest_reachable")
    assert len(rows) == 2 * len({name for data in runs.values() for name in data["verdicts"]})
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        workload, loop = cells[0].split(", ")
        runs_of = [runs[link]["verdicts"][names[workload]][loops[loop]] for link in links
                   if names[workload] in runs[link]["verdicts"]]
        assert cells[1:3] == [" / ".join(f"{v['methods'][m]['total_s']:.2f}" for v in runs_of)
                              for m in ("none", "checkpoint_all")], row
        for cell, level in zip(cells[3:], levels):
            budgets = [{b["level"]: b for b in v["budgets"]}.get(level) for v in runs_of]
            if budgets[0] is None:
                assert cell == "" and not any(budgets), (row, level)
                continue
            figures = [f"{b['vs_checkpoint_all']:.2f}, {b['steps_over_budget']}" for b in budgets]
            if level == "smallest_reachable":
                sizes = {f"{b['budget_bytes'] / 2**30:.2f}" for b in budgets}
                assert len(sizes) == 1, (row, sizes)  # the table names one budget for its runs
                figures[0] = f"{sizes.pop()} GiB: {figures[0]}"
            assert cell == " / ".join(figures), (row, level, figures)
            assert all(b["bitwise"] for b in budgets), (row, level)


# ------------------------------------------------------------------ links
DOCS = ["README.md", "docs/budgets.md", "docs/compatibility.md", "docs/architecture.md", "docs/semantics.md",
        "benchmarks/README.md", "examples/README.md"]


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", md.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    path = ROOT / doc
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{doc}: {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc}: {target} (no such heading)"
