"""engine/pipeline.py: the inline loop over the buckets of a step, for every tier: host parameters,
and device parameters with ``overlap=False`` (the overlapped schedules use the CPU worker of
schedule/backward.py; both call the one per-bucket body, engine/bucket.py).

For bucket k (in the order the caller gives):
    tier.prefetch(k+1 .. k+depth)     state read-ahead (nvme: O_DIRECT reads into free slots)
    side.arrive(k .. k+ahead-1)       gradients to host (device: D2H into a staging slot; host:
                                      nothing)
    blk = tier.acquire(k)             the bucket's state bytes in host memory
    step_bucket(...)                  fresh pieces initialized, the native kernel
                                      (engine/bucket.py)
    tier.release(k, blk)              write-back (nvme: async; mmap: pages dropped)
    side.publish(k)                   new weights up (device: H2D from the slot)
Any exception marks the tier failed (see state/tier.py) after every transfer stopped.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Callable, Sequence

from .bucket import step_bucket

__all__ = ["run"]


def run(jobs: Sequence[tuple], *, tier, side, registry, hyper: Callable[[int], dict], mult: float,
        threads: int, depth: int, ahead: int, timing: dict, compute: bool = True,
        resync=None) -> None:
    """``jobs``: (bucket, active pieces, read) in execution order; ``ahead``: buckets staged in
    advance; ``resync(b, pieces, blk)``: take user writes to bf16/fp16 parameters into their
    masters first."""
    n = len(jobs)
    staged: deque = deque()
    nxt_read = nxt_arrive = 0
    for k in range(n):
        while nxt_read < n and nxt_read <= k + depth:
            b, _, read = jobs[nxt_read]
            tier.prefetch(b, read)
            nxt_read += 1
        while nxt_arrive < n and nxt_arrive < k + max(1, ahead):
            b, act, _ = jobs[nxt_arrive]
            staged.append(side.arrive(b, act) if compute else None)
            nxt_arrive += 1
        b, act, read = jobs[k]
        st = staged.popleft()
        blk = tier.acquire(b, read)
        if compute:
            step_bucket(b, act, blk, functools.partial(side.ptrs, b, act, st), registry=registry,
                        read_master=side.read_master, hyper=hyper(b.group), mult=mult,
                        threads=threads, timing=timing, resync=resync or None)
        tier.release(b, blk)
        if compute:
            side.publish(b, act, st)
    tier.drain()
    if compute:
        side.finish()
