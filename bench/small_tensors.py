"""bench/small_tensors.py: the per-tensor cost of offload.AdamW.step() on many small tensors, per
moment format (fp32 | bf16 | 8bit) and state tier (ram | nvme | mmap), next to torch's fused AdamW.

A step over thousands of small tensors is dominated by what the optimizer does per tensor in
Python (validation, bookkeeping), not by the kernel. Cases (host fp32 parameters, persistent
gradients, the same values in every run):
  small: 2000 tensors of 256 elements + 20 of 8192 (the 8192-element ones get compressed moments)
  rows:  10000 tensors of 1024 elements
Each configuration: its own optimizer, warm-up steps, then the median of --reps timed step() calls;
"us/tensor" is that median divided by the number of tensors. Run it on an otherwise idle CPU:

    python bench/small_tensors.py --json out.json
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import offload  # noqa: E402
from offload.bench.common import add_common_options, cpu_model, format_table, machine_info, median, write_json  # noqa: E402

CASES = {"small": [(2000, 256), (20, 8192)], "rows": [(10000, 1024)]}


def make_params(case: str):
    gen = torch.Generator().manual_seed(0)
    params, grads = [], []
    for count, n in CASES[case]:
        for _ in range(count):
            params.append(torch.nn.Parameter(torch.randn(n, generator=gen)))
            grads.append(torch.randn(n, generator=gen) * 0.01)
    for p, g in zip(params, grads):
        p.grad = g   # persistent: the same gradient objects every step (as with zero_grad(set_to_none=False))
    return params


def time_steps(opt, warmup: int, reps: int) -> tuple:
    """(median step seconds, median seconds of it spent waiting on NVMe I/O: 0 without)."""
    for _ in range(warmup):
        opt.step()
    times, io = [], []
    stats = getattr(opt, "last_step_stats", None)
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        st = stats() if stats is not None else None
        io.append(float((st or {}).get("nvme_s", 0.0)))
    return median(times), median(io)


def run_one(case: str, label: str, make, warmup: int, reps: int) -> dict:
    params = make_params(case)
    opt = make(params)
    try:
        gc.collect()
        step_s, io_s = time_steps(opt, warmup, reps)
    finally:
        close = getattr(opt, "close", None)
        if close is not None:
            close()
    return dict(case=case, config=label, tensors=len(params), elements=sum(p.numel() for p in params),
                step_ms=step_s * 1e3, io_wait_ms=io_s * 1e3, us_per_tensor=step_s * 1e6 / len(params),
                us_per_tensor_excl_io=(step_s - io_s) * 1e6 / len(params))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(ap, reps=7, what="steps")
    ap.add_argument("--cases", default="small,rows", help="comma list of: " + ", ".join(CASES))
    ap.add_argument("--moments", default="fp32,bf16,8bit")
    ap.add_argument("--states", default="ram,nvme,mmap")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where nvme/mmap state files go (default /tmp)")
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: the library default)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.optim.AdamW(fused=True)")
    args = ap.parse_args(argv)
    if args.threads:
        offload.kernels.set_num_threads(args.threads)
    info = offload.build_info()
    print(f"CPU: {cpu_model()}  |  kernel ISA: {info['isa']} (available: {', '.join(info['available_isas'])})"
          f"  |  threads: {offload.kernels.get_num_threads()}  |  torch {torch.__version__}")
    workdir = tempfile.mkdtemp(prefix="offload-small-", dir=args.dir)
    results = []
    try:
        for case in args.cases.split(","):
            configs = []
            for state in args.states.split(","):
                for mom in args.moments.split(","):
                    opts = dict(moments=mom)
                    if state != "ram":
                        opts.update(state=state, nvme_dir=os.path.join(workdir, f"{case}-{state}-{mom}"))

                    def make(ps, opts=opts):
                        if "nvme_dir" in opts:
                            os.makedirs(opts["nvme_dir"], exist_ok=True)
                        return offload.AdamW(ps, lr=1e-3, weight_decay=0.01, **opts)
                    configs.append((f"{mom} {state}", make))
            if not args.no_torch:
                configs.append(("torch AdamW(fused=True)",
                                lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)))
            for label, make in configs:
                r = run_one(case, label, make, args.warmup, args.reps)
                results.append(r)
                if not args.no_progress:
                    print(f"  {case:5s} {label:24s} {r['step_ms']:9.2f} ms", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for case in args.cases.split(","):
        rows = [r for r in results if r["case"] == case]
        base = next((r for r in rows if r["config"] == "fp32 ram"), None)
        n, el = rows[0]["tensors"], rows[0]["elements"]
        print(f"\ncase {case}: {n} tensors, {el} elements, median of {args.reps} steps")
        print(format_table(["config", "step ms", "us/tensor", "x fp32 ram", "I/O wait ms", "us/tensor excl. I/O"],
                           [[r["config"], f"{r['step_ms']:.2f}", f"{r['us_per_tensor']:.2f}",
                             f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-", f"{r['io_wait_ms']:.2f}",
                             f"{r['us_per_tensor_excl_io']:.2f}"] for r in rows]))
    write_json(args.json, dict(machine=machine_info(), build=info, reps=args.reps, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
