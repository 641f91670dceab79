"""A plain (not editable) install works, alone and from the checkout root, where the
checkout's actoffload/ shadows the installed one and must still find ref/ and fast/."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import actoffload as ao, torch; from actoffload.ref import RefOffloader; "
         "from actoffload.fast import FastOffloader; import actoffload.budget.controller, actoffload.tools.models; "
         "off = ao.Offloader(impl='fast', device='cpu'); print(type(off).__module__, ao.__file__)")


# one install for both tests: under pytest-xdist (scripts/test), both on one worker, and kept for
# the session there (a worker may run other modules' tests between them)
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    # built from a copy of what pyproject.toml packages: a build in the checkout walks all of it,
    # virtual environments included, and fails where one is being written meanwhile
    # (scripts/test-oldest-torch --install-only beside the tests)
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("actoffload", "ref", "fast", "triton_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = tmp_path_factory.mktemp("site")
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return target


@pytest.mark.parametrize("where", ["elsewhere", "checkout_root"])
def test_plain_install_imports_every_part(installed, tmp_path, where):
    cwd = tmp_path if where == "elsewhere" else ROOT
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env={"PYTHONPATH": str(installed), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    module, package_file = out.stdout.split()
    assert module == "actoffload.fast.offloader"
    assert Path(package_file).is_relative_to(installed if where == "elsewhere" else ROOT)
