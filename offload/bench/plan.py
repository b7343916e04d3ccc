"""bench/plan.py: ``python -m offload.bench plan``: the planner from the command line.

Prints the bytes each place will hold (GPU, host, NVMe) for a parameter count, a GPT-style shape or
a local Hugging Face config.json, whether it fits this machine (and, if not, the first setup that
does), and with ``--time`` or ``--from-json`` the predicted step time; see ``offload.plan`` for the
API.
"""
from __future__ import annotations

import argparse
import json
import math
from decimal import Decimal, InvalidOperation

from ..plan_args import DTYPES, MAX_COUNT, MAX_TENSORS

_SUFFIX = {"k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "g": 10 ** 9, "t": 10 ** 12}
_Bad = argparse.ArgumentTypeError   # argparse prints "argument --flag: <message>"
_MOST = f"more than one tensor holds (at most {MAX_COUNT:,} elements)"


def _whole(text: str, noun: str, examples: str) -> int:
    """A whole number >= 1 from '350M', '7B', '1.3e9', '100_000' (suffixes k, M, B/G, T)."""
    t = text.strip().lower().replace("_", "")
    mult = _SUFFIX.get(t[-1:])
    try:
        d = Decimal(t[:-1] if mult else t) * (mult or 1)
    except InvalidOperation:
        d = None
    if d is None or not d.is_finite() or d < 1 or d != d.to_integral_value():
        raise _Bad(f"{text!r} is not a {noun} (a whole number >= 1, e.g. {examples})")
    if d > MAX_COUNT:
        raise _Bad(f"{text!r} is {_MOST}")
    return int(d)


def parse_count(text: str) -> int:
    """--params: a parameter count."""
    return _whole(text, "parameter count", "350M, 7B, 1.3e9")


def parse_tensors(text: str) -> int:
    """--tensors: how many equal tensors, at most the planner's MAX_TENSORS."""
    n = _whole(text, "tensor count", "16, 1k")
    if n > MAX_TENSORS:
        raise _Bad(f"{n:,} tensors: the planner lays out at most {MAX_TENSORS:,}")
    return n


def parse_transformer(text: str) -> int:
    """'layers,hidden,vocab' -> parameters of a GPT-style decoder (12Lh^2 + 13Lh + Vh + 2h)."""
    try:
        layers, hidden, vocab = (int(x) for x in text.split(","))
    except ValueError:
        layers = hidden = vocab = 0
    if min(layers, hidden, vocab) < 1:
        raise _Bad(f"{text!r}: give LAYERS,HIDDEN,VOCAB as three whole numbers >= 1, "
                   "e.g. 32,4096,32000")
    n = 12 * layers * hidden * hidden + 13 * layers * hidden + vocab * hidden + 2 * hidden
    if n > MAX_COUNT:
        raise _Bad(f"{text!r}: {n:,} parameters, {_MOST}")
    return n


def _number(unit: str, positive: bool):
    """An argparse type: a finite float, > 0 and at least one byte (``positive``), or >= 0."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < 0 or (positive and int(v * (1 << 20)) < 1):
            raise _Bad(f"{text!r} is not a {'positive ' if positive else ''}number of {unit}"
                       f"{' (at least one byte)' if positive else ' >= 0'}")
        return v
    return parse


def _gpu_state(text: str):
    """--gpu-state: auto, 0 or a size."""
    from ..plan_args import gpu_state
    try:
        return gpu_state("auto" if text == "auto" else 0 if text.strip() == "0" else text)
    except (TypeError, ValueError) as e:
        raise _Bad(str(e)) from None


def _paths(text: str) -> str:
    if not any(p.strip() for p in text.split(",")):
        raise _Bad(f"{text!r} names no file (give python -m offload.bench kernel/io --json "
                   "files, comma-separated)")
    return text


def _what(args):
    """The plan's subject: a config.json path, or the parameter count split into --tensors
    equal tensors (on the meta device)."""
    if args.hf_config is not None:
        if args.tensors is not None:
            args.error("--tensors applies to --params and --transformer (a config.json has "
                       "its own tensors)")
        return args.hf_config
    n = args.params if args.params is not None else args.transformer
    k = args.tensors or 1
    if k > n:
        args.error(f"--tensors {k}: more tensors than the {n:,} parameters")
    if k == 1:
        return n
    import torch
    dt = DTYPES[args.param_dtype]
    return [torch.empty(n // k + (i < n % k), dtype=dt, device="meta") for i in range(k)]


def _plan(args, bandwidths):
    from ..planner import plan
    return plan(_what(args), device=args.device, param_dtype=args.param_dtype,
                grad_dtype=args.grad_dtype,
                storage=args.storage, amsgrad=args.amsgrad, world_size=args.world_size,
                sharding=args.sharding,
                bucket_bytes=int(args.bucket_mb * (1 << 20)), depth=args.depth,
                host_budget=args.host_budget,
                nvme_dir=args.nvme_dir, staging_slots=args.staging_slots, moments=args.moments,
                moments_min_size=args.moments_min_size, bandwidths=bandwidths,
                threads=args.threads,
                activation_bytes=int(args.activations_gb * (1 << 30)) if args.activations_gb
                else None,
                backward_s=None if args.backward_ms is None else args.backward_ms / 1e3,
                forward_s=None if args.forward_ms is None else args.forward_ms / 1e3,
                gpu_state=args.gpu_state)


def run(args) -> int:
    """Print the plan: exit status 0 (it fits), 1 (it does not), 2 (a bad input: one line on
    stderr)."""
    bandwidths = args.from_json or ("measure" if args.time else None)
    try:
        p = _plan(args, bandwidths)
    except (OSError, ImportError, ValueError) as e:   # a bad value or file, no transformers
        args.error(str(e))
    print(p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(p.to_dict(), f, indent=1)
    return 0 if all(v is not False for v in p.fits().values()) else 1


def _one_line_errors(parser: argparse.ArgumentParser):
    """``parser.error`` printing one line (no usage block: --help shows it); exit status 2."""
    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    parser.error = error
    return error


def add_parser(subparsers) -> None:
    sp = subparsers.add_parser("plan", help="memory planner: bytes per place and whether it fits",
                               description=__doc__)
    what = sp.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, help="parameter count, e.g. 350M, 7B")
    what.add_argument("--transformer", type=parse_transformer,
                      help="LAYERS,HIDDEN,VOCAB of a GPT-style decoder")
    what.add_argument("--hf-config", metavar="PATH", help="a local Hugging Face config.json (or "
                                                          "its folder): the model's real tensors, "
                                                          "built on the meta device (needs "
                                                          "transformers; nothing downloaded)")
    sp.add_argument("--tensors", type=parse_tensors, default=None,
                    help="split --params/--transformer into this many equal tensors (as python -m "
                    f"offload.bench step --tensors; default 1, at most {MAX_TENSORS:,})")
    sp.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda if present")
    sp.add_argument("--param-dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    sp.add_argument("--grad-dtype", default=None, choices=["fp32", "bf16", "fp16"])
    sp.add_argument("--storage", default=None, choices=["ram", "nvme", "mmap"],
                    help="where the optimizer state lives, as the optimizer's storage= (default: "
                         "nvme with --nvme-dir, else ram)")
    # hidden alias of --storage
    sp.add_argument("--state", dest="storage", choices=["ram", "nvme", "mmap"],
                    help=argparse.SUPPRESS)
    sp.add_argument("--staging-slots", dest="staging_slots", type=int, default=3,
                    help="device params with NVMe/mmap state: pinned staging ring slots "
                         "(as nvme_options)")
    sp.add_argument("--amsgrad", action="store_true")
    sp.add_argument("--world-size", type=int, default=1)
    sp.add_argument("--sharding", default="none", choices=["none", "zero1", "fsdp"])
    sp.add_argument("--bucket-mb", type=_number("MiB", True), default=32.0)
    sp.add_argument("--depth", type=int, default=2, help="buckets in flight per direction")
    sp.add_argument("--host-budget", default="2GiB",
                    help="NVMe state's host budget (as the optimizer's host_budget)")
    sp.add_argument("--nvme-dir", dest="nvme_dir", default=None,
                    help="where NVMe state would live, one directory or several comma-separated "
                         "(free space; --time measures it)")
    # hidden alias of --nvme-dir
    sp.add_argument("--nvme-path", dest="nvme_dir", default=None, help=argparse.SUPPRESS)
    sp.add_argument("--moments", default="fp32", choices=["fp32", "bf16", "8bit"],
                    help="Adam moment format")
    sp.add_argument("--moments-min-size", type=int, default=4096,
                    help="smaller tensors keep fp32 moments")
    sp.add_argument("--threads", type=int, default=None,
                    help="the optimizer's threads= (default: every CPU)")
    sp.add_argument("--time", action="store_true", help="predict the step time from bandwidths "
                                                        "measured here in a few seconds (kernel; "
                                                        "the --nvme-dir disk with --storage nvme; "
                                                        "PCIe with a GPU)")
    sp.add_argument("--from-json", metavar="PATHS", type=_paths, default=None,
                    help="predict the step time from saved python -m offload.bench kernel/io "
                    "--json files (comma-separated) instead of measuring")
    sp.add_argument("--activations-gb", type=_number("GiB", False), default=None,
                    help="your activation memory estimate")
    sp.add_argument("--backward-ms", type=_number("milliseconds", False), default=None,
                    help="with --time or --from-json and --device cuda: your measured backward, "
                         "to predict the iteration with the state --gpu-state lets stay on the "
                         "GPU (and with none)")
    sp.add_argument("--forward-ms", type=_number("milliseconds", False), default=None,
                    help="your measured forward (added to the predicted iteration)")
    sp.add_argument("--gpu-state", default="auto", type=_gpu_state,
                    help="the optimizer's gpu_state=: auto (default: the GPU's free memory less "
                         "the plan's GPU bytes and a margin), a size such as 8GiB, or 0")
    sp.add_argument("--json", default=None, help="also write the plan as JSON")
    sp.set_defaults(func=run, error=_one_line_errors(sp))
