"""base/trace.py: the optional Chrome-trace timeline of GPU offload (``trace=True``).

``Trace`` collects spans (CPU steps of buckets, step() calls, forward waits for weights) and
``export_chrome_trace`` writes them as Chrome trace JSON. The per-step figures of
``optimizer.last_step_stats()`` are assembled by offload/schedule/device_step.py.
"""
from __future__ import annotations

import json
import threading
import time
from typing import List, Optional, Tuple

__all__ = ["Trace"]


class Trace:
    """Spans (name, lane, start, end) in host perf_counter seconds; exported as Chrome trace
    JSON."""

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

    def spans(self) -> List[Tuple[str, str, float, float]]:
        """A copy of the spans recorded so far: (name, lane, start, end)."""
        with self._lock:
            return list(self._spans)

    def export(self, path: str) -> int:
        lanes = {}
        events = []
        spans = self.spans()
        for name, lane, a, b in spans:
            tid = lanes.setdefault(lane, len(lanes) + 1)
            events.append({"name": name, "ph": "X", "pid": 1, "tid": tid,
                           "ts": (a - self._t0) * 1e6, "dur": max(b - a, 0.0) * 1e6})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                           "args": {"name": lane}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return len(spans)
