"""What a forward let go without a backward pass costs a memory budget (a diagnostic, not a
test), on the loop sweep's decoder at its full length: a batch skipped after its forward (``del
loss``) and an evaluation with gradients on in ``eval()`` (its loss read and dropped), each
between two training steps of a settled plan.

Checkpointing every block runs first, for its reserved peak; the budget is ``--share`` times it.
Then ``--steps`` training steps under the budget, the forwards let go after steps 12, 18 and 24
(skipped, evaluated, skipped); for each training step it prints the wall time, the controller's
state, the reserved peak and whether it went over the budget; at the end the mean step time
before the first forward let go and after it, the steps not settled after it, and the steps over.

    PYTHONPATH=.:benchmarks python benchmarks/skipped_batch_probe.py [--device cpu] > OUT-log.txt
"""

from __future__ import annotations

import argparse
import statistics

import torch

import actoffload as ao
from actoffload.tools import loop_sweep
from forced_llama import loop_decoder

LET_GO = {12: "skipped", 18: "evaluated", 24: "skipped"}  # after the training step of that index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--share", type=float, default=1.25, help="the budget, as a share of checkpointing's reserved peak")
    a = p.parse_args(argv)
    if a.steps <= max(LET_GO) + 1 or a.share <= 0:
        p.error(f"--steps takes more than {max(LET_GO) + 1}, --share a positive number")
    w = loop_decoder(a.device, "skipped_batch_probe")
    loop = loop_sweep._Loop(w, print)
    loop_sweep._warm_up(loop, [w.seq_len])
    tokens = [w.tokens(i, w.seq_len) for i in range(4)]

    with loop.method(loop_sweep.Method("checkpoint_all", checkpoint=True)):
        for i in range(3):
            _, _, reserved, _ = loop.timed(lambda: w.loss(loop_sweep._checkpointed, tokens[i % 4]).backward())
    budget = int(a.share * (reserved or 0)) if w.device.type == "cuda" else 1 << 40
    print(f"checkpointing's reserved peak {(reserved or 0) / 2**30:.2f} GiB; budget {budget / 2**30:.2f} GiB")

    rows = []
    with loop.method(loop_sweep.Method("budget", budget=budget)) as off:
        assert off is not None
        for i in range(a.steps):
            _, s, reserved, _ = loop.timed(lambda: w.loss(loop_sweep.plain, tokens[i % 4]).backward())
            state = off.stats()["plan"]["state"]
            over = reserved is not None and reserved > budget
            rows.append((s, state, over))
            print(f"step {i:3d} {s * 1e3:7.1f} ms  {state:11s} reserved {(reserved or 0) / 2**30:6.2f} GiB"
                  f"{'  over' if over else ''}", flush=True)
            if i in LET_GO:
                if LET_GO[i] == "evaluated":
                    w.model.eval()
                loss = w.loss(loop_sweep.plain, tokens[(i + 1) % 4])
                if LET_GO[i] == "evaluated":
                    loss.item()
                    w.model.train()
                del loss
                print(f"         a forward {LET_GO[i]} and let go", flush=True)
    first = min(LET_GO)
    before = [s for s, _, _ in rows[first - 4:first + 1]]
    after = rows[first + 1:]
    print(f"mean step before the first forward let go {statistics.mean(before) * 1e3:.1f} ms, "
          f"after it {statistics.mean(s for s, _, _ in after) * 1e3:.1f} ms; steps after it not settled: "
          f"{sum(st != 'settled' for _, st, _ in after)} of {len(after)}; steps over the budget: "
          f"{sum(o for _, _, o in rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
