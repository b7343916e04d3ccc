"""bench/plan.py: ``python -m offload.bench plan``: the planner from the command line.

Prints the bytes each place will hold (GPU, host, NVMe) for a parameter count, a GPT-style shape or a
local Hugging Face config.json, whether it fits this machine (and, if not, the first setup that does),
and with ``--time`` or ``--from-json`` the predicted step time; see ``offload.plan`` for the API.
"""
from __future__ import annotations

import argparse
import json

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    t = text.strip().lower().replace("_", "")
    mult = _SUFFIX.get(t[-1:], None)
    try:
        n = float(t[:-1]) * mult if mult else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 350M, 7B, 1.3e9)") from None
    if n < 1:
        raise argparse.ArgumentTypeError("parameter count must be >= 1")
    return int(n)


def parse_transformer(text: str) -> int:
    """'layers,hidden,vocab' -> parameters of a GPT-style decoder (12*L*h^2 + 13*L*h + V*h + h*2)."""
    try:
        layers, hidden, vocab = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("--transformer takes LAYERS,HIDDEN,VOCAB, e.g. 32,4096,32000") from None
    return 12 * layers * hidden * hidden + 13 * layers * hidden + vocab * hidden + 2 * hidden


def _what(args):
    """The plan's subject: a config.json path, or the parameter count split into --tensors tensors."""
    if args.hf_config is not None:
        return args.hf_config
    n = args.params if args.params is not None else parse_transformer(args.transformer)
    if args.tensors <= 1:
        return n
    import torch
    from ..planner import _DTYPES
    dt = _DTYPES[args.param_dtype]
    return [torch.empty(n // args.tensors + (i < n % args.tensors), dtype=dt, device="meta")
            for i in range(args.tensors)]


def _plan(args, bandwidths):
    from ..planner import plan
    return plan(_what(args), device=args.device, param_dtype=args.param_dtype, grad_dtype=args.grad_dtype,
                storage=args.storage, amsgrad=args.amsgrad, world_size=args.world_size, sharding=args.sharding,
                bucket_bytes=int(args.bucket_mb * (1 << 20)), depth=args.depth, host_budget=args.host_budget,
                nvme_dir=args.nvme_dir, staging_slots=args.staging_slots, moments=args.moments,
                moments_min_size=args.moments_min_size, bandwidths=bandwidths, threads=args.threads,
                activation_bytes=int(args.activations_gb * (1 << 30)) if args.activations_gb else None)


def run(args) -> int:
    bandwidths = args.from_json or ("measure" if args.time else None)
    try:
        p = _plan(args, bandwidths)
    except (OSError, ImportError, ValueError) as e:   # a missing file, no transformers, an unusable JSON
        raise SystemExit(f"python -m offload.bench plan: {e}") from None
    print(p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(p.to_dict(), f, indent=1)
    return 0 if all(v is not False for v in p.fits().values()) else 1


def add_parser(subparsers) -> None:
    sp = subparsers.add_parser("plan", help="memory planner: bytes per place and whether it fits",
                               description=__doc__)
    what = sp.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, help="parameter count, e.g. 350M, 7B")
    what.add_argument("--transformer", help="LAYERS,HIDDEN,VOCAB of a GPT-style decoder")
    what.add_argument("--hf-config", metavar="PATH", help="a local Hugging Face config.json (or its folder): the "
                      "model's real tensors, built on the meta device (needs transformers; nothing downloaded)")
    sp.add_argument("--tensors", type=int, default=1, help="split --params/--transformer into this many equal "
                    "tensors (as python -m offload.bench step --tensors; default 1)")
    sp.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    sp.add_argument("--param-dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    sp.add_argument("--grad-dtype", default=None, choices=["fp32", "bf16", "fp16"])
    sp.add_argument("--storage", default=None, choices=["ram", "nvme", "mmap"],
                    help="where the optimizer state lives, as the optimizer's storage= (default: nvme with --nvme-dir, "
                    "else ram)")
    sp.add_argument("--state", dest="storage", choices=["ram", "nvme", "mmap"], help=argparse.SUPPRESS)   # old name
    sp.add_argument("--staging-slots", dest="staging_slots", type=int, default=3,
                    help="device params with NVMe/mmap state: pinned staging ring slots (as nvme_options)")
    sp.add_argument("--amsgrad", action="store_true")
    sp.add_argument("--world-size", type=int, default=1)
    sp.add_argument("--sharding", default="none", choices=["none", "zero1", "fsdp"])
    sp.add_argument("--bucket-mb", type=float, default=32.0)
    sp.add_argument("--depth", type=int, default=2, help="buckets in flight per direction")
    sp.add_argument("--host-budget", default="2GiB", help="NVMe state's host budget (as the optimizer's host_budget)")
    sp.add_argument("--nvme-dir", dest="nvme_dir", default=None,
                    help="where NVMe state would live, one directory or several comma-separated (free space; "
                    "--time measures it)")
    sp.add_argument("--nvme-path", dest="nvme_dir", default=None, help=argparse.SUPPRESS)   # the old spelling
    sp.add_argument("--moments", default="fp32", choices=["fp32", "bf16", "8bit"], help="Adam moment format")
    sp.add_argument("--moments-min-size", type=int, default=4096, help="smaller tensors keep fp32 moments")
    sp.add_argument("--threads", type=int, default=None, help="the optimizer's threads= (default: every CPU)")
    sp.add_argument("--time", action="store_true", help="predict the step time from bandwidths measured here in "
                    "a few seconds (kernel; the --nvme-dir disk with --storage nvme; PCIe with a GPU)")
    sp.add_argument("--from-json", metavar="PATHS", default=None, help="predict the step time from saved "
                    "python -m offload.bench kernel/io --json files (comma-separated) instead of measuring")
    sp.add_argument("--activations-gb", type=float, default=None, help="your activation memory estimate")
    sp.add_argument("--json", default=None, help="also write the plan as JSON")
    sp.set_defaults(func=run)
