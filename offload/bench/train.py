"""bench/train.py: ``python -m offload.bench train`` - a few training steps of a small GPT, offload
vs peers.

Variants, all from the same initial weights and batches, in one run:
  torch-fused      torch.optim.AdamW(fused=True) with parameters and state on the device (the peer
                   that needs no offload, where it fits)
  offload-overlap  offload.AdamW, state in (pinned) host RAM, buckets stepped during backward,
                   uploads overlapped with the next forward
  offload-clip     the same with max_grad_norm (the step waits for all gradients; copies still
                   overlap)
  offload-sync     the non-overlapped schedule: everything inside step()
  offload-nvme     (with --storage nvme|mmap) device params with state in that tier, stepped
                   during backward; its optimizer span (first bucket ready -> end of step()) vs
                   max(I/O-only pass, kernel, copies) of the same run, and host buffers vs
                   host_budget
For each: median over repetitions of the mean iteration time, exposed offload time per iteration
(training thread / compute stream blocked on offload work), D2H and H2D GB/s achieved (bytes moved
/ copy time) next to a pinned-copy probe measured in the same run (the physical ceiling), and peak
device memory. On a machine without CUDA the device is the fake device of offload/device/fake.py
(copies are host memcpy on background threads, no PCIe) and the table says so. The verdict: the
fastest offload variant's iteration time against torch-fused's (the peer) of the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref

import torch

from ..plan_args import DTYPES
from .common import Progress, remove_dirs, scratch_dirs, verdict
from .gpt import GPT, PRESETS, GPTConfig, param_groups, random_batch

__all__ = ["add_parser", "main", "run"]

QUESTION = ("How long is a training iteration of a small GPT with offload's optimizer (state in "
            "host RAM or on disk, copies overlapped or not), against "
            "torch.optim.AdamW(fused=True) with everything on the device?")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_probe(device, nbytes: int, reps: int = 9, pinned: bool = True) -> dict:
    """GB/s of one host <-> device copy of ``nbytes`` (median of ``reps``; pinned host memory
    unless ``pinned=False``)."""
    n = max(nbytes // 2, 1)
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.bfloat16, pin_memory=pinned)
        dev = torch.empty(n, dtype=torch.bfloat16, device=device)
        out = {}
        for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
            times = []
            for _ in range(reps + 1):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            out[name] = n * 2 / statistics.median(times[1:]) / 1e9
        return out
    # pages touched
    src, dst = torch.ones(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    times = []
    prev = torch.get_num_threads()
    # one memcpy stream, like one copy engine (and no OpenMP barrier on a busy host)
    torch.set_num_threads(1)
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    bw = n * 2 / statistics.median(times[1:]) / 1e9
    return {"d2h": bw, "h2d": bw}


def _make_optimizer(variant: str, model, device, args):
    groups = param_groups(model, 0.1)
    if variant == "torch-fused":
        return torch.optim.AdamW(groups, lr=args.lr, fused=True), None
    import offload
    from offload.device import CudaDevice, FakeDevice
    dev = (CudaDevice(device) if device.type == "cuda"
           else FakeDevice(max_delay=0.0, poison=False, check=False))
    opts = dict(bucket_mb=args.bucket_mb, offload_device=dev)
    if variant == "offload-nvme":
        # one per drive, removed with the device
        dirs = scratch_dirs(args.nvme_dir, "offload-train-bench-")
        weakref.finalize(dev, remove_dirs, dirs)
        return offload.AdamW(groups, lr=args.lr, storage=args.state,
                             nvme_dir=dirs if len(dirs) > 1 else dirs[0],
                             host_budget=args.host_budget, **opts), dev
    opts["trace"] = bool(args.trace)
    if variant == "offload-overlap":
        return offload.AdamW(groups, lr=args.lr, **opts), dev
    if variant == "offload-clip":
        return offload.AdamW(groups, lr=args.lr, max_grad_norm=1.0, **opts), dev
    if variant == "offload-sync":
        return offload.AdamW(groups, lr=args.lr, overlap=False, **opts), dev
    raise ValueError(variant)


def make_optimizer(variant: str, model, device, args):
    """(optimizer, offload Device or None) of one variant, as the table builds it (used by
    gpu_check)."""
    return _make_optimizer(variant, model, device, args)


def run_variant(variant: str, cfg: GPTConfig, device, dtype, args, progress=None) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    from .step import _reset_peak, _status
    exact_peak = _reset_peak()
    rss0 = _status("VmRSS:")
    try:
        opt, dev = _make_optimizer(variant, model, device, args)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # e.g. does not fit
        return {"variant": variant, "error": str(e).splitlines()[0]}
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(cfg, args.batch, device, gen) for _ in range(4)]
    stats = {}
    per_iter = []

    def one(i):
        idx, tgt = batches[i % len(batches)]
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if hasattr(opt, "last_step_stats"):
            st = opt.last_step_stats()
            if st is not None:
                stats[st["step"]] = st
        return loss

    try:
        for i in range(args.warmup):
            one(i)
        _sync(device)
        for r in range(args.reps):
            t0 = time.perf_counter()
            for i in range(args.steps):
                one(i)
            _sync(device)
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            per_iter.append((time.perf_counter() - t0) / args.steps)
            if progress is not None:
                progress.update(f"{variant} rep {r + 1}")
    except torch.cuda.OutOfMemoryError as e:
        return {"variant": variant, "error": "out of memory: " + str(e).splitlines()[0]}
    res = {"variant": variant, "iter_s": statistics.median(per_iter), "iter_s_all": per_iter,
           "rss_growth": (_status("VmHWM:") if exact_peak else _status("VmRSS:")) - rss0}
    if stats:
        steady = [s for k, s in sorted(stats.items()) if k > args.warmup]
        res["exposed_s"] = statistics.median(s["exposed_s"] for s in steady) if steady else None
        for k in ("d2h", "h2d"):
            byt = sum(s[f"{k}_bytes"] for s in steady)
            sec = sum(s[f"{k}_s"] for s in steady)
            res[f"{k}_gbps"] = byt / sec / 1e9 if sec > 0 else None
        res["kernel_s"] = statistics.median(s["kernel_s"] for s in steady) if steady else None
    if device.type == "cuda":
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    if args.trace and hasattr(opt, "export_chrome_trace"):
        path = f"{args.trace}.{variant}.json"
        opt.export_chrome_trace(path)
        res["trace"] = path
    if dev is not None:
        if variant == "offload-nvme":
            res.update(_nvme_figures(opt, res))
        opt.close()
        dev.close()   # made here: release pinned memory and stream threads
    return res


def _nvme_figures(opt, res: dict) -> dict:
    """Step time vs max(NVMe I/O, kernel, copies), all measured in this run, and host memory vs
    budget."""
    io = statistics.median(opt.io_only_pass() for _ in range(3))
    st = opt.last_step_stats(wait=True)
    copy = max(st["d2h_s"], st["h2d_s"])
    bound = max(io, st["kernel_s"], copy)
    info = opt.storage_info()
    # bound: the time step() held the training thread vs the longest of the three kinds of work,
    # had they run back to back. Stepped during backward, most of the work runs while backward
    # does; the optimizer's span (first bucket ready -> end of step(), it includes waiting for
    # backward) is shown too.
    step = st["exposed_s"]
    return {"io_s": io, "step_s": step, "span_s": st.get("pipeline_s", step), "copy_s": copy,
            "bound": step / bound,
            "host_budget": info["host_budget"], "rss_growth": res.get("rss_growth"),
            "host_bytes": info["slots"] * info["slot_bytes"] + info.get("staging_bytes", 0)}


def run(args) -> dict:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    cfg = PRESETS[args.preset if args.preset else ("125m" if device.type == "cuda" else "small")]
    if args.seq:
        cfg = GPTConfig(**{**cfg.__dict__, "seq": args.seq})
    dtype = DTYPES[args.dtype]   # a parameter dtype's name
    nparams = sum(p.numel() for p in GPT(cfg).parameters())
    probe = copy_probe(device, int(args.bucket_mb * 2 ** 20))
    rows = []
    variants = [v for v in args.variants.split(",")
                if not (v == "offload-nvme" and args.state == "ram")]
    progress = Progress(len(variants) * args.reps, "train bench", enabled=not args.no_progress)
    for v in variants:
        rows.append(run_variant(v, cfg, device, dtype, args, progress))
    progress.close()
    return {"bench": "train", "question": QUESTION, "verdict": train_verdict(rows),
            "device": str(device), "fake_device": device.type != "cuda", "params": nparams,
            "config": cfg.__dict__, "dtype": args.dtype, "batch": args.batch,
            "bucket_mb": args.bucket_mb,
            "steps": args.steps, "reps": args.reps, "probe_gbps": probe, "results": rows,
            "torch_threads": torch.get_num_threads()}


def train_verdict(rows: list):
    """The fastest offload variant's iteration time against torch-fused's, measured in the same
    run."""
    ours = {r["variant"]: r["iter_s"] for r in rows if r["variant"].startswith("offload")
            and "iter_s" in r}
    peer = {r["variant"]: r["iter_s"] for r in rows if r["variant"] == "torch-fused"
            and "iter_s" in r}
    if not ours:
        return None
    best = min(ours, key=ours.get)
    return verdict(ours[best], peer, ours_name=best, label="iteration time")


def _num(x, spec):
    if x is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width or 1))
    return format(x, spec)


def print_table(out: dict, file=None) -> None:
    # looked up per call: pytest's capsys swaps sys.stdout
    file = sys.stdout if file is None else file
    p = out["probe_gbps"]
    where = ("CUDA " + out["device"]) if not out["fake_device"] else \
        ("CPU-only machine: fake device (copies are host memcpy on threads, not PCIe; times show "
         "pipeline overhead)")
    print(f"question: {out.get('question', QUESTION)}", file=file)
    print(f"train benchmark on {where}", file=file)
    print(f"GPT {out['params'] / 1e6:.1f}M params {out['config']}, {out['dtype']}, batch "
          f"{out['batch']}, bucket {out['bucket_mb']} MB, {out['steps']} steps x {out['reps']} "
          f"reps (median), torch threads {out.get('torch_threads')}", file=file)
    if out["fake_device"]:
        print(f"host memcpy probe ({out['bucket_mb']} MB): {p['d2h']:.1f} GB/s (no PCIe here: "
              "%probe not shown)",
              file=file)
    else:
        print(f"pinned-copy probe ({out['bucket_mb']} MB): D2H {p['d2h']:.1f} GB/s, H2D "
              f"{p['h2d']:.1f} GB/s",
              file=file)
    base = next((r["iter_s"] for r in out["results"] if r["variant"] == "torch-fused"
                 and "iter_s" in r), None)
    pct = ((lambda x, ref: None) if out["fake_device"]
           else (lambda x, ref: 100 * x / ref if x else None))
    hdr = f"{'variant':<16} {'iter ms':>8} {'vs torch':>8} {'exposed ms':>10} {'exp %':>6} " \
          f"{'kernel ms':>9} " \
          f"{'D2H GB/s':>9} {'%probe':>6} {'H2D GB/s':>9} {'%probe':>6} {'peak GB':>7}"
    print(hdr, file=file)
    for r in out["results"]:
        if "error" in r:
            print(f"{r['variant']:<16} {r['error']}", file=file)
            continue
        it = r["iter_s"]
        exp = r.get("exposed_s")
        d2h, h2d = r.get("d2h_gbps"), r.get("h2d_gbps")
        print(f"{r['variant']:<16} {it * 1e3:>8.1f} {_num(it / base if base else None, '>8.2f')} "
              f"{_num(exp * 1e3 if exp is not None else None, '>10.1f')} "
              f"{_num(100 * exp / it if exp is not None else None, '>6.1f')} "
              f"{_num(r['kernel_s'] * 1e3 if r.get('kernel_s') is not None else None, '>9.1f')} "
              f"{_num(d2h, '>9.1f')} {_num(pct(d2h, p['d2h']), '>6.0f')} "
              f"{_num(h2d, '>9.1f')} {_num(pct(h2d, p['h2d']), '>6.0f')} "
              f"{_num(r.get('peak_mem_gb'), '>7.2f')}", file=file)
    for r in out["results"]:
        if "bound" in r:
            print(f"{r['variant']}: step() {r['step_s'] * 1e3:.1f} ms (optimizer span from the "
                  f"first bucket ready {r['span_s'] * 1e3:.1f} ms, includes backward) vs max(NVMe "
                  f"I/O {r['io_s'] * 1e3:.1f}, kernel {r['kernel_s'] * 1e3:.1f}, copy "
                  f"{r['copy_s'] * 1e3:.1f}) ms = {r['bound']:.2f} (target <= 1.15); host buffers "
                  f"{r['host_bytes'] / 2**20:.1f} MiB of budget "
                  f"{r['host_budget'] / 2**20:.0f} MiB",
                  file=file)
    v = out.get("verdict")
    print("verdict (medians of this run; above 1.00x offload is faster): " + (v["line"] if v else
          "no torch-fused run to compare with (add it to --variants)") +
          (" (fake device: no PCIe, see above)" if v and out["fake_device"] else ""), file=file)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when present, else the fake device on CPU")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model size (default: 125m on CUDA, small on CPU)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=None,
                   help="bucket size (default: 32 on CUDA, 1 on CPU so that the small "
                        "model has several)")
    p.add_argument("--steps", type=int, default=None, help="timed iterations per repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--variants",
                   default="torch-fused,offload-overlap,offload-clip,offload-sync,offload-nvme")
    p.add_argument("--torch-threads", dest="torch_threads", type=int, default=None,
                   help="torch intra-op threads (a busy small host runs steadier with 1)")
    p.add_argument("--trace", default=None, help="write Chrome traces to PATH.<variant>.json")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument("--storage", dest="state", choices=["ram", "nvme", "mmap"], default="ram",
                   help="also run offload-nvme: device params with the optimizer state in this "
                        "place, as the optimizer's storage= (default ram: not run)")
    # hidden alias of --storage
    p.add_argument("--state", dest="state", choices=["ram", "nvme", "mmap"],
                   help=argparse.SUPPRESS)
    p.add_argument("--nvme-dir", dest="nvme_dir", default=None,
                   help="directory for the state file, or several (comma-separated) to spread it "
                        "over drives; a new subdirectory in each, removed at the end (default: "
                        "the system temp dir)")
    p.add_argument("--host-budget", dest="host_budget", default="256MiB",
                   help="host_budget of offload-nvme")


def _defaults(args) -> None:
    cuda = (args.device == "cuda") or (args.device == "auto" and torch.cuda.is_available())
    if args.batch is None:
        args.batch = 32 if cuda else 2
    if args.steps is None:
        args.steps = 5 if cuda else 3
    if args.bucket_mb is None:
        args.bucket_mb = 32.0 if cuda else 1.0


def apply_defaults(args) -> None:
    """Fill the device-dependent defaults (batch, steps, bucket) of a parsed Namespace."""
    _defaults(args)


def _cmd(args) -> int:
    _defaults(args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    out = run(args)
    print_table(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="GPT training steps: offload (overlapped / not) vs "
                                            "torch AdamW(fused)",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.bench train")
    add_arguments(p)
    return _cmd(p.parse_args(argv))
