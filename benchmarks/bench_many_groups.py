"""Many tiny groups in one forward: the offloader's cost per group, against no offloader.

Each case runs in a fresh subprocess (so its memory is its own): a chain of ``--groups`` tiny
steps (``h = h * 1.0001``, which saves nothing: an empty group; or ``h = h.sin()``, which saves
``h``: a tiny group), each step its own group, forward and backward, several times. It prints
the mean CPU time of a step against the same steps without an offloader, and how much the
process grew while the graph of one forward lived (RSS), for:

- ``empty``: groups that save nothing;
- ``tiny``: groups that save one tensor of ``--floats`` floats, too small to move at the
  default ``min_offload_bytes`` (nothing moves);
- ``tiny-moved``: the same with ``min_offload_bytes=0`` (every save moves: 10,000 groups of
  32 floats move 1.25 MiB);
- ``one-name``: tiny groups all opened under one name (``name``, ``name#2``, ...).

Beside ``ref`` and ``fast``, ``--impls`` takes two references: ``save_on_cpu`` (PyTorch's own
hooks, entered per group) and ``least``: per group a pair of saved-tensor hooks holding
each save as ``(alias, version, group)``, about the least any offloader written in Python
can keep (a version for R6, a group for backward to reach).

The RSS growth is the first forward's (what the process holds for one graph, one-time
allocations included); the time is the mean of
``--steps`` steps run back to back as a training loop runs them, with the collector's own
collections in them: each object a step holds until its backward brings the next full
collection nearer, a cost every implementation in Python pays (``least`` too). (A collection
asked for before each timed step would instead empty the interpreter's free lists and
arenas, and charge the allocations after it.)

CPU time, not wall time: the ratio should not depend on what else the machine runs.

    .venv/bin/python benchmarks/bench_many_groups.py                  # 10,000 groups, ref and fast
    .venv/bin/python benchmarks/bench_many_groups.py --groups 2000 --impls fast --cases tiny-moved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("empty", "tiny", "tiny-moved", "one-name")

_CHILD = r"""
import gc, json, os, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
import actoffload as ao

impl, case, groups, floats, steps = {impl!r}, {case!r}, {groups}, {floats}, {steps}
torch.set_num_threads(1)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

off = None
if impl in ("ref", "fast"):
    kw = {{"min_offload_bytes": 0}} if case == "tiny-moved" else {{}}
    if impl == "fast":
        kw["warmup"] = "offload"
    off = ao.Offloader(impl=impl, device="cpu", **kw)
names = ["g"] * groups if case == "one-name" else [str(i) for i in range(groups)]

class _Group:  # the least a group can be: a name, and whether backward reached it
    __slots__ = ("name", "reached")
    def __init__(self, name):
        self.name, self.reached = name, False

def _least_hooks(name):  # each save held as (alias, version, group): what R6 and stats need at least
    group = _Group(name)
    def pack(t):
        return t.detach(), t._version, group
    def unpack(packed):
        packed[2].reached = True
        return packed[0]
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

def forward(x):
    h = x * 1
    if off is None:
        for name in names:
            if impl == "none":
                h = h * 1.0001 if case == "empty" else h.sin()
                continue
            with (_least_hooks(name) if impl == "least" else torch.autograd.graph.save_on_cpu()):
                h = h * 1.0001 if case == "empty" else h.sin()
        return h
    for name in names:
        with off.group(name):
            h = h * 1.0001 if case == "empty" else h.sin()
    return h

# what the process grew by while the first forward's graph lived
gc.collect()
before = rss()
y = forward(torch.randn(floats, requires_grad=True))
grew = rss() - before
moved = off.stats()["offloaded_bytes"] if off is not None else 0
y.sum().backward()
del y
forward(torch.randn(floats, requires_grad=True)).sum().backward()  # one more, untimed
# then steps as a training loop runs them: no collection asked for, the collector's own included
t0 = time.process_time()
for step in range(steps):
    forward(torch.randn(floats, requires_grad=True)).sum().backward()
times = [(time.process_time() - t0) / steps]
print(json.dumps({{"step_s": statistics.fmean(times), "grew": grew, "moved": moved,
                   "host": off.stats()["host_bytes_in_use"] if off is not None else 0}}))
"""


def run_case(impl: str, case: str, groups: int, floats: int, steps: int, root: str = ROOT) -> dict:
    code = _CHILD.format(root=root, impl=impl, case=case, groups=groups, floats=floats, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=10_000)
    p.add_argument("--floats", type=int, default=32, help="floats in each tiny group's saved tensor")
    p.add_argument("--steps", type=int, default=10, help="timed forward+backward steps per case")
    p.add_argument("--impls", nargs="+", default=["ref", "fast"])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--root", default=ROOT, help="the checkout whose actoffload runs (to compare commits)")
    args = p.parse_args(argv)
    rows = []
    print(f"{args.groups:,} groups, {args.floats} floats per tiny save, mean of {args.steps} steps (CPU time)")
    print(f"{'case':11s} {'impl':5s} {'step':>9s} {'x none':>7s} {'RSS grew':>10s} {'moved':>10s}")
    for case in args.cases:
        base = run_case("none", case, args.groups, args.floats, args.steps, args.root)
        print(f"{case:11s} {'none':5s} {base['step_s'] * 1e3:7.1f}ms {1:7.2f} {base['grew'] / 2**20:7.1f}MiB {0:>10}")
        for impl in args.impls:
            r = run_case(impl, case, args.groups, args.floats, args.steps, args.root)
            ratio = r["step_s"] / base["step_s"]
            print(f"{case:11s} {impl:5s} {r['step_s'] * 1e3:7.1f}ms {ratio:7.2f} {r['grew'] / 2**20:7.1f}MiB "
                  f"{r['moved']:>10,}")
            rows.append({"case": case, "impl": impl, "groups": args.groups, "ratio": ratio, **r,
                         "none_step_s": base["step_s"], "none_grew": base["grew"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)  # compact: results files are committed (actoffload.tools.provenance.results_json)


if __name__ == "__main__":
    main()
