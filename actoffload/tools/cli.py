"""Command line: ``actoffload demo`` and ``actoffload bench`` (also ``python -m actoffload``).

The parser imports no torch (``--help`` answers at once); each command's module, and
torch with it, is imported only once its arguments are checked.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from .arguments import (BENCH_DESCRIPTION, DEMO_DESCRIPTION, UsageError, add_bench_arguments, add_demo_arguments,
                        check_bench, check_demo)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``actoffload`` parser and its subcommands' parsers, by name.

    Example::

        parser, commands = build_parser()
        parser.parse_args(["demo", "--device", "cpu"]).command   # 'demo'
    """
    parser = argparse.ArgumentParser(prog="actoffload", description="Activation offloading for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench}")
    raw = argparse.RawDescriptionHelpFormatter  # keeps the descriptions' example lines
    commands = {
        "demo": sub.add_parser("demo", help="train a small GPT(-MoE) without and with offloading, side by side",
                               description=DEMO_DESCRIPTION, formatter_class=raw),
        "bench": sub.add_parser("bench", help="measure copies, training steps and hooks; write the results JSON",
                                description=BENCH_DESCRIPTION, formatter_class=raw),
    }
    add_demo_arguments(commands["demo"])
    add_bench_arguments(commands["bench"])
    return parser, commands


def _run_demo(opts: Any) -> int:
    from . import demo

    return demo.run(opts)


def _run_bench(opts: Any) -> int:
    from . import bench

    return bench.run(opts)


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], Any], Callable[[Any], int]]] = {
    "demo": (check_demo, _run_demo),
    "bench": (check_bench, _run_bench),
}


def main(argv: list[str] | None = None) -> int:
    """Parse, check every argument, then run the command; a bad argument exits with status 2.

    Example::

        main(["demo", "--device", "cpu", "--steps", "2"])
    """
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    check, run = COMMANDS[args.command]
    try:
        opts = check(args)
    except UsageError as e:  # reported as argparse reports its own errors
        commands[args.command].print_usage(sys.stderr)
        print(f"{commands[args.command].prog}: error: {e}", file=sys.stderr)
        raise
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
