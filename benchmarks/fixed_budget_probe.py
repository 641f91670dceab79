"""The loop sweep's loops at fixed budgets (a diagnostic, not a test): where the cache is given
back and how many steps go over, at a budget of one's choosing rather than the levels the
sweep derives from its own runs.

After the sweep's warm-up, checkpointing every block runs the loop, then a fresh offloader under
the budget; per run it prints the loop's seconds, the steps whose reserved peak went over the
budget, the offloader's cache trims and, for the lengths loop, each step's length and reserved
peak (``!`` where over). The default cases are two the loop sweep met: the GPT-MoE's lengths at
6.67 GiB (its smallest reachable level at 99cd1c9) and the decoder's accumulation at 8.13 GiB
(checkpointing's reserved peak there).

    PYTHONPATH=. python benchmarks/fixed_budget_probe.py [--case gpt_moe:lengths:6.67 ...] > OUT-log.txt
"""

from __future__ import annotations

import argparse

import torch

from actoffload.tools import loop_sweep as ls

GIB = 1 << 30


def _report(rec: dict, budget: int, lengths_loop: bool) -> None:
    trims = [p.get("cache_trims") for p in rec["plan_steps"] if p]
    why = [p.get("cache_trims_by") for p in rec["plan_steps"] if p]
    peaks = rec["reserved_bytes"] if lengths_loop else [r["reserved_bytes"] for r in rec["records"]]
    over = sum(r > budget for r in peaks)
    print(f"  {rec['total_s']:.2f} s, {over} of {len(peaks)} over, cache trims {trims[-1] if trims else None} "
          f"({why[-1] if why else None}), "
          f"most reserved {max(peaks) / GIB:.2f} GiB")
    if lengths_loop:
        print("  ", " ".join(f"{n}:{r / GIB:.2f}{'!' if r > budget else ''}" for n, r in zip(rec["lengths"], peaks)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", metavar="WORKLOAD:LOOP:GIB",
                   help="llama or gpt_moe, lengths or accumulation, the budget in GiB (repeatable; default: "
                        "gpt_moe:lengths:6.67 and llama:accumulation:8.13)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fixed_budget_probe needs a CUDA GPU: what it measures is the caching allocator's")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for case in a.case or ["gpt_moe:lengths:6.67", "llama:accumulation:8.13"]:
        name, loop_name, gib = case.split(":")
        lengths_loop = loop_name == "lengths"
        w = getattr(ls, name)(device, False)
        loop = ls._Loop(w, lambda line: None)
        lengths = ls.draw_lengths(w.seq_len, 48, 0)
        with loop.peaks:
            ls._warm_up(loop, lengths)

            def run(m: ls.Method) -> dict:
                return ls.run_variable(loop, m, lengths) if lengths_loop else ls.run_accumulation(loop, m, 20)

            ck = run(ls.Method("checkpoint_all", checkpoint=True))
            print(f"{name} {loop_name}: checkpointing every block {ck['total_s']:.2f} s, most reserved "
                  f"{ck['max_reserved_bytes'] / GIB:.2f} GiB")
            budget = int(float(gib) * GIB)
            print(f"{name} {loop_name}: budget {float(gib):.2f} GiB")
            _report(run(ls.Method("fast_budget", budget=budget, level="fixed")), budget, lengths_loop)
        del w, loop
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
