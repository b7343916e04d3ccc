"""bench/__main__.py: entry point of ``python -m offload.bench``: dispatches to the subcommand
modules.

With no subcommand it runs ``kernel`` on its default sizes (about 30 s on 2 cores).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import SUBCOMMANDS
from .common import output_path_problem


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m offload.bench",
                                     description="offload throughput benchmarks (ours vs peers vs "
                                                 "physical limits)")
    sub = parser.add_subparsers(dest="command")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"offload.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"offload.bench.{name}":
                continue  # subcommand not built in this version
            raise
        mod.add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["kernel"] + argv
    args, extra = parser.parse_known_args(argv)
    error = getattr(args, "error", None) or parser.error   # a subcommand may report its own errors
    if extra:
        error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    for flag in ("json", "plot"):  # fail now, not after the run
        path = getattr(args, flag, None)
        problem = output_path_problem(path) if path else None
        if problem:
            error(f"--{flag} {path}: {problem}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
