"""bench/io.py: ``python -m offload.bench io``: sequential write and read throughput of a
state-sized region, our async I/O engine against the peers and the disk ceiling, in one run.

Measured in a new directory created inside --dir (default: the system's temporary directory, e.g.
/tmp; it is often RAM-backed or another disk: name a directory on the disk you mean) and removed at
the end; the directory --dir names is never deleted:
  ours        offload.aio.AioEngine, O_DIRECT, aligned buffers, requests of --request bytes
  fio         O_DIRECT + libaio, 1 MiB blocks, several queue depths (the disk ceiling), if
              installed
  pwrite      plain buffered os.pwrite + fsync / os.preadv after dropping the file's cached pages
  memmap      numpy.memmap copy + flush / copy out after dropping cached pages
  aiofiles    aiofiles (thread-pool buffered I/O) if installed
  deepspeed   DeepSpeed's AIO handle (libaio, O_DIRECT) with its page-locked buffer, if importable
              and its op builds (pip install deepspeed; apt-get install libaio-dev)
Ours is also timed reading one half of the region while writing the other ("mixed": both directions
at once, as an NVMe step does; the planner's step-time model reads it from the JSON). Every method
overwrites the same, already written file (as the state store rewrites its file every step; on ext4
a direct write that extends a file or fills unwritten extents holds the inode lock for its whole
duration, so first writes to a fresh file run one at a time whatever the queue depth, for fio as
for us). Buffered peers drop the page cache for the file (fsync + posix_fadvise DONTNEED) before
reading, so every read comes from the disk. Each figure is the median of --reps repetitions; ratios
are to fio's best queue depth for the same direction. The verdict compares ours with the fastest
peer of the run, and with fio's best where fio ran; ``--plot PATH`` draws the table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from ..native.aio import AioEngine
from ..base.memory import aligned_empty
from ..state.drives import parse_dirs
from ..store import parse_size
from .common import Progress, add_common_options, verdict, write_json
from .io_peers import bench_aiofiles, bench_deepspeed, bench_memmap, bench_pwrite

QUESTION = ("How fast does offload's I/O engine write and read a state-sized file in this "
            "directory, against other ways of doing the same file I/O and against the "
            "disk's ceiling (fio)?")

GB = 1e9


def _fill(buf: torch.Tensor) -> None:
    buf.view(torch.int32)[:] = torch.randint(-2**31, 2**31 - 1, (buf.numel() // 4,),
                                             dtype=torch.int32)


# ------------------------------------------------------------------------------ ours
def bench_ours(path: str, size: int, buf: torch.Tensor, request: int, qd: int, block: int,
               inflight: int):
    """Write then read ``size`` bytes with up to ``inflight`` requests of ``request`` bytes
    queued."""
    out = {}
    with AioEngine(queue_depth=qd, block_size=block) as eng:
        f = eng.open(path)
        nbuf = buf.numel() // request
        for op in ("write", "read"):
            fn = eng.write if op == "write" else eng.read
            t = time.perf_counter()
            pending = []
            for k, off in enumerate(range(0, size, request)):
                if len(pending) >= inflight:
                    pending.pop(0).wait()
                slot = buf[(k % nbuf) * request:(k % nbuf + 1) * request]
                pending.append(fn(f, slot, off, min(request, size - off)))
            for r in pending:
                r.wait()
            if op == "write":
                os.fsync(f.fd)
            out[op] = size / (time.perf_counter() - t)
        half = max(request, size // 2 // request * request)
        if 2 * half <= size:   # read the first half while writing the second, 2 x inflight queued
            t = time.perf_counter()
            pending = []
            for k, (op, off) in enumerate((op, off) for off in range(0, half, request)
                                          for op in ("r", "w")):
                if len(pending) >= 2 * inflight:
                    pending.pop(0).wait()
                slot = buf[(k % nbuf) * request:(k % nbuf + 1) * request]
                n = min(request, half - off)
                pending.append(eng.read(f, slot, off, n) if op == "r"
                               else eng.write(f, slot, half + off, n))
            for r in pending:
                r.wait()
            os.fsync(f.fd)
            out["mixed"] = 2 * half / (time.perf_counter() - t)
        out["direct"] = f.direct
        f.close()
    return out


# ------------------------------------------------------------------------------ fio
def bench_fio(path: str, size: int, configs: list) -> dict:
    """{(op, iodepth, jobs): bytes/s} from fio (O_DIRECT, libaio, 1 MiB blocks). With several
    jobs each covers its own slice of the region (several submitting threads, like our workers)."""
    res = {}
    for op in ("write", "read"):
        for qd, jobs in configs:
            cmd = ["fio", "--name=offload-io", f"--filename={path}", f"--size={size // jobs}",
                   "--bs=1M",
                   f"--rw={op}", "--direct=1", "--ioengine=libaio", f"--iodepth={qd}",
                   f"--numjobs={jobs}",
                   f"--offset_increment={size // jobs}", "--group_reporting", "--end_fsync=1",
                   "--output-format=json"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"fio failed: {r.stderr.strip()[:500]} (is fio installed: "
                                   "apt-get install fio? --no-fio measures without it)")
            js = json.loads(r.stdout[r.stdout.index("{"):])
            job = js["jobs"][0]
            res[(op, qd, jobs)] = float(job[op]["bw_bytes"])
    return res


# ------------------------------------------------------------------------------ driver
def run(args) -> int:
    measure(args)
    return 0


def measure(args) -> dict:
    if args.dir and len(parse_dirs(args.dir)) > 1:   # several drives: each alone, and all at once
        from .io_drives import measure_drives
        return measure_drives(args, _fill, bench_fio)
    size = parse_size(args.size)
    request = parse_size(args.request)
    block = parse_size(args.block_size)
    if size % 4096 or request % 4096 or block % 4096:
        raise SystemExit("--size, --request and --block-size must be multiples of 4 KiB")
    base = args.dir or tempfile.gettempdir()   # never the current directory: the region is GBs
    # removed at the end; base never is
    work = tempfile.mkdtemp(prefix="offload-io-bench-", dir=base)
    configs = [(int(x), 1) for x in args.fio_depths.split(",")] + \
        [(int(x), int(j)) for x, j in (c.split("x") for c in args.fio_jobs.split(",") if c)]
    buf = aligned_empty(max(2 * request * args.inflight, 64 << 20))
    _fill(buf)
    results: dict = {k: {"write": [], "read": []}
                     for k in ("ours", "deepspeed", "pwrite", "memmap", "aiofiles")}
    results["ours"]["mixed"] = []
    peers = [x for x in ("pwrite", "memmap", "aiofiles", "deepspeed")
             if x not in args.skip.split(",")]
    progress = Progress(args.reps * (1 + len(peers)) + 1, "io bench", enabled=not args.no_progress)
    fio_all: dict = {}
    has_fio = shutil.which("fio") is not None and not args.no_fio
    notes = []
    p = os.path.join(work, "region")
    try:
        # lay the region out once (untimed); every method then overwrites and reads it back
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        bench_ours(p, size, buf, request, args.queue_depth, block, args.inflight)
        progress.update("lay out")
        for rep in range(args.reps):
            r = bench_ours(p, size, buf, request, args.queue_depth, block, args.inflight)
            progress.update(f"rep {rep + 1}: ours")
            if not r["direct"]:
                notes.append("our I/O engine fell back to buffered I/O (O_DIRECT refused)")
            for op in ("write", "read", "mixed"):
                if op in r:
                    results["ours"][op].append(r[op])
            if has_fio:
                for key, v in bench_fio(p, size, configs).items():
                    fio_all.setdefault(key, []).append(v)
            for name, fn in (("pwrite", lambda p: bench_pwrite(p, size, buf)),
                             ("memmap", lambda p: bench_memmap(p, size, buf)),
                             ("aiofiles", lambda p: bench_aiofiles(p, size, buf)),
                             ("deepspeed", lambda p: bench_deepspeed(p, size, request,
                                                                     args.queue_depth, block,
                                                                     args.inflight,
                                                                     args.ds_threads))):
                if name in args.skip.split(","):
                    continue
                r = fn(p)
                progress.update(f"rep {rep + 1}: {name}")
                if r is not None:
                    for op in ("write", "read"):
                        results[name][op].append(r[op])
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {op: statistics.median(v) for op, v in d.items() if v} for k, d in results.items()}
    med = {k: v for k, v in med.items() if v}
    fio_med = {f"{op}_qd{qd}_x{j}": statistics.median(v) for (op, qd, j), v in fio_all.items()}
    ceiling = {}
    if fio_med:
        for op in ("write", "read"):
            qd, j = max(configs, key=lambda c: fio_med[f"{op}_qd{c[0]}_x{c[1]}"])
            ceiling[op] = {"bytes_per_s": fio_med[f"{op}_qd{qd}_x{j}"], "iodepth": qd, "jobs": j}
    report = dict(bench="io", question=QUESTION, dir=base, size=size, request=request,
                  block_size=block,
                  queue_depth=args.queue_depth, inflight=args.inflight, reps=args.reps,
                  results=med, fio=fio_med,
                  fio_best=ceiling, notes=sorted(set(notes)),
                  missing=[k for k in results if k not in med])
    report["verdicts"] = io_verdicts(med, ceiling)
    _print(report)
    write_json(args.json, report)
    if getattr(args, "plot", None):
        from .plots import grouped_bars
        grouped_bars(args.plot, ["write", "read"],
                     {k: [v.get("write", 0) / GB, v.get("read", 0) / GB]
                                                    for k, v in med.items()},
                     ylabel="GB/s", title=f"file I/O in {base}: {size / GB:.2f} GB, "
                                          f"median of {args.reps}",
                     ceilings={op: c["bytes_per_s"] / GB for op, c in ceiling.items()})
    return report


def io_verdicts(med: dict, ceiling: dict) -> list:
    """Per direction: ours against the fastest peer of the run, and against fio's best where fio
    ran."""
    out = []
    for op in ("write", "read"):
        ours = med.get("ours", {}).get(op)
        v = verdict(ours, {k: d.get(op) for k, d in med.items() if k != "ours"},
                    higher_is_better=True, ours_name="offload's engine", label=op)
        if v is not None:
            out.append(dict(op=op, against="peer", **v))
        if op in ceiling:
            v = verdict(ours, {f"fio iodepth {ceiling[op]['iodepth']} x {ceiling[op]['jobs']}":
                               ceiling[op]["bytes_per_s"]}, higher_is_better=True,
                        ours_name="offload's engine", label=op, ceiling=True)
            out.append(dict(op=op, against="ceiling", **v))
    return out


def _print(r: dict) -> None:
    print(f"question: {r['question']}")
    print(f"io benchmark: {r['size'] / GB:.2f} GB region in {r['dir']}, median of {r['reps']} "
          f"runs (ours: {r['request'] >> 20} MiB requests, {r['inflight']} queued, queue depth "
          f"{r['queue_depth']}, {r['block_size'] >> 10} KiB blocks)")
    best = r["fio_best"]
    hdr = f"{'method':<22}{'write GB/s':>12}{'vs fio':>9}{'read GB/s':>12}{'vs fio':>9}"
    print(hdr)
    print("-" * len(hdr))

    def ratio(op, v):
        return f"{v / best[op]['bytes_per_s']:.2f}" if op in best else "-"

    for k, v in r["results"].items():
        w, rd = v.get("write"), v.get("read")
        print(f"{k:<22}{w / GB:>12.2f}{ratio('write', w):>9}"
              f"{rd / GB:>12.2f}{ratio('read', rd):>9}")
    for key, v in r["fio"].items():
        op, qd, j = key.split("_")
        print(f"{'fio ' + op + ' ' + qd + ' ' + j.replace('x', 'jobs '):<22}"
              + (f"{v / GB:>12.2f}{'':>9}" if op == "write" else
                                                  f"{'':>21}{v / GB:>12.2f}"))
    if best:
        print("fio best (disk ceiling): write {:.2f} GB/s (iodepth {} x {} jobs), read {:.2f} "
              "GB/s (iodepth {} x {} jobs)".format(best["write"]["bytes_per_s"] / GB,
                                                   best["write"]["iodepth"], best["write"]["jobs"],
                             best["read"]["bytes_per_s"] / GB, best["read"]["iodepth"],
                                                   best["read"]["jobs"]))
    else:
        print("fio not installed: no disk ceiling measured (apt-get install fio)")
    if r["missing"]:
        print("not measured (not installed or skipped): " + ", ".join(r["missing"]))
    mixed = r["results"].get("ours", {}).get("mixed")
    if mixed:
        print(f"ours, reading and writing at once: {mixed / GB:.2f} GB/s of both together")
    for n in r["notes"]:
        print("note: " + n)
    if r["verdicts"]:
        print("verdict (medians of this run; above 1.00x offload is faster):")
        print("\n".join("  " + v["line"] for v in r["verdicts"]))
    else:
        print("verdict: no peer and no ceiling measured in this run (every peer skipped, "
              "fio not installed)")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("io", help="NVMe read/write throughput: our I/O engine vs fio, "
                                         "DeepSpeed AIO and buffered peers",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-dir", dest="dir", default=None,
                   help="directory on the disk to measure (several, comma-separated: each drive "
                        "and all at once, bench/io_drives.py); the test file goes into a new "
                        "subdirectory, removed at the end (default: the system temporary "
                        f"directory, here {tempfile.gettempdir()})")
    p.add_argument("--size", default="2GiB",
                   help="bytes written then read per method (default 2GiB)")
    p.add_argument("--request", default="64MiB",
                   help="our request size, like one state bucket (default 64MiB)")
    p.add_argument("--inflight", type=int, default=4,
                   help="our requests queued at once (default 4)")
    p.add_argument("--queue-depth", type=int, default=8,
                   help="our I/O engine's worker threads (default 8)")
    p.add_argument("--block-size", default="1MiB",
                   help="our I/O engine's piece size (default 1MiB)")
    p.add_argument("--fio-depths", default="1,4,16,32",
                   help="fio iodepths to try, one job (default 1,4,16,32)")
    p.add_argument("--fio-jobs", default="8x2,4x4",
                   help="extra fio configs iodepth x jobs (default 8x2,4x4)")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--skip", default="",
                   help="comma-separated peers to skip: pwrite,memmap,aiofiles,deepspeed")
    p.add_argument("--ds-threads", type=int, default=2,
                   help="DeepSpeed intra_op_parallelism (default 2)")
    # hidden alias of --nvme-dir
    p.add_argument("--dir", dest="dir", default=None, help=argparse.SUPPRESS)
    add_common_options(p, reps=3)  # --reps, --json, --no-progress
    p.add_argument("--plot", metavar="PATH",
                   help="draw the table as a PNG chart (needs matplotlib)")
    p.set_defaults(func=run)
