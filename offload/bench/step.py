"""bench/step.py: ``python -m offload.bench step --storage nvme``: optimizer steps with state on
disk, and how well the pipeline overlaps I/O with the kernel.

Reported, as medians over --steps steps (the first step, which only writes freshly created
state, is reported apart):
  step        wall time of ``opt.step()`` with NVMe (or mmap) state
  io          the same pipeline reading and writing every bucket without computing (I/O only)
  kernel      an in-RAM ``offload.AdamW`` step on a copy of the same parameters (the kernel alone;
              skipped with --no-ram or when the state would not fit, then the kernel time measured
              inside the NVMe step is used)
  overlap     step / max(io, kernel): 1.0 is perfect overlap, 2.0 is no overlap at all
  peak RSS    the process's peak resident memory, and its growth once parameters and gradients
              exist (what the optimizer itself costs: bounded by --budget)
Parameters are bf16 by default (fp32 master|m|v on disk: 12 B/param); gradients are created
once and reused. ``--moments fp32,8bit`` runs the whole measurement once per moment format
(``offload.AdamW(moments=...)``, the same parameters) and prints each format's step time as a
ratio of the first's (speed target: 8bit <= 0.6x fp32 on NVMe).

The verdict: the step against its ceiling, max(io, kernel) measured in the same run (there is no
peer: no other library steps Adam with the state on disk here). ``--plot PATH`` draws the four
times.

The state file goes into a new directory inside --nvme-dir (default: the system's temporary
directory, e.g. /tmp, which may be RAM-backed: name a directory on the disk you mean), removed at
the end; the directory --nvme-dir names is never deleted.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch

from .. import AdamW
from ..moments.format import FORMATS
from ..plan_args import DTYPES
from ..store import parse_size
from .common import Progress, remove_dirs, scratch_dirs, verdict, write_json

GB = 1e9
# (baseline moments, moments) -> the step-time ratio an NVMe run aims at: 8-bit moments move a
# quarter of the fp32 moments' bytes
NVME_TARGETS = {("fp32", "8bit"): 0.6}
QUESTION = ("How long does one optimizer step take with the state on disk, and how much of the "
            "disk I/O does the pipeline hide behind the kernel?")


def _status(key: str, path: str = "/proc/self/status") -> int:
    with open(path) as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _make(n: int, dtype: torch.dtype, chunk: int = 1 << 26) -> torch.Tensor:
    t = torch.empty(n, dtype=dtype)
    for s in range(0, n, chunk):  # in place, chunk by chunk: no full-size temporary
        t[s:s + chunk].uniform_(-1, 1)
    return t


def _split(n: int, tensors: int) -> list:
    base = n // tensors
    return [base + (1 if i < n % tensors else 0) for i in range(tensors)]


def measure(args, moments: str = "fp32") -> dict:
    n = int(float(args.params))
    dtype = DTYPES[args.dtype]   # a parameter dtype's name
    budget = parse_size(args.budget)
    # never the current directory (the state file is GBs); one new directory per drive, removed at
    # the end
    work = scratch_dirs(args.dir, "offload-step-bench-")
    sizes = _split(n, args.tensors)
    t0 = time.perf_counter()
    params = [_make(k, dtype) for k in sizes]
    for p in params:
        p.grad = _make(p.numel(), dtype)
    setup_s = time.perf_counter() - t0
    model_bytes = sum(p.numel() * p.element_size() * 2 for p in params)
    per_param = (12 if dtype != torch.float32 else 8)
    report = dict(bench="step", question=QUESTION, state=args.state, moments=moments, params=n,
                  tensors=args.tensors, dtype=args.dtype,
                  host_budget=budget, dir=args.dir or tempfile.gettempdir(),
                  params_and_grads_bytes=model_bytes, state_bytes=n * per_param,
                  command="python -m offload.bench step " + " ".join(args.argv))
    progress = Progress(3 * args.steps + 5, f"step bench ({moments} moments)",
                        enabled=not args.no_progress)
    try:
        # ------------------------------------------------ kernel alone: in-RAM step on a copy
        kernel_s = None
        avail = _status("MemAvailable:", "/proc/meminfo")
        if not args.no_ram and n * (per_param + 2 * dtype.itemsize) < 0.5 * avail:
            cp = [p.detach().clone() for p in params]
            for c, p in zip(cp, params):
                c.grad = p.grad
            ram = AdamW(cp, lr=1e-4, moments=moments)
            times = []
            for _ in range(args.steps + 1):
                t = time.perf_counter()
                ram.step()
                times.append(time.perf_counter() - t)
                progress.update("in-RAM step")
            kernel_s = statistics.median(times[1:])
            del ram, cp
        # ------------------------------------------------ NVMe / mmap state
        # torch's first Optimizer() imports ~70 MB of modules: not ours to count
        AdamW([torch.zeros(1)])
        base_rss = _status("VmRSS:")
        reset = _reset_peak()
        opts = {} if args.state == "mmap" else dict(depth=args.depth, queue_depth=args.queue_depth,
                                                     block_size=parse_size(args.block_size))
        dev_opts = {}
        # parameters on a (fake) device: D2H -> kernel -> H2D per bucket
        if args.device_params == "fake":
            from ..device import FakeDevice
            dev_opts = dict(offload_device=FakeDevice(max_delay=0.0, poison=False, check=False))
        t = time.perf_counter()
        opt = AdamW(params, lr=1e-4, storage=args.state,
                    nvme_dir=work if len(work) > 1 else work[0],
                    host_budget=budget, nvme_options=opts,
                    moments=moments, **dev_opts)
        ctor_s = time.perf_counter() - t
        info = opt.storage_info()
        t = time.perf_counter()
        opt.step()
        first_s = time.perf_counter() - t
        steps, tel = [], []
        copies = []
        for _ in range(args.steps):
            before = dict(opt.storage_info())
            t = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - t)
            progress.update(f"{args.state} step")
            st = opt.last_step_stats(wait=True)
            copies.append(max(st["d2h_s"], st["h2d_s"]))
            after = opt.storage_info()
            tel.append({k: after[k] - before[k]
                        for k in ("read_wait_s", "write_wait_s", "kernel_s", "bytes_read",
                                                           "bytes_written")})
        io_s = None
        if args.state == "nvme":
            io_s = statistics.median(_counted(opt.io_only_pass, progress)
                                     for _ in range(max(1, min(3, args.steps))))
        peak = (_status("VmHWM:") if reset
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        in_step_kernel = statistics.median(x["kernel_s"] for x in tel)
        k = kernel_s if kernel_s is not None else in_step_kernel
        step = statistics.median(steps)
        copy_s = statistics.median(copies)
        report.update(
            file_bytes=info["file_bytes"], buckets=info["buckets"], slot_bytes=info["slot_bytes"],
            slots=info["slots"],
            direct=info["direct"], setup_s=setup_s, ctor_s=ctor_s, first_step_s=first_s,
            step_s=step, step_all_s=steps, io_s=io_s, kernel_s=k,
            kernel_source="in-RAM step" if kernel_s is not None
            else "kernel time inside the NVMe step",
            kernel_in_step_s=in_step_kernel,
            read_wait_s=statistics.median(x["read_wait_s"] for x in tel),
            write_wait_s=statistics.median(x["write_wait_s"] for x in tel),
            bytes_per_step=statistics.median(x["bytes_read"] + x["bytes_written"] for x in tel),
            copy_s=copy_s, device_params=args.device_params,
            staging_bytes=info.get("staging_bytes", 0),
            overlap=step / max(io_s, k, copy_s) if io_s is not None else None, peak_rss=peak,
            rss_before_optimizer=base_rss,
            rss_growth=peak - base_rss, peak_rss_exact=reset)
        opt.close()
    finally:
        progress.close()
        remove_dirs(work)
    ceiling = max(x for x in (report["io_s"], report["kernel_s"], report["copy_s"])
                  if x is not None)
    which = ("io only" if ceiling == report["io_s"] else "kernel" if ceiling == report["kernel_s"]
             else "copies")
    report["verdict"] = verdict(report["step_s"], {f"max(io, kernel) = {which}": ceiling},
                                ours_name="the step", label=f"{args.state} state", ceiling=True)
    _print(report)
    return report


def _counted(fn, progress):
    out = fn()
    progress.update("io only")
    return out


def _print(r: dict) -> None:
    gib = 2 ** 30
    print(f"question: {r['question']}")
    print(f"step benchmark: {r['params'] / 1e9:.3f} G {r['dtype']} params in {r['tensors']} "
          f"tensors, state={r['state']}, moments={r['moments']} ({r['file_bytes'] / GB:.2f} GB "
          f"file, {r['buckets']} buckets, O_DIRECT={r['direct']}) in {r['dir']}; host_budget "
          f"{r['host_budget'] / gib:.2f} GiB = {r['slots']} x "
          f"{r['slot_bytes'] / 2**20:.0f} MiB buffers")
    print(f"  {'step (median of ' + str(len(r['step_all_s'])) + ')':<34}{r['step_s']:9.3f} s   "
          f"(first step, state creation only: {r['first_step_s']:.3f} s)")
    if r["io_s"] is not None:
        print(f"  {'io only (read+write all buckets)':<34}{r['io_s']:9.3f} s   "
              f"{r['bytes_per_step'] / r['io_s'] / GB:.2f} GB/s")
    print(f"  {'kernel (' + r['kernel_source'] + ')':<34}{r['kernel_s']:9.3f} s   "
          f"(kernel time inside the NVMe step: {r['kernel_in_step_s']:.3f} s)")
    print(f"  {'waits inside the step':<34}read {r['read_wait_s']:.3f} s, write "
          f"{r['write_wait_s']:.3f} s")
    if r["device_params"] != "none":
        print(f"  {'copies (max of D2H, H2D)':<34}{r['copy_s']:9.3f} s   (device params: "
              f"{r['device_params']}; staging ring {r['staging_bytes'] / 2**20:.1f} MiB)")
    if r["overlap"] is not None:
        print(f"  {'overlap = step / max(io, kernel, copy)':<34}{r['overlap']:9.2f}     (1.00 = "
              "perfect overlap; target <= 1.15)")
    else:
        print(f"  {'step / kernel':<34}{r['step_s'] / r['kernel_s']:9.2f}     (mmap: the page "
              "cache does the I/O inside the kernel's page faults; no separate I/O time)")
    print(f"  {'peak RSS':<34}{r['peak_rss'] / gib:9.2f} GiB (params+grads "
          f"{r['params_and_grads_bytes'] / gib:.2f} GiB; growth once they existed "
          f"{r['rss_growth'] / gib:.3f} GiB vs budget {r['host_budget'] / gib:.2f} GiB)")
    print("verdict (medians of this run; 1.00x: the step takes no longer than its slowest part "
          f"alone):\n  {r['verdict']['line']}")


def run(args) -> int:
    formats = [f.strip() for f in args.moments.split(",") if f.strip()]
    if not formats or any(f not in FORMATS for f in formats):
        raise SystemExit("--moments takes a comma-separated list of fp32, bf16, 8bit; got "
                         f"{args.moments!r}")
    reports = [measure(args, f) for f in formats]
    if len(reports) > 1:
        first = reports[0]
        print(f"moment formats, same run (step time vs moments={first['moments']}):")
        for r in reports[1:]:
            ratio = r["step_s"] / first["step_s"]
            line = (f"  moments={r['moments']}: step {r['step_s']:.3f} s = {ratio:.2f}x, file "
                    f"{r['file_bytes'] / GB:.2f} GB")
            target = NVME_TARGETS.get((first["moments"], r["moments"]))
            if target is not None and args.state == "nvme":
                line += (f"   {'PASS' if ratio <= target else 'MISS'} [speed target] "
                         f"{r['moments']} NVMe step <= {target}x {first['moments']}")
            print(line)
    write_json(args.json,
               reports[0] if len(reports) == 1
               else dict(bench="step", question=QUESTION, runs=reports))
    if args.plot:
        from .plots import grouped_bars
        parts = ("step_s", "io_s", "kernel_s")
        grouped_bars(args.plot, [f"moments={r['moments']}" for r in reports],
                     {k.replace("_s", ""): [r[k] for r in reports] for k in parts},
                     ylabel="seconds (median)", title=f"optimizer step, {args.state} state, "
                                                      f"{reports[0]['params']:,} params")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("step", help="optimizer steps with NVMe/mmap state: step vs "
                                           "I/O vs kernel time",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", dest="state", choices=("nvme", "mmap"), default="nvme",
                   help="where the optimizer state lives, as the optimizer's "
                        "storage= (default nvme)")
    # hidden alias of --storage
    p.add_argument("--state", dest="state", choices=("nvme", "mmap"), help=argparse.SUPPRESS)
    p.add_argument("--params", default="2e8", help="number of parameters (default 2e8)")
    p.add_argument("--tensors", type=int, default=16,
                   help="parameter tensors they are split into (default 16)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--budget", default="512MiB", help="host_budget (default 512MiB)")
    p.add_argument("--depth", type=int, default=2, help="buckets read ahead (default 2)")
    p.add_argument("--queue-depth", type=int, default=8, help="I/O worker threads (default 8)")
    p.add_argument("--block-size", default="1MiB", help="I/O piece size (default 1MiB)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first (default 5)")
    p.add_argument("--nvme-dir", dest="dir", default=None,
                   help="directory on the disk to measure, or several (comma-separated) to "
                        "spread the state over drives; the state goes into a new subdirectory of "
                        "each, removed at the end (default: the system temporary directory, here "
                        f"{tempfile.gettempdir()})")
    p.add_argument("--no-ram", action="store_true", help="skip the in-RAM kernel-only step")
    p.add_argument("--device-params", choices=("none", "fake"), default="none",
                   help="fake: parameters on offload.device.FakeDevice (GPU-params + NVMe path, "
                        "copies on threads)")
    p.add_argument("--moments", default="fp32",
                   help="moment format(s), comma-separated: fp32, bf16, 8bit (default fp32; "
                        "e.g. fp32,8bit)")
    # hidden alias of --nvme-dir
    p.add_argument("--dir", dest="dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", metavar="PATH",
                   help="draw step, io and kernel times as a PNG (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")

    def _run(args):
        import sys
        args.argv = sys.argv[2:] if len(sys.argv) > 2 else []
        return run(args)

    p.set_defaults(func=_run)
