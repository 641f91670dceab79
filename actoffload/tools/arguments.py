"""The arguments of ``actoffload demo`` and ``actoffload bench``: definitions, defaults and checks.

Importing this module imports no torch, so ``--help`` answers at once; the checks import
what they need, and every one of them runs before the command does any work. A bad
argument raises :class:`UsageError` (exit status 2, like argparse's own errors) with a
one-line message that names it.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Names the help text lists. The core owns them (ao.IMPLS, actoffload.ops.ROLES); copies
# here keep --help free of torch, and tests/test_cli_arguments.py keeps them equal.
IMPL_NAMES = ("ref", "fast")
ROLE_NAMES = ("attn_norm", "qkv", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act", "expert_fc2")
BASELINES = ("save_on_cpu",)  # what users would use otherwise, beside our implementations
SECTIONS = ("bandwidth", "copies", "sweep", "steps", "bitwise", "hooks", "budgets")
DEFAULT_SECTIONS = SECTIONS[:-1]  # the budget sweep is long (about 10 min on an H100): asked for by name

CPU_DEFAULTS = dict(d_model=128, layers=4, n_heads=4, seq_len=64, batch=8, vocab=512, steps=4, experts=4)
CUDA_DEFAULTS = dict(d_model=1024, layers=8, n_heads=16, seq_len=1024, batch=8, vocab=8192, steps=8, experts=8)
LEAST_STEPS = {"cpu": 2, "cuda": 4}  # warm-up, timed, profiled, measured; the CPU shows no times

DEMO_DESCRIPTION = """\
Train a small GPT-MoE without and with offloading, side by side: no offload (twice, to
show the run is deterministic), torch.autograd.graph.save_on_cpu, ref and fast. The table
says whether every loss matched no offload bit for bit, bytes offloaded per step,
activations resident after forward, peak GPU memory, step time and the achieved bus
bandwidth. On a machine without a GPU it trains a small configuration, with host memory
standing in for GPU memory.
"""

BENCH_DESCRIPTION = """\
Measure fast against the bus, against no offload and against its peers.

  actoffload bench                      on a GPU: the whole matrix (about 4 min on an H100)
  actoffload bench --quick              small sizes (CPU or GPU): checks that it runs
  actoffload bench --compare OLD.json   then print the change of every figure
  actoffload bench --only budgets       the memory-budget sweep (about 10 min on an H100)

Writes <gpu>-<date>-<commit>.json into --out (-2, -3, ... where that file is there: no
run's results are overwritten) and prints a summary. Every ratio is of
figures measured side by side in this one run on this one card; the pinned-copy
bandwidth is measured first and everything is compared with it.
"""


class UsageError(SystemExit):
    """A bad command-line argument: exit status 2, as argparse gives; ``str()`` is the message.

    Example::

        raise UsageError("--batch: at least 1, got 0")
    """

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _defaults(name: str, unit: str = "") -> str:
    cpu, cuda = CPU_DEFAULTS[name], CUDA_DEFAULTS[name]
    if cpu == cuda:
        return f"default: {cpu}{unit} on CPU and on CUDA"
    return f"default: {cpu}{unit} on CPU, {cuda}{unit} on CUDA"


# ---------------------------------------------------------------------------- definitions
def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``actoffload demo``, each with its help and defaults.

    Example::

        p = argparse.ArgumentParser()
        add_demo_arguments(p)
        p.parse_args(["--device", "cpu", "--steps", "2"])
    """
    configs = ", ".join(BASELINES + IMPL_NAMES)
    p.add_argument("--device", default=None,
                   help="cpu or cuda (or cuda:N) (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--impl", default=None, metavar="NAME[,NAME]",
                   help=f"configurations to train beside no offload, from: {configs} (default: all)")
    p.add_argument("--steps", type=int, metavar="N", default=None,
                   help="training steps per configuration: warm-up, timed, one profiled, one measured; at least "
                        f"{LEAST_STEPS['cpu']} on CPU, {LEAST_STEPS['cuda']} on CUDA ({_defaults('steps')})")
    p.add_argument("--batch", type=int, metavar="N", default=None, help=f"sequences per step ({_defaults('batch')})")
    p.add_argument("--seq-len", type=int, metavar="N", default=None,
                   help=f"tokens per sequence ({_defaults('seq_len')})")
    p.add_argument("--d-model", type=int, metavar="N", default=None,
                   help=f"model width, a multiple of the attention heads: {CPU_DEFAULTS['n_heads']} heads on CPU, "
                        f"width / 64 on CUDA ({_defaults('d_model')})")
    p.add_argument("--layers", type=int, metavar="N", default=None,
                   help=f"transformer blocks, one offload group each ({_defaults('layers')})")
    p.add_argument("--experts", type=int, metavar="N", default=None,
                   help=f"experts per block; 0: the dense GPT ({_defaults('experts')})")
    p.add_argument("--top-k", type=int, metavar="N", default=2,
                   help="experts each token goes to, at most --experts (default: 2)")
    p.add_argument("--keep-last", type=int, metavar="N", default=1,
                   help="last blocks left on the device, since backward needs them first (default: 1)")
    p.add_argument("--min-offload-bytes", type=int, metavar="BYTES", default=1 << 20,
                   help="saved tensors smaller than this stay on the device (default: 1048576, 1 MiB)")
    p.add_argument("--offload-modules", default="", metavar="ROLE[,ROLE]",
                   help=f"offload only these roles' saved tensors in the modules that have them, from: "
                        f"{', '.join(ROLE_NAMES)} (default: none; with --policy marked, exactly these)")
    p.add_argument("--policy", default="all", choices=["all", "marked"],
                   help="all: every eligible saved tensor moves; marked: only the roles of --offload-modules "
                        "(default: all)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also write memory over one step per configuration and bytes offloaded per group "
                        "(needs matplotlib: pip install 'actoffload[plot]') (default: no plot)")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``actoffload bench``, each with its help and defaults.

    Example::

        p = argparse.ArgumentParser()
        add_bench_arguments(p)
        p.parse_args(["--quick", "--only", "steps,hooks"])
    """
    p.add_argument("--quick", action="store_true",
                   help="small sizes: check that it runs (always so without a GPU) (default: off)")
    p.add_argument("--out", default=None, metavar="FOLDER",
                   help="folder for the results JSON, made if missing (default: benchmarks/results when run "
                        "from a checkout, else the current folder)")
    p.add_argument("--only", default="", metavar="SECTION[,SECTION]",
                   help=f"sections to run, from: {', '.join(SECTIONS)}; sweep is left out with --quick; "
                        "budgets is the memory-budget sweep against checkpointing and save_on_cpu "
                        "(default: all but budgets)")
    p.add_argument("--compare", metavar="OLD.json", default=None,
                   help="then print the change of every figure against this results file of an earlier "
                        "'actoffload bench' (default: no comparison)")


# ---------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class DemoOptions:
    """``actoffload demo``'s arguments, checked, with the device's defaults filled in."""

    device: str
    configs: tuple[tuple[str, str | None], ...]  # (row name, None | "save_on_cpu" | impl)
    steps: int
    batch: int
    seq_len: int
    d_model: int
    n_heads: int
    layers: int
    experts: int
    top_k: int
    vocab: int
    keep_last: int
    min_offload_bytes: int
    policy: str
    roles: frozenset[str]
    plot: str | None


@dataclass(frozen=True)
class BenchOptions:
    """``actoffload bench``'s arguments, checked; ``old``: the ``--compare`` file's results."""

    sections: frozenset[str]
    quick: bool
    out: Path
    compare: str | None
    old: dict[str, Any] | None


def _names(flag: str, value: str) -> list[str]:
    names = value.split(",")
    if any(not n.strip() for n in names):
        raise UsageError(f"{flag}: empty name in {value!r}; separate names with single commas")
    names = [n.strip() for n in names]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(f"{flag}: {', '.join(dupes)} given more than once")
    return names


def _at_least(flag: str, value: int, least: int, why: str = "") -> int:
    if value < least:
        raise UsageError(f"{flag}: at least {least}{why}, got {value}")
    return value


def _device(value: str | None) -> str:
    import torch

    if value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = value.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise UsageError(f"--device {value}: not supported; only cpu and cuda (or cuda:N) are")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {value}: no CUDA GPU is visible here; use --device cpu")
        if colon and int(index) >= torch.cuda.device_count():
            raise UsageError(f"--device {value}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return value


def out_file(flag: str, path: str) -> str:
    """A results file that can be written (its folder exists, it is no folder itself), checked
    before the work rather than when its results are saved.

    Example::

        out_file("--out", "results/x.json")    # "results/x.json", or UsageError naming the problem
    """
    target = Path(path)
    folder = target.parent
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {path}: {str(folder)!r} is a file, not a folder")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: folder {str(folder)!r} does not exist")
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name in it")
    if not can_write_in(folder) or (target.exists() and not _can_append(target)):
        raise UsageError(f"{flag} {path}: cannot write there (no permission, or a file system that takes no files)")
    return path


def can_write_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder``, by making one (and removing it): permission bits
    say yes to root, and to file systems that take no files (``/proc``).

    >>> can_write_in(Path("/proc")), can_write_in(Path(tempfile.gettempdir()))
    (False, True)
    """
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".actoffload-check-"):
            return True
    except OSError:
        return False


def _can_append(target: Path) -> bool:
    """Whether the existing file ``target`` opens for writing (appending nothing: it is not changed)."""
    try:
        with open(target, "ab"):
            return True
    except OSError:
        return False


def plot_file(path: str) -> str:
    """``--plot``'s file: one matplotlib can write (:func:`out_file`, in a format it writes, and
    it installed), checked before minutes of training rather than after."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--plot {path}: is a folder; give a file name such as {target / 'demo.png'}")
    out_file("--plot", path)
    try:
        import matplotlib  # noqa: F401  (first: a submodule already imported would not fail)
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib, an optional extra: pip install 'actoffload[plot]' "
                         "(or pip install matplotlib), or leave out --plot") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if target.suffix.lstrip(".").lower() not in formats:
        raise UsageError(f"--plot {path}: the file name must end in a format matplotlib writes, such as .png "
                         f"(one of: {', '.join('.' + f for f in sorted(formats))})")
    return path


def check_demo(args: argparse.Namespace) -> DemoOptions:
    """``actoffload demo``'s parsed arguments, checked; raises :class:`UsageError` for the first bad one.

    Example::

        opts = check_demo(parser.parse_args(["--device", "cpu", "--batch", "4"]))
        opts.d_model   # 128, the CPU default
    """
    device = _device(args.device)
    cuda = device.startswith("cuda")
    defaults = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else defaults[name]  # noqa: E731
    where = "cuda" if cuda else "cpu"
    least = LEAST_STEPS[where]
    steps = _at_least("--steps", pick("steps"), least,
                      f" on {where} (warm-up, timed steps, one profiled, one measured)")
    batch = _at_least("--batch", pick("batch"), 1)
    seq_len = _at_least("--seq-len", pick("seq_len"), 1)
    d_model = _at_least("--d-model", pick("d_model"), 1)
    n_heads = max(1, d_model // 64) if cuda else defaults["n_heads"]
    if d_model % n_heads:
        heads = "width / 64 on CUDA" if cuda else "always so on CPU"
        raise UsageError(f"--d-model {d_model}: must be a multiple of its {n_heads} attention heads ({heads})")
    layers = _at_least("--layers", pick("layers"), 1)
    experts = _at_least("--experts", pick("experts"), 0)
    top_k = _at_least("--top-k", args.top_k, 1)
    if experts and top_k > experts:
        given = "" if args.experts is not None else f" (the default on {where})"
        raise UsageError(f"--top-k {top_k}: more than --experts {experts}{given}; each token goes to top-k "
                         "different experts")
    keep_last = _at_least("--keep-last", args.keep_last, 0)
    min_bytes = _at_least("--min-offload-bytes", args.min_offload_bytes, 0)

    from ..ops import ROLES
    from ..settings import IMPLS

    chosen = _names("--impl", args.impl) if args.impl else list(BASELINES + IMPLS)
    unknown = [k for k in chosen if k not in BASELINES + IMPLS]
    if unknown:
        raise UsageError(f"--impl: unknown configuration(s) {unknown}; valid ones are: {', '.join(BASELINES + IMPLS)}")
    roles = _names("--offload-modules", args.offload_modules) if args.offload_modules else []
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise UsageError(f"--offload-modules: unknown role(s) {unknown}; valid roles are: {', '.join(ROLES)}")
    from ..ops import GroupedMLP

    absent = [r for r in roles if r in GroupedMLP.offload_roles] if not experts else []
    if absent:
        raise UsageError(f"--offload-modules: {absent} are roles of the experts, and --experts 0 builds the dense "
                         "GPT, which has none; give --experts N or other roles")
    if args.policy == "marked" and not roles:
        raise UsageError("--policy marked: offloads only the roles given with --offload-modules, and none were "
                         "given, so nothing would move; add --offload-modules ROLE[,ROLE] (e.g. moe_act,expert_fc1) "
                         "or use --policy all")
    return DemoOptions(
        device=device, configs=(("none", None), ("none (again)", None)) + tuple((k, k) for k in chosen),
        steps=steps, batch=batch, seq_len=seq_len, d_model=d_model, n_heads=n_heads, layers=layers,
        experts=experts, top_k=top_k, vocab=defaults["vocab"], keep_last=keep_last, min_offload_bytes=min_bytes,
        policy=args.policy, roles=frozenset(roles), plot=plot_file(args.plot) if args.plot is not None else None,
    )


def _out_folder(out: str | None) -> Path:
    """The results folder: it exists and is writable, or the nearest folder above it that
    exists is (the folder is made only when the results are written)."""
    if out is None:
        checkout = Path("benchmarks/results")
        default = checkout if checkout.is_dir() else Path(".")
        if not can_write_in(default):
            raise UsageError(f"cannot write the results in {str(default.resolve())!r}, the default folder (no "
                             "permission, or a file system that takes no files); give one with --out DIR")
        return default
    return out_folder("--out", out)


def out_folder(flag: str, out: str) -> Path:
    """A results folder that exists and is writable, or can be made: the nearest folder above it
    that exists is one, and writable (it is made only when the results are written).

    Example::

        out_folder("--out", "results/today")    # Path("results/today"), or UsageError naming the problem
    """
    folder = Path(out)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {out}: cannot make this folder: {str(existing)!r} is a file")
    if not can_write_in(existing):
        raise UsageError(f"{flag} {out}: cannot write in {str(existing)!r} (no permission, or a file system "
                         "that takes no files)")
    return folder


def check_bench(args: argparse.Namespace) -> BenchOptions:
    """``actoffload bench``'s parsed arguments, checked (``--compare``'s file read and checked too).

    Example::

        opts = check_bench(parser.parse_args(["--only", "steps"]))
        opts.sections   # frozenset({'steps'})
    """
    sections = _names("--only", args.only) if args.only else list(DEFAULT_SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise UsageError(f"--only: unknown section(s) {unknown}; valid ones are: {', '.join(SECTIONS)}")
    out = _out_folder(args.out)
    old = None
    if args.compare is not None:
        from .bench import load_results

        try:
            old = load_results(args.compare)
        except ValueError as e:
            raise UsageError(f"--compare: {e}") from None
    return BenchOptions(sections=frozenset(sections), quick=args.quick, out=out, compare=args.compare, old=old)
