"""bench/gpu.py: ``python -m offload.bench gpu`` - every way to train a GPT whose Adam state does
not stay on the GPU, side by side on one GPU: forward + backward alone, torch's fused AdamW on the
GPU, offload in its schedules, DeepSpeed ZeRO-Offload (ZeRO-2, Twin-Flow, ZenFlow), torchao's
CPUOffloadOptimizer and FSDP2's CPUOffloadPolicy.

Each row runs in a process of its own (offload/bench/gpu_child.py) with its own timeout, in
priority order, until a global time budget is spent; each result is appended to ``gpu_bench.jsonl``
as it comes (one JSON line per row), and a markdown table (``gpu_bench.md``) is written and printed
at the end. The loss of iteration 0 must be the same in every row: every row starts from the same
bf16 weights, and a different first loss means a row trains something else. With ``--device cpu``
the rows run on a tiny model on the CPU (offload through its fake device) to check their plumbing;
the times mean nothing there.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from .gpu_table import markdown, targets

QUESTION = ("How long is a training iteration of a GPT on one GPU with its Adam state on the "
            "host, with offload and with each peer, against forward + backward alone?")

# (size, row) in the order they run; the budget cuts the tail
PRIORITY = [("350m", r) for r in ("baseline", "offload", "offload_clip", "offload_host",
                                  "offload_delayed",
                                  "deepspeed_zero2", "torchao", "torch_fused")] + \
           [("4b", r) for r in ("baseline", "offload", "deepspeed_zero2", "torchao",
                                "torch_fused")] + \
           [("350m", r) for r in ("fsdp2_torch", "fsdp2_offload", "offload_8bit",
                                  "deepspeed_twinflow", "deepspeed_zenflow")] + \
           [("4b", r) for r in ("offload_clip", "offload_host", "offload_delayed", "offload_8bit",
                                "fsdp2_torch",
                                "fsdp2_offload", "deepspeed_twinflow", "deepspeed_zenflow")]
BATCH = {"350m": 16, "4b": 8, "tiny": 2, "small": 4}
ITERS = {"350m": (3, 8), "4b": (2, 4), "tiny": (1, 3), "small": (1, 3)}   # warm-up, timed
ROW_TIMEOUT = {"350m": 150, "4b": 300, "tiny": 120, "small": 120}
MIN_ROW_S = 20   # a row is not started with less than this left of the budget


def plan(args) -> list:
    sizes = args.sizes.split(",") if args.sizes else (["350m", "4b"] if args.device == "cuda"
                                                      else ["tiny"])
    wanted = args.rows.split(",") if args.rows else None
    from .gpu_child import all_rows
    known = all_rows()
    bad = [r for r in (wanted or []) if r not in known]
    if bad:
        raise SystemExit(f"--rows: unknown row(s) {', '.join(bad)}; known: {', '.join(known)}")
    order = [(s, r) for s, r in PRIORITY if s in sizes] + \
            [(s, r) for s in sizes if s not in {x for x, _ in PRIORITY}
             for r in dict.fromkeys(r for _, r in PRIORITY)]
    order = [(s, r) for s, r in order if wanted is None or r in wanted]
    # rows named on the command line that the priority list does not hold still run, last
    if wanted:
        order += [(s, r) for s in sizes for r in wanted if (s, r) not in order]
    return [(s, known[r]) for s, r in order]


def _skip_reason(row, args) -> str:
    if row.cuda_only and args.device != "cuda":
        return "needs CUDA"
    import importlib.util
    for mod in row.needs:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return ""


def run_row(size: str, row, args, timeout: float) -> dict:
    warmup, iters = ITERS.get(size, (1, 3))
    cmd = [sys.executable, "-m", "offload.bench.gpu_child", row.name, "--size", size, "--device",
           args.device,
           "--batch", str(args.batch or BATCH.get(size, 4)), "--warmup",
           str(args.warmup or warmup), "--iters", str(args.iters or iters)]
    if args.bucket_mb is not None:
        cmd += ["--bucket-mb", str(args.bucket_mb)]
    log = open(os.path.join(args.out, f"row-{size}-{row.name}.log"),
               "w") if args.keep_logs else subprocess.DEVNULL
    t0 = time.perf_counter()
    # a session of its own: a peer's helper processes (ZenFlow's optimizer process) end with the
    # row
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout = ""
        out = {"row": row.name, "size": size, "error": f"timed out after {timeout:.0f} s"}
    else:
        lines = [ln for ln in stdout.splitlines() if ln.startswith("GPU_BENCH_ROW ")]
        out = json.loads(lines[-1][len("GPU_BENCH_ROW "):]) if lines else \
            {"row": row.name, "size": size, "error": "the row's process exited with "
                                                     f"{proc.returncode} and no result"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()
    out["row_s"] = time.perf_counter() - t0
    out.setdefault("label", row.label)
    if row.note:
        out.setdefault("note", row.note)
    return out


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _header(args) -> dict:
    import torch
    from .common import machine_info
    head = {"kind": "run", "question": QUESTION, "device": args.device, "machine": machine_info(),
            "budget_s": args.budget_s, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.device == "cuda":
        head["gpu"] = torch.cuda.get_device_name(0)
        head["cuda"] = torch.version.cuda
    versions = {}
    from importlib import metadata
    for pkg in ("torch", "offload", "deepspeed", "torchao"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    head["versions"] = versions
    return head


def _prebuild_deepspeed(args):
    """DeepSpeed JIT-builds its CPU Adam at first use (tens of seconds): built once, beside the
    baseline row, into torch's extension cache (TORCH_EXTENSIONS_DIR), which every DeepSpeed row
    then reuses."""
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def run(args) -> list:
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, "gpu_bench.jsonl")
    head = _header(args)
    _append(jsonl, head)
    start = time.perf_counter()
    order = plan(args)
    build = None
    if not args.no_prebuild and any(r.needs == ("deepspeed",) and not _skip_reason(r, args)
                                    for _, r in order):
        build = _prebuild_deepspeed(args)
    results = []
    for size, row in order:
        left = args.budget_s - (time.perf_counter() - start)
        reason = _skip_reason(row, args)
        if not reason and left < MIN_ROW_S:
            reason = f"time budget spent ({args.budget_s:.0f} s)"
        if reason:
            res = {"row": row.name, "size": size, "label": row.label, "skipped": reason}
        else:
            if build is not None and row.name != "baseline":
                build.wait()
                build = None
            res = run_row(size, row, args, min(ROW_TIMEOUT.get(size, 150), left))
        results.append(res)
        _append(jsonl, res)
        print(_progress_line(res), flush=True)
    table = markdown(head, results)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(table)
    print(table)
    return results


def _progress_line(res: dict) -> str:
    what = f"{res['size']:>5} {res['row']:<20}"
    if "skipped" in res:
        return f"{what} SKIP {res['skipped']}"
    if "error" in res:
        return f"{what} ERROR {res['error']}"
    t = res.get("event_median_ms", res.get("host_median_ms"))
    return f"{what} {t:8.1f} ms/iter  loss[0] {res['losses'][0]:.6f}  ({res['row_s']:.0f} s)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default when present) or cpu: a tiny model, to check "
                        "every row's plumbing")
    p.add_argument("--sizes", default=None,
                   help="GPT presets, comma-separated (default: 350m,4b on CUDA, tiny on CPU)")
    p.add_argument("--rows", default=None,
                   help="rows to run, comma-separated (default: all, in priority order)")
    p.add_argument("--budget-s", dest="budget_s", type=float, default=420.0,
                   help="stop starting rows once this many seconds are spent (default 420)")
    p.add_argument("--out", default=None, help="folder for gpu_bench.jsonl and gpu_bench.md "
                   "(default: $OUT when set, else ./bench-results)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (default: 16 at 350m, 8 at 4b)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=None,
                   help="offload's bucket_mb (default: offload's own default)")
    p.add_argument("--keep-logs", dest="keep_logs", action="store_true",
                   help="keep each row's stderr in --out")
    p.add_argument("--no-prebuild", dest="no_prebuild", action="store_true",
                   help="do not build DeepSpeed's CPU Adam before its rows")


def _cmd(args) -> int:
    import torch
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.out is None:
        args.out = os.environ.get("OUT") or "bench-results"
    results = run(args)
    for line in targets(results):
        print(line)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gpu", help="one GPU: offload vs DeepSpeed, torchao, FSDP2 "
                                          "offload, per iteration",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cmd)
