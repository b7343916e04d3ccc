"""offload.bench: the standalone throughput benchmarks behind ``python -m offload.bench``.

Each subcommand lives in its own module (``step-cost``: stepcost.py), exposing
``add_parser(subparsers)``; the parser it adds sets ``func`` to a callable taking the parsed
``argparse.Namespace`` and returning an exit code.
"""
SUBCOMMANDS = ("kernel", "io", "step", "stepcost", "train", "plan", "fidelity", "gpu")
