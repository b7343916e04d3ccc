"""bench/gpu_child.py: times one row of ``python -m offload.bench gpu`` in a process of its own.

``measure`` builds the model, hands it to the row's builder (offload/bench/gpu_rows.py,
gpu_peers.py), runs warm-up and timed iterations and returns one JSON-able dict: wall and
CUDA-event times per iteration, the loss of every iteration, GPU peak memory, the host's peak RSS
(with child processes), setup time and thread counts. The parent (offload/bench/gpu.py) starts
``python -m offload.bench.gpu_child ROW --size ...`` once per row and reads the line it prints.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch

from . import gpu_peers
from .gpt import GPT, PRESETS, random_batch
from .gpu_rows import Row, Setup, SplitTrainer, elapsed_ms, mark, our_rows, sync

MARK = "GPU_BENCH_ROW "   # the line the parent looks for in a child's output


def all_rows() -> dict:
    """Every row, by name (the order they run in is offload/bench/gpu.py's)."""
    return {r.name: r for r in our_rows() + gpu_peers.rows()}


def _rss(field_name: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_with_children() -> int:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) * 1024


def _model(setup: Setup):
    """The GPT in fp32, its weights rounded to bf16 values: every row starts from the same bf16
    weights and the same fp32 master (a row that keeps the master in fp32 would otherwise start
    from other values than one that takes the bf16 weights as its master)."""
    torch.manual_seed(0)
    if setup.cuda:
        with torch.device(setup.device):   # initialised on the GPU: seconds, not minutes, at 4B
            model = GPT(setup.cfg)
    else:
        model = GPT(setup.cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    return model


def measure(row: Row, setup: Setup, warmup: int, iters: int) -> dict:
    out = {"row": row.name, "label": row.label, "size": setup.size, "batch": setup.batch}
    if row.note:
        out["note"] = row.note
    if setup.cuda:   # the CUDA context first: the host memory a row adds is measured from here
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(setup.device)
    rss0 = _rss("VmRSS:")
    model = _model(setup)
    out["params"] = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    trainer = row.build(setup, model)
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
    out["setup_s"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(setup.cfg, setup.batch, setup.device, gen) for _ in range(2)]
    losses, marks = [], []
    try:
        for i in range(warmup):
            losses.append(trainer.iteration(*batches[i % 2]))
        trainer.finish()
        sync(setup)
        t0 = time.perf_counter()
        for i in range(warmup, warmup + iters):
            marks.append(mark(setup))
            losses.append(trainer.iteration(*batches[i % 2]))
        trainer.finish()
        marks.append(mark(setup))
        sync(setup)
        out["wall_ms"] = (time.perf_counter() - t0) / iters * 1e3
        out.update(_per_iteration(setup, marks))
        out["losses"] = [float(x) for x in losses]
        if isinstance(trainer, SplitTrainer):
            out.update(trainer.split(warmup))
        st = trainer.opt.last_step_stats() if hasattr(trainer.opt, "last_step_stats") else None
        if st:
            out["cpu_step_ms"] = st.get("kernel_s", 0.0) * 1e3
            out["exposed_by_offload_ms"] = st.get("exposed_s", 0.0) * 1e3
    finally:
        trainer.close()
    if setup.cuda:
        out["gpu_peak_gb"] = torch.cuda.max_memory_allocated(setup.device) / 1e9
    out["host_peak_gb"] = _peak_rss_with_children() / 1e9
    out["host_growth_gb"] = max(0, _peak_rss_with_children() - rss0) / 1e9
    out["threads"] = dict(trainer.threads, torch=torch.get_num_threads(), process=_rss_threads(),
                          OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"))
    return out


def _rss_threads() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def _per_iteration(setup: Setup, marks: list) -> dict:
    """Median and mean of the per-iteration times between consecutive marks (CUDA events on the
    compute stream, or the host clock on the CPU)."""
    ms = [elapsed_ms(setup, a, b) for a, b in zip(marks, marks[1:])]
    key = "event" if setup.cuda else "host"
    return {f"{key}_median_ms": statistics.median(ms), f"{key}_mean_ms": statistics.fmean(ms),
            "iter_ms": ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.bench.gpu_child",
                                description="one row of the GPU bench")
    p.add_argument("row")
    p.add_argument("--size", required=True, choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=None)
    a = p.parse_args(argv)
    setup = Setup(a.size, torch.device(a.device), a.batch, bucket_mb=a.bucket_mb)
    try:
        row = all_rows()[a.row]
        out = measure(row, setup, a.warmup, a.iters)
    except Exception as e:   # noqa: BLE001: one line for the table, the traceback for the log
        traceback.print_exc()
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
        out = {"row": a.row, "size": a.size, "error": ("out of memory: " if oom else "") +
               f"{type(e).__name__}: "
               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
        if setup.cuda:
            out["gpu_peak_gb"] = torch.cuda.max_memory_allocated(setup.device) / 1e9
    sys.stdout.flush()
    print(MARK + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
