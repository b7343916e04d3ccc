"""telemetry.py: per-step timing of the GPU-offload pipeline and an optional Chrome-trace timeline.

``StepStats`` is what ``optimizer.last_step_stats()`` returns: seconds spent in D2H copies, in the
CPU kernel, in H2D copies, in NVMe I/O (always 0: this pipeline keeps state in RAM), and the
exposed part: time the training thread was blocked waiting for offload work (inside ``step()``, in
gradient hooks waiting for a staging buffer, in forward pre-hooks waiting for weights), plus on
CUDA the time the compute stream stalled on an H2D event.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, fields
from typing import List, Optional, Tuple

__all__ = ["StepStats", "Trace"]


@dataclass
class StepStats:
    step: int = 0
    d2h_s: float = 0.0
    kernel_s: float = 0.0
    h2d_s: float = 0.0
    nvme_s: float = 0.0
    exposed_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    buckets: int = 0
    skipped: bool = False
    grad_multiplier: float = 1.0
    overlapped: bool = True
    complete: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class Trace:
    """Spans (name, lane, start, end) in host perf_counter seconds; exported as Chrome trace JSON."""

    def __init__(self, limit: int = 200_000):
        self._spans: List[Tuple[str, str, float, float]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._limit = limit

    def span(self, name: str, lane: str, span: Optional[Tuple[float, float]]) -> None:
        if span is None:
            return
        with self._lock:
            if len(self._spans) < self._limit:
                self._spans.append((name, lane, span[0], span[1]))

    def export(self, path: str) -> int:
        lanes = {}
        events = []
        with self._lock:
            spans = list(self._spans)
        for name, lane, a, b in spans:
            tid = lanes.setdefault(lane, len(lanes) + 1)
            events.append({"name": name, "ph": "X", "pid": 1, "tid": tid,
                           "ts": (a - self._t0) * 1e6, "dur": max(b - a, 0.0) * 1e6})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return len(spans)
