"""bench/io_drives.py: ``python -m offload.bench io --dir A,B``: several drives, as the optimizer
uses them.

Per drive: our I/O engine alone on that drive (``--size`` bytes written then read) and fio's best
configuration on the same file (the drive's ceiling). Aggregate: every drive at once, each with its
own ``AioEngine``, requests laid round-robin (request ``j`` on drive ``j % k``, like state buckets)
with ``--inflight`` requests queued per drive; compared with the sum of the drives alone and with
the sum of fio's ceilings. Several directories on one disk share its bandwidth: the aggregate then
shows the cost of interleaving, not a speed-up. Each measurement runs in a new directory inside
each --dir, removed at the end; the directories --dir names are never deleted.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections import deque

from ..native.aio import AioEngine
from ..base.memory import aligned_empty
from ..state.drives import parse_dirs
from ..store import parse_size
from .common import write_json

GB = 1e9

__all__ = ["bench_drives", "measure_drives"]


def bench_drives(paths: list, size: int, buf, request: int, qd: int, block: int,
                 inflight: int) -> dict:
    """Write then read ``size`` bytes on every path at once, round-robin requests, ``inflight`` per
    drive."""
    k = len(paths)
    engines = [AioEngine(queue_depth=qd, block_size=block) for _ in paths]
    try:
        files = [e.open(p) for e, p in zip(engines, paths)]
        # bucket j on drive j % k
        jobs = [(d, off) for off in range(0, size, request) for d in range(k)]
        nbuf = buf.numel() // request
        out = {}
        for op in ("write", "read"):
            t = time.perf_counter()
            pending: deque = deque()
            for j, (d, off) in enumerate(jobs):
                if len(pending) >= inflight * k:
                    pending.popleft().wait()
                slot = buf[(j % nbuf) * request:(j % nbuf + 1) * request]
                eng = engines[d]
                pending.append((eng.write if op == "write" else eng.read)(
                    files[d], slot, off, min(request, size - off)))
            for r in pending:
                r.wait()
            if op == "write":
                for f in files:
                    os.fsync(f.fd)
            out[op] = k * size / (time.perf_counter() - t)
        out["direct"] = all(f.direct for f in files)
        for f in files:
            f.close()
        return out
    finally:
        for e in engines:
            e.close()


def measure_drives(args, fill, bench_fio) -> dict:
    """``fill`` (random bytes into a buffer), ``bench_fio``: bench/io.py's, passed in by its
    ``measure``."""
    dirs = parse_dirs(args.dir)
    size, request, block = (parse_size(args.size), parse_size(args.request),
                            parse_size(args.block_size))
    if size % 4096 or request % 4096 or block % 4096:
        raise SystemExit("--size, --request and --block-size must be multiples of 4 KiB")
    k = len(dirs)
    configs = [(int(x), 1) for x in args.fio_depths.split(",")] + \
        [(int(x), int(j)) for x, j in (c.split("x") for c in args.fio_jobs.split(",") if c)]
    has_fio = shutil.which("fio") is not None and not args.no_fio
    buf = aligned_empty(max(request * args.inflight * k, 64 << 20))
    fill(buf)
    works = []
    alone = [{"write": [], "read": []} for _ in dirs]
    fio = [{} for _ in dirs]
    agg: dict = {"write": [], "read": []}
    direct = True
    try:
        for d in dirs:
            works.append(tempfile.mkdtemp(prefix="offload-io-bench-", dir=d))
        paths = [os.path.join(w, "region") for w in works]
        for p in paths:
            os.close(os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        # lay the regions out
        bench_drives(paths, size, buf, request, args.queue_depth, block, args.inflight)
        for _ in range(args.reps):
            for i, p in enumerate(paths):
                r = bench_drives([p], size, buf, request, args.queue_depth, block, args.inflight)
                direct &= r["direct"]
                for op in ("write", "read"):
                    alone[i][op].append(r[op])
                if has_fio:
                    for key, v in bench_fio(p, size, configs).items():
                        fio[i].setdefault(key, []).append(v)
            r = bench_drives(paths, size, buf, request, args.queue_depth, block, args.inflight)
            for op in ("write", "read"):
                agg[op].append(r[op])
    finally:
        for w in works:
            shutil.rmtree(w, ignore_errors=True)
    rows = []
    for i, d in enumerate(dirs):
        row = {"dir": d, **{op: statistics.median(v) for op, v in alone[i].items()}}
        for op in ("write", "read"):
            best = [statistics.median(v) for (o, _q, _j), v in fio[i].items() if o == op]
            row[f"fio_{op}"] = max(best) if best else None
        rows.append(row)
    total = {"write": statistics.median(agg["write"]), "read": statistics.median(agg["read"])}
    for op in ("write", "read"):
        total[f"sum_alone_{op}"] = sum(r[op] for r in rows)
        fios = [r[f"fio_{op}"] for r in rows]
        total[f"fio_{op}"] = sum(fios) if all(f is not None for f in fios) else None
    report = dict(bench="io", dirs=dirs, size=size, request=request, block_size=block,
                  queue_depth=args.queue_depth,
                  inflight=args.inflight, reps=args.reps, drives=rows, aggregate=total,
                  notes=[] if direct else ["our I/O engine fell back to buffered I/O "
                                           "(O_DIRECT refused)"])
    _print(report)
    write_json(args.json, report)
    return report


def _print(r: dict) -> None:
    print(f"io benchmark on {len(r['dirs'])} drives: {r['size'] / GB:.2f} GB per drive, median of "
          f"{r['reps']} runs ({r['request'] >> 20} MiB requests, {r['inflight']} queued per "
          "drive, one engine per drive)")
    hdr = f"{'drive':<40}{'write GB/s':>12}{'vs fio':>9}{'read GB/s':>12}{'vs fio':>9}"
    print(hdr)
    print("-" * len(hdr))

    def cell(v, ref):
        return f"{v / GB:>12.2f}" + (f"{v / ref:>9.2f}" if ref else f"{'-':>9}")

    for row in r["drives"]:
        print(f"{row['dir'][-40:]:<40}" + cell(row["write"], row["fio_write"])
              + cell(row["read"], row["fio_read"]))
    a = r["aggregate"]
    print(f"{'all drives at once':<40}" + cell(a["write"], a["fio_write"])
          + cell(a["read"], a["fio_read"]))
    print(f"{'  vs the drives alone, summed':<40}{a['write'] / a['sum_alone_write']:>12.2f}{'':>9}"
          f"{a['read'] / a['sum_alone_read']:>12.2f}")
    if a["fio_write"] is None:
        print("fio not run: no drive ceiling (apt-get install fio)")
    for n in r["notes"]:
        print("note: " + n)
