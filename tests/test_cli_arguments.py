"""The command line checks every argument before any work: a bad one exits with status 2 and a
one-line message naming it, like argparse's own errors; ``--help`` answers without torch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import actoffload as ao
from actoffload.ops import ROLES
from actoffload.tools import arguments, bench, cli, demo

ROOT = Path(__file__).resolve().parent.parent
CPU = ["demo", "--device", "cpu"]


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """Any training or measuring started by a test here fails it: checks come first."""

    def started(*args, **kwargs):
        raise AssertionError("the command started working before its arguments were checked")

    for module, name in [(demo, "run"), (demo, "train"), (bench, "run"), (bench, "measure")]:
        monkeypatch.setattr(module, name, started)


def _usage_error(argv, capsys) -> str:
    """The message of the usage error ``argv`` raises (status 2, printed as argparse does)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: actoffload ") and f"actoffload {argv[0]}: error: {e.value}\n" in err
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("extra, message", [
    (["--batch", "0"], "--batch: at least 1, got 0"),
    (["--keep-last", "-1"], "--keep-last: at least 0, got -1"),
    (["--steps", "1"], "--steps: at least 2 on cpu"),
    (["--steps", "-3"], "--steps: at least 2 on cpu"),
    (["--seq-len", "0"], "--seq-len: at least 1, got 0"),
    (["--d-model", "0"], "--d-model: at least 1, got 0"),
    (["--d-model", "130"], "--d-model 130: must be a multiple of its 4 attention heads"),
    (["--layers", "0"], "--layers: at least 1, got 0"),
    (["--experts", "-1"], "--experts: at least 0, got -1"),
    (["--top-k", "0"], "--top-k: at least 1, got 0"),
    (["--top-k", "5"], "--top-k 5: more than --experts 4 (the default on cpu)"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3: more than --experts 2;"),
    (["--min-offload-bytes", "-1"], "--min-offload-bytes: at least 0, got -1"),
    (["--impl", "bogus"], "--impl: unknown configuration(s) ['bogus']; valid ones are: save_on_cpu, ref, fast"),
    (["--impl", "ref,,fast"], "--impl: empty name in 'ref,,fast'"),
    (["--impl", "ref,ref"], "--impl: ref given more than once"),
    (["--offload-modules", "moe_act,bogus"], "--offload-modules: unknown role(s) ['bogus']; valid roles are: attn_"),
    (["--policy", "marked"], "--policy marked: offloads only the roles given with --offload-modules"),
    (["--experts", "0", "--policy", "marked", "--offload-modules", "moe_act,qkv"],
     "--offload-modules: ['moe_act'] are roles of the experts, and --experts 0 builds the dense GPT"),
    (["--plot", "/nonexistent/dir/p.png"], "--plot /nonexistent/dir/p.png: folder '/nonexistent/dir' does not exist"),
])
def test_demo_refuses_a_bad_argument_before_training(extra, message, capsys):
    assert _usage_error(CPU + extra, capsys).startswith(message)


def test_demo_marked_policy_says_what_to_add(capsys):
    assert "add --offload-modules ROLE[,ROLE]" in _usage_error(CPU + ["--policy", "marked"], capsys)
    opts = arguments.check_demo(cli.build_parser()[0].parse_args(
        CPU + ["--policy", "marked", "--offload-modules", "moe_act"]))
    assert opts.roles == {"moe_act"} and opts.policy == "marked"


@pytest.mark.parametrize("device", ["mps", "cuda:x", "cpu:0", "xla"])
def test_demo_supports_only_cpu_and_cuda(device, capsys):
    assert _usage_error(["demo", "--device", device], capsys) == (
        f"--device {device}: not supported; only cpu and cuda (or cuda:N) are")


def test_demo_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _usage_error(["demo", "--device", "cuda"], capsys) == (
        "--device cuda: no CUDA GPU is visible here; use --device cpu")


def test_demo_plot_folder_and_file_are_checked(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install 'actoffload[plot]')")
    assert "is a folder" in _usage_error(CPU + ["--plot", str(tmp_path)], capsys)
    assert "must end in a format matplotlib writes, such as .png" in _usage_error(
        CPU + ["--plot", str(tmp_path / "p.xyz")], capsys)
    monkeypatch.setattr(arguments, "can_write_in", lambda folder: False)  # root may write anywhere
    assert "cannot write there (no permission" in _usage_error(CPU + ["--plot", str(tmp_path / "p.png")], capsys)


def test_demo_plot_without_matplotlib_fails_before_training(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert "pip install 'actoffload[plot]'" in _usage_error(CPU + ["--plot", str(tmp_path / "p.png")], capsys)


def test_argparse_errors_have_the_same_status(capsys):
    for argv in (CPU + ["--batch", "x"], CPU + ["--policy", "some"], ["bench", "--nope"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2


def test_demo_checked_options_fill_in_the_device_defaults():
    opts = arguments.check_demo(cli.build_parser()[0].parse_args(CPU + ["--impl", "fast", "--batch", "3"]))
    assert opts.device == "cpu" and opts.batch == 3 and opts.d_model == arguments.CPU_DEFAULTS["d_model"]
    assert opts.configs == (("none", None), ("none (again)", None), ("fast", "fast"))


@pytest.mark.parametrize("extra, message", [
    (["--only", "nope"], "--only: unknown section(s) ['nope']; valid ones are: bandwidth"),
    (["--only", "steps,,hooks"], "--only: empty name in 'steps,,hooks'"),
])
def test_bench_refuses_a_bad_section(extra, message, capsys):
    assert _usage_error(["bench"] + extra, capsys).startswith(message)


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("dir", "cannot read"),
    ("not json", "is not JSON"),
    (b"\xff\xfe\x00", "is not JSON"),
    ('{"a": 1}', "is not a results file of 'actoffload bench'"),
    ('[1, 2]', "is not a results file of 'actoffload bench'"),
    ('{"env": {"date": "2026-11-30"}, "workloads": []}', "another tool's"),  # a sweep's results
    ('{"env": {"date": null}, "quick": true}', "is not a results file of 'actoffload bench'"),
])
def test_bench_refuses_a_bad_compare_file(tmp_path, content, message, capsys):
    path = tmp_path / "old.json"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert _usage_error(["bench", "--compare", str(path)], capsys).startswith("--compare: ")
    assert message in _usage_error(["bench", "--compare", str(path)], capsys)


def test_bench_refuses_an_out_folder_it_cannot_make(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    assert "cannot make this folder" in _usage_error(["bench", "--out", str(tmp_path / "file" / "sub")], capsys)
    monkeypatch.setattr(arguments, "can_write_in", lambda folder: False)
    assert "no permission" in _usage_error(["bench", "--out", str(tmp_path / "new")], capsys)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="a file system that takes no files: Linux's /proc")
def test_bench_without_out_checks_the_default_folder_before_the_work(monkeypatch, capsys):
    """(The whole bench ran, then its results could not be written.)"""
    monkeypatch.chdir("/proc")
    assert "the default folder" in _usage_error(["bench", "--only", "hooks"], capsys)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="a file system that takes no files: Linux's /proc")
def test_an_out_path_is_tried_not_judged_by_its_permission_bits():
    """Permission bits say yes to root, and /proc's say a folder may be written: making a file
    there, before the work, says no (where otherwise the results were lost after the run)."""
    with pytest.raises(arguments.UsageError, match="cannot write there"):
        arguments.out_file("--out", "/proc/results.json")
    with pytest.raises(arguments.UsageError, match="cannot write in '/proc'"):
        arguments.out_folder("--out", "/proc/results")


def test_an_out_file_that_exists_is_left_as_it_was(tmp_path):
    target = tmp_path / "old.json"
    target.write_text("kept")
    assert arguments.out_file("--out", str(target)) == str(target)
    assert target.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]


def test_bench_out_folder_is_made_only_when_results_are_written(tmp_path):
    opts = arguments.check_bench(cli.build_parser()[0].parse_args(["bench", "--out", str(tmp_path / "a" / "b")]))
    assert opts.out == tmp_path / "a" / "b" and not opts.out.exists()


# ---------------------------------------------------------------------------- help
def _options(command: str):
    return [a for a in cli.build_parser()[1][command]._actions if a.dest != "help"]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_every_option_has_a_help_text_with_its_default(command):
    for action in _options(command):
        assert action.help and "default" in action.help, action.option_strings


def test_device_dependent_defaults_name_both_devices():
    for action in _options("demo"):
        if action.dest in arguments.CPU_DEFAULTS:
            assert "on CPU" in action.help and "on CUDA" in action.help, action.option_strings


def test_help_text_is_plain():
    parser, commands = cli.build_parser()
    for p in [parser, *commands.values()]:
        assert "``" not in p.format_help()


def test_help_lists_match_the_core():
    assert arguments.IMPL_NAMES == tuple(ao.IMPLS)
    assert arguments.ROLE_NAMES == tuple(ROLES)


def _imported(*args: str) -> set[str]:
    """The modules a fresh ``python -X importtime *args`` imports."""
    out = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: actoffload")
    return {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"]], ids=["actoffload", "demo", "bench"])
def test_help_imports_no_torch(command):
    imported = _imported("-m", "actoffload", *command, "--help")
    assert "actoffload.tools.arguments" in imported  # the driver works: it sees the parser's modules
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
