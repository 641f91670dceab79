"""python -m conformance --impl fast --device cuda --seeds N [--start S] [--scenario JSON]"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from actoffload.tools.arguments import UsageError, out_folder  # noqa: E402
from actoffload.tools.determinism import use_deterministic  # noqa: E402
from actoffload.tools.progress import Progress  # noqa: E402
from actoffload.tools.provenance import git_commit, results_json  # noqa: E402

from .runner import check_seeds, compare, init_worker, minimize  # noqa: E402
from .scenario import Scenario, generate, themes  # noqa: E402


def _ranges(seeds: list[int]) -> list[list[int]]:
    """Sorted seeds as inclusive [first, last] runs: [[0, 1999]] for 0..1999."""
    out: list[list[int]] = []
    for seed in seeds:
        if out and seed == out[-1][1] + 1:
            out[-1][1] = seed
        else:
            out.append([seed, seed])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance", description="fast vs ref vs no offloader, scenario by scenario")
    p.add_argument("--impl", default="fast", choices=["fast", "ref"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--seeds", type=int, default=200, help="how many scenarios")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--scenario", help="run one scenario given as JSON (as printed for a failure)")
    p.add_argument("--no-shrink", action="store_true", help="do not minimize failures")
    p.add_argument("--out", default=None, help="folder for the results JSON (default: conformance/results on CUDA)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes sharing the device")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new scenarios after this long (the first always runs); the results say which "
                        "seeds ran")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda asked for, but CUDA is not available here; use --device cpu")
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.max_seconds is not None and not args.max_seconds >= 0:
        p.error(f"--max-seconds must be at least 0, got {args.max_seconds}")
    if args.out is not None:
        try:  # before the scenarios run, not when their results are written
            out_folder("--out", args.out)
        except UsageError as e:
            p.error(str(e))
    scenario = None
    if args.scenario:
        try:
            scenario = Scenario.from_json(args.scenario)
        except (ValueError, TypeError) as e:  # (json's errors are ValueErrors; an unknown field a TypeError)
            p.error(f"--scenario: not a scenario as a failure prints it ({type(e).__name__}: {e})")
    use_deterministic(True)  # before any scenario touches cuBLAS; workers inherit its environment

    if scenario is not None:
        s = scenario
        problems = compare(s, args.impl)
        print(s)
        print("\n".join(problems) or "passed")
        return 1 if problems else 0

    seeds = list(range(args.start, args.start + args.seeds))
    failures = []
    start = time.time()
    # a worker runs seeds in chunks; with a time limit, one at a time, so that none starts after it
    size = 1 if args.max_seconds is not None else 10
    chunks = [seeds[i : i + size] for i in range(0, len(seeds), size)]
    ran: list[int] = []
    bar = Progress(len(seeds), f"{args.impl} on {args.device}", unit="scenarios", width=30, failures=True, rate=True,
                   log_lines=10)

    def out_of_time() -> bool:
        return args.max_seconds is not None and time.time() - start > args.max_seconds

    if args.jobs > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"), initializer=init_worker) as pool:
            futures = {pool.submit(check_seeds, c, args.device, args.impl): c for c in chunks}
            cut = False
            for f in cf.as_completed(futures):
                if f.cancelled():  # not started before time ran out: not run, not counted
                    continue
                try:
                    failures += f.result()
                except Exception as e:  # a worker died: its seeds count as failed, the rest stand
                    failures += [(seed, [f"crashed: {type(e).__name__}: {e}"]) for seed in futures[f]]
                ran += futures[f]
                bar.update(len(ran), failed=len(failures))
                if not cut and out_of_time():
                    cut = True
                    for other in futures:
                        other.cancel()  # the ones not started; running ones finish and count
    else:
        for c in chunks:
            if ran and out_of_time():  # (the first runs whatever the limit: a run reports something)
                break
            failures += check_seeds(c, args.device, args.impl)
            ran += c
            bar.update(len(ran), failed=len(failures))
    bar.update(len(ran), failed=len(failures))
    bar.close()
    failures = [(generate(seed, args.device), problems) for seed, problems in sorted(failures)]

    for s, problems in failures[:10]:
        print(f"FAILED seed {s.seed}: {s}")
        for line in problems:
            print(f"    {line}")
        print(f"    themes: {', '.join(themes(s)) or '(none)'}")
        if not args.no_shrink:
            small = minimize(s, args.impl)
            print(f"    minimal reproduction: python -m conformance --impl {args.impl} --scenario '{small.to_json()}'")
    elapsed = time.time() - start
    ran.sort()
    by_theme: dict[str, list[int]] = {}  # theme -> [scenarios, failed]
    failed_seeds = {s.seed for s, _ in failures}
    for seed in ran:
        for theme in themes(generate(seed, args.device)) or ["(none)"]:
            counts = by_theme.setdefault(theme, [0, 0])
            counts[0] += 1
            counts[1] += seed in failed_seeds
    if by_theme:
        print(f"{'theme':<36} scenarios  failed")
        for theme, (n, bad) in sorted(by_theme.items()):
            print(f"{theme:<36} {n:>9}  {bad:>6}")
    rows = [("impl", args.impl), ("device", args.device), ("scenarios", len(ran)),
            ("passed", len(ran) - len(failures)), ("failed", len(failures)), ("seconds", f"{elapsed:.1f}")]
    print("\n".join(f"{k:<10} {v}" for k, v in rows))

    out_dir = args.out or (str(Path(__file__).parent / "results") if args.device == "cuda" else None)
    if out_dir:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        result = {
            "device": args.device, "gpu": gpu, "torch": torch.__version__, "impl": args.impl,
            "commit": git_commit(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "scenarios": len(ran), "passed": len(ran) - len(failures), "failed": len(failures),
            "seeds": _ranges(ran), "seconds": round(elapsed, 1),
            "failures": [{"seed": s.seed, "scenario": s.to_json(), "themes": themes(s), "problems": pr} for s, pr in failures],
            "themes": {theme: {"scenarios": n, "failed": bad} for theme, (n, bad) in sorted(by_theme.items())},
        }
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        stem = "-".join([gpu.replace(" ", "-"), result["date"][:10]] + ([result["commit"]] if result["commit"] else []))
        path = Path(out_dir) / f"{stem}-conformance.json"
        path.write_text(results_json(result))
        print(f"wrote {path}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
