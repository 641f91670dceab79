"""Where a figure came from: device, versions, date and commit, for every results file."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def git_commit() -> str | None:
    """The checked-out commit of the source tree this package runs from, if it is one.

    ``ACTOFFLOAD_COMMIT`` overrides it, for copies of a tree whose .git is not current."""
    if os.environ.get("ACTOFFLOAD_COMMIT"):
        return os.environ["ACTOFFLOAD_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe(device: torch.device) -> dict:
    """GPU (or "cpu"), torch, triton, CUDA and Python versions, UTC date, commit."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device": str(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def write_results(path: str | Path, doc: Any) -> None:
    """Write a results file whole or not at all (a run stopped while writing keeps the last
    one): compact JSON (:func:`results_json`), gzip-compressed where ``path`` ends in ``.gz``
    (a training loop's results, one figure a step, are ten times smaller so).

    Example::

        write_results("loop-sweep.json.gz", {"env": describe(device), "cells": cells})
    """
    path = str(path)
    text = results_json(doc).encode()
    Path(path + ".part").write_bytes(gzip.compress(text, mtime=0) if path.endswith(".gz") else text)
    os.replace(path + ".part", path)


def read_results(path: str | Path) -> Any:
    """A results file as :func:`write_results` wrote it (gzip-compressed where it ends in ``.gz``).

    Example::

        doc = read_results("benchmarks/results/NVIDIA-H200-...-loop-sweep-llama.json.gz")
    """
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)


def results_json(doc: Any) -> str:
    """A results file's text: compact JSON. Results are committed, and the repository travels
    whole to the GPU machine, whose tool carries at most 64 MiB (indented, the loop sweeps'
    files were half as large again).

    Example::

        Path("sweep.json").write_text(results_json({"env": describe(device), "cells": cells}))
    """
    return json.dumps(no_nan(doc), separators=(",", ":"), default=float)


def no_nan(value: Any) -> Any:
    """``value`` with every float NaN as ``None``: JSON has no NaN (Python writes a bare ``NaN``,
    which other readers refuse).

    >>> no_nan({"gbps": float("nan"), "runs": [1.0, float("nan")]})
    {'gbps': None, 'runs': [1.0, None]}
    """
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [no_nan(v) for v in value]
    return value
