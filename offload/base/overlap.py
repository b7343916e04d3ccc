"""base/overlap.py: the arithmetic of hiding a CPU step behind backward: how many of the buckets
backward reaches last keep their state on the GPU (the device schedule's split, schedule/split.py,
and the planner's prediction of it, offload/steptime.py, use the same rule)."""
from __future__ import annotations

from typing import List

__all__ = ["choose", "cpu_end"]


def cpu_end(arrive: List[float], cpu_s: List[float]) -> float:
    """When the CPU is done with buckets that arrive at ``arrive`` and take ``cpu_s`` each, in
    order."""
    done = 0.0
    for a, c in zip(arrive, cpu_s):
        done = max(done, a) + c
    return done


def choose(sizes: List[int], arrive: List[float], cpu_s: List[float], backward_s: float,
           gpu_bytes: List[int], budget: int) -> int:
    """How many buckets, counted from the end of backward's order, stay on the GPU.

    ``sizes``/``gpu_bytes``/``cpu_s``: per bucket in backward order, its parameters' elements, the
    GPU bytes their state would take, the seconds the CPU takes to step it; ``arrive``: when its
    gradients are on the host, in seconds from the start of backward; ``backward_s``: the length of
    backward. The CPU steps the buckets in order as they arrive; the smallest number k of trailing
    buckets is kept on the GPU such that the CPU is done with the others by the end of backward, as
    far as ``budget`` bytes allow (never more buckets than fit)."""
    n = len(sizes)
    fits = 0   # the most trailing buckets the budget holds
    total = 0
    for b in range(n - 1, -1, -1):
        total += gpu_bytes[b]
        if total > budget:
            break
        fits += 1
    for k in range(0, fits + 1):   # the smallest k whose CPU part ends inside backward
        if cpu_end(arrive[:n - k], cpu_s[:n - k]) <= backward_s:
            return k
    return fits
