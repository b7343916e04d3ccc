"""engine/bucket.py: step_bucket, the one per-bucket body of a step, for every tier, side and
schedule.

Both loops call it: the inline loop of engine/pipeline.py (host parameters, and device parameters
with ``overlap=False``) and the CPU worker of schedule/backward.py (device parameters, overlapped
schedules). They differ only around it: what was read ahead, when the state slot is acquired and
released, and when the new weights go up. For one bucket whose state bytes ``blk`` are in host
memory:

    registry.init_fresh      a piece's first step: zero moments, master = the parameter
    resync                   (optional) user writes to bf16/fp16 parameters into their masters
    ptrs()                   the gradient (and output) pointers; on a device, waits for the D2H
    between()                (optional) checks once the gradients are on the host
    bucket_rows + kernel     the native Adam step over the bucket's rows, GIL released (the kernel
                             entry of the bucket's moment format, offload/moments/format.py)
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from ..state.layout import piece_columns
from .table import bucket_rows

__all__ = ["step_bucket"]


def step_bucket(b, act, blk, ptrs: Callable[[], list], *, registry, read_master, hyper: dict,
                mult: float, threads: int, timing: dict, resync: Optional[Callable] = None,
                between: Optional[Callable[[], None]] = None) -> tuple:
    """Step the active pieces ``act`` of bucket ``b``; returns the kernel's (start, end)
    perf_counter."""
    registry.init_fresh(b, act, blk, read_master)
    if resync is not None:
        resync(b, act, blk)
    rows = ptrs()
    if between is not None:
        between()
    steps = registry.counts(b.group)
    table = bucket_rows(b, act, blk.base, rows, steps[piece_columns(b, act, "param")[0]])
    t0 = time.perf_counter()
    b.moments.kernel(table, hyper, mult, threads)
    t1 = time.perf_counter()
    timing["kernel_s"] += t1 - t0
    return t0, t1
