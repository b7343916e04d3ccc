"""schedule/stepstats.py: StepStats, the statistics of the device schedule's steps
(schedule/device_step.py): per step the host time in ``step()``, the copy and kernel seconds, the
bytes moved, whether it was skipped; ``last`` is the latest step whose CPU part is done and whose
uploads were waited for, as ``opt.last_step_stats()`` returns it. The worker completes a queued
step's record (``done``)."""
from __future__ import annotations

import time
from typing import Optional

__all__ = ["StepStats"]


class StepStats:
    def __init__(self, engine, feed, trace):
        # (its parameter side's copy counters: the side may be replaced, read it each time)
        self.engine = engine
        # BackwardFeed of the overlapped schedules (its uploads' exposed time), or None
        self.feed = feed
        self.trace = trace
        self._nsteps = 0
        self.last: Optional[dict] = None
        # the latest steps' statistics until settle takes them (it runs past 4)
        self.records: list = []

    def record(self, t0: float, s0: dict, stats: dict, mult: float, **extra) -> None:
        """Stats of the step that began at t0 (s0: the side's counters then); ``stats`` is
        completed later by the worker when the step is queued (``done``)."""
        self._nsteps += 1
        rec = stats if "done" in stats else dict(stats)
        rec.update(step=self._nsteps, s0=s0, exposed0=self.exposed(), t0=t0,
                   exposed_step=time.perf_counter() - t0, grad_multiplier=mult, **extra)
        rec.setdefault("skipped", False)
        if self.trace is not None:
            self.trace.span(f"step() {self._nsteps}", "training thread", (t0, time.perf_counter()))
        self.records.append(rec)
        if len(self.records) > 4:   # bounded however rarely the stats are read
            self.settle()

    def exposed(self) -> float:
        return self.feed.uploads.exposed_s if self.feed is not None else 0.0

    def settle(self) -> None:
        """The latest step whose CPU part is done (and whose uploads were waited for) becomes
        ``last``."""
        side = self.engine.side
        side.collect_times()
        pending = self.feed is not None and self.feed.uploads.pending
        done = [k for k, r in enumerate(self.records) if r["done"]
                and not (pending and k == len(self.records) - 1)]
        if not done:
            return
        k = done[-1]
        r = self.records[k]
        nxt = self.records[k + 1] if k + 1 < len(self.records) else None
        s1 = nxt["s0"] if nxt is not None else side.stats
        waits = (nxt["exposed0"] if nxt is not None else self.exposed()) - r["exposed0"]
        self.last = dict(step=r["step"], d2h_s=s1["d2h_s"] - r["s0"]["d2h_s"],
                         kernel_s=r["kernel_s"],
                          h2d_s=s1["h2d_s"] - r["s0"]["h2d_s"], nvme_s=r["nvme_s"],
                          exposed_s=r["exposed_step"] + waits,
                         d2h_bytes=s1["d2h_bytes"] - r["s0"]["d2h_bytes"],
                          h2d_bytes=s1["h2d_bytes"] - r["s0"]["h2d_bytes"], buckets=r["buckets"],
                          skipped=r["skipped"], grad_multiplier=r["grad_multiplier"],
                          overlapped=r["overlapped"], waited_all=r.get("waited_all", False),
                         complete=True)
        if "pipeline_s" in r:
            self.last["pipeline_s"] = r["pipeline_s"]
        # buckets stepped during backward: the first one queued -> step()
        if r.get("first") is not None:
            self.last["backward_s"] = max(0.0, r["t_step"] - r["first"])
        self.records = self.records[k:]
