"""Command line: ``actoffload demo`` and ``actoffload bench`` (also ``python -m actoffload``)."""

from __future__ import annotations

import argparse
import sys

from . import bench, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actoffload", description="Activation offloading for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser(
        "demo", help="train a small GPT(-MoE) without and with offloading, side by side"))
    bench.add_arguments(sub.add_parser(
        "bench", help="measure copies, training steps and hooks; write the results JSON",
        description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return {"demo": demo.run, "bench": bench.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
