"""engine/fastpath.py: StepPlan, a step of host parameters whose fixed cost does not grow with the
number of tensors: a few dozen Python operations around the kernel calls.

A step (engine/engine.py ``_step``) that ends with every parameter stepped, every row recorded by
the native row check (params/hostrows.py) and the state in a tier that needs no per-bucket calls
(``tier.inline``: the RAM tier) leaves a plan: the kernel's task tables of every bucket, joined per
param group and kernel, holding what does not change from step to step (the addresses of the
state, the parameters and the gradients, element counts). The next step runs the plan where
nothing it depends on changed, each checked as the full step checks it:

- the param groups hold the same parameters (by identity) and amsgrad settings (StateEngine.holds);
- the engine's structure: nothing took ``exclusive()`` since (add_param_group, a load, a read of
  the state: they drop the plan), the same layout, row records (``HostRows.rows_epoch``; none
  after ``offload.testing.drop_row_caches``) and ``opt.state`` records (TorchViews.recs);
- every ``opt.state`` entry is the recorded object (``_C.state_rows``), the step counts were not
  written (Registry.valid), no decoded moment is held (moments/handouts.py);
- every parameter and gradient is as recorded, or a gradient is a new one that passes the native
  check and the aliasing check (``HostRows.steady``): its address goes into the tables;
- bf16/fp16 parameters: none written since the last step (the row check compares their versions
  with records that the full step's write tracker, params/guards.py, holds too);
- each group's hyperparameters, validated by ``hyper(gi)`` as in the full step.

Any other answer leaves everything as it was, and the full step runs (and plans the next one). The
set of parameters with state only shrinks in a full step or under ``exclusive()``. The plan keeps
no tensor alive: its tables hold addresses that are used only once the row check has found the
recorded tensors alive and unmoved.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Callable, Optional

import numpy as np

from ..base.dtypes import STATE_KEYS
from ..base.tensors import bump_versions
from ..native.adam import COL_G, COL_GD
from ..native.rows import M_PPTR, M_PVER, state_rows
from ..state.layout import piece_columns
from .table import bucket_rows
from .torchstate import STATE_FNS

__all__ = ["StepPlan", "PlanHolder", "check_finite"]

_FINITE = ("lr", "eps", "weight_decay", "beta1", "beta2")
_ESIZE = np.array([0, 4, 2, 2], dtype=np.int64)   # bytes per element by dtype code
_SEEN = [M_PVER, M_PPTR]   # the columns of a row record that WriteTracker.seen holds too


def check_finite(gi: int, h: dict) -> None:
    """Group ``gi``'s hyperparameters ``h`` are finite (the native kernel refuses the others too,
    but only once a step has begun: I/O started, buckets stepped)."""
    for k in _FINITE:
        if not math.isfinite(h[k]):
            raise ValueError(f"group {gi}: {k} = {h[k]} is not finite")


class PlanHolder:
    """Where the engine keeps its plan (or None); what takes the exclusive use drops it."""
    __slots__ = ("plan",)

    def __init__(self):
        self.plan: Optional["StepPlan"] = None

    def run(self, eng, groups: list, hyper: Callable[[int], dict], state: dict, mult: float,
            threads: int) -> bool:
        """StepPlan.run of the plan held, under the engine's lock; False without one."""
        plan = self.plan
        if plan is None:
            return False
        with eng.lock:
            return self.plan is plan and plan.run(eng, groups, hyper, state, mult, threads)


def _state_unchanged(views, state, groups) -> bool:
    """Every ``state`` entry of the parameters of ``groups`` (indices), all with state, is the one
    adopt_user_state recorded, its tensors unmoved: what adopt_user_state would find is nothing."""
    if type(state) is not dict and type(state) is not defaultdict:
        return False   # (another mapping: adopt_user_state looks at every entry)
    recs, ready = views.recs, views.registry.ready
    for gi in groups:
        ps = views.groups[gi]
        if gi >= len(recs) or len(recs[gi].objs) != len(ps):
            return False
        r = recs[gi]
        if len(state_rows(state, ps, ready[gi], r.objs, STATE_KEYS, r.ptrs, STATE_FNS, r.hashes)):
            return False
    return True


class _Table:
    """One kernel call of the plan: the rows of a group's buckets of one kernel, joined."""
    __slots__ = ("kernel", "rows", "gi", "step_col", "grad_col", "counts_at", "grad_from",
                 "grad_off")

    def __init__(self, kernel, rows: np.ndarray, gi: int, cols: tuple, idx: np.ndarray,
                 grad_off: np.ndarray):
        self.kernel, self.rows, self.gi = kernel, rows, gi
        self.step_col, self.grad_col = cols
        n = len(idx)   # the rows' parameters in the group: a slice when in order (a view)
        in_order = n and idx[0] == 0 and idx[-1] == n - 1 and np.array_equal(idx, np.arange(n))
        self.counts_at = slice(0, n) if in_order else idx
        self.grad_from, self.grad_off = idx, grad_off   # their row records, the pieces' offsets


class StepPlan:
    __slots__ = ("groups", "layout", "nbuckets", "records", "rows_epoch", "recs", "nonempty",
                 "tables", "params", "low", "hypers")

    @classmethod
    def build(cls, eng, active: list) -> Optional["StepPlan"]:
        """The plan of the step that just ended (under the engine's lock, its gradients still set
        on the side), or None where it cannot be planned: parameters on a device, a tier with
        per-bucket I/O, a parameter without a gradient or a state, a row not recorded (a DTensor,
        a subclass), held decoded moments, parameters stepped elsewhere."""
        reg, rows = eng.registry, eng.side.row_records()
        if (rows is None or not eng.tier.inline or eng.excluded
                or not eng.views.handouts.empty() or len(rows.groups) != len(eng.groups)):
            return None
        for gi, ps in enumerate(eng.groups):
            r = rows.groups[gi]
            if not (len(r.plain) == len(ps) and r.plain.all() and active[gi].all()
                    and reg.ready[gi].all()):
                return None
        self = cls()
        self.groups, self.layout, self.nbuckets = eng.groups, eng.layout, len(eng.layout.buckets)
        self.records, self.rows_epoch, self.recs = rows, rows.rows_epoch, eng.views.recs
        self.nonempty = [gi for gi, ps in enumerate(eng.groups) if ps]
        self.params = [p for ps in eng.groups for p in ps]
        self.low = cls._low_rows(eng, rows, self.nonempty)
        self.hypers = {}
        self.tables = cls._tables(eng, rows)
        return self if self.low is not None and self.tables else None

    @staticmethod
    def _low_rows(eng, rows, groups: list) -> Optional[list]:
        """[(group, its bf16/fp16 rows)]. What the write tracker (params/guards.py) holds of each
        must be its row record (version and address), so that the row check that finds a row
        unchanged finds it unwritten, and the tracker takes the records after each planned step;
        None where it is not (parameters that share a version counter: a step moves it twice)."""
        out = []
        for gi in groups:
            idx = eng.tracker.low_rows(gi)
            if len(idx):
                seen, rec = eng.tracker.seen[gi][idx], rows.groups[gi].meta[idx][:, _SEEN]
                if not np.array_equal(seen, rec):
                    return None
                out.append((gi, idx))
        return out

    @staticmethod
    def _tables(eng, rows) -> list:
        joined: dict = {}   # (group, kernel, columns) -> [(rows, its parameters, byte offsets)]
        for b in eng.layout.buckets:
            if not b.pieces:
                continue
            idx, starts = piece_columns(b, b.pieces, "param", "start")
            t = bucket_rows(b, b.pieces, eng.tier.acquire(b, True).base,
                            eng.side.ptrs(b, b.pieces, None), eng.registry.counts(b.group)[idx])
            off = starts * _ESIZE[rows.groups[b.group].table[idx, COL_GD]]   # (as HostRows.ptrs)
            cols = (b.moments.columns.step, b.moments.columns.g)
            joined.setdefault((b.group, b.moments.kernel, cols), []).append((t, idx, off))
        out = []
        for (gi, kernel, cols), parts in joined.items():
            ts, idx, off = (np.concatenate(x) for x in zip(*parts))
            out.append(_Table(kernel, np.ascontiguousarray(ts), gi, cols, idx, off))
        return out

    def run(self, eng, groups: list, hyper: Callable[[int], dict], state: dict, mult: float,
            threads: int) -> bool:
        """Step as planned where nothing the plan depends on changed (True); else change nothing
        (False). Raises what the full step raises for the same inputs (a hyperparameter, a new
        gradient that shares memory); a failure once the step has begun fails the tier."""
        reg, rows, views = eng.registry, self.records, eng.views
        if not (eng.side.row_records() is rows and rows.rows_epoch == self.rows_epoch
                and views.recs is self.recs and eng.groups is self.groups
                and eng.layout is self.layout and len(eng.layout.buckets) == self.nbuckets):
            return False
        eng.tier.check_usable()
        flags = [bool(g.get("amsgrad", False)) for g in groups]   # (as rebuild.fits)
        if not eng.holds([g["params"] for g in groups], flags) or not views.handouts.empty():
            return False
        if not (reg.valid() and _state_unchanged(views, state, self.nonempty)):
            return False
        got = rows.steady(self.groups)   # this step's gradients, or None (something changed)
        if got is None:
            return False
        fresh = [new for _gs, new in got]
        if any(len(n) for n in fresh):   # recorded now: the tables follow before anything raises
            self._new_grads(rows, fresh)
        hypers = {gi: hyper(gi) for gi in self.nonempty}   # validated before any change
        for gi, h in hypers.items():
            if self.hypers.get(gi) is not h:
                check_finite(gi, h)
        self.hypers = hypers
        self._run(eng, hypers, mult, threads)
        return True

    def _new_grads(self, rows, fresh: list) -> None:
        """New gradients the native check accepted: their addresses into the tables."""
        for t in self.tables:
            if len(fresh[t.gi]):
                t.rows[:, t.grad_col] = rows.groups[t.gi].table[t.grad_from, COL_G] + t.grad_off

    def _run(self, eng, hypers: dict, mult: float, threads: int) -> None:
        reg, tel = eng.registry, eng.telemetry
        t0 = time.perf_counter()
        k0 = tel["kernel_s"]
        try:
            reg.advance_all(self.nonempty)
            for t in self.tables:
                t.rows[:, t.step_col] = reg.counts(t.gi)[t.counts_at]
                k = time.perf_counter()
                t.kernel(t.rows, hypers[t.gi], mult, threads)
                tel["kernel_s"] += time.perf_counter() - k
            bump_versions(self.params)   # the kernel wrote them through their addresses
            if self.low:   # the records of bf16/fp16 rows follow; the write tracker takes them
                self.records.bumped_all()
                for gi, idx in self.low:
                    eng.tracker.seen[gi][idx] = self.records.groups[gi].meta[idx][:, _SEEN]
        except BaseException as e:
            eng.tier.fail(e)
            raise
        dt = time.perf_counter() - t0
        tel["steps"] += 1
        tel["step_s"] += dt
        eng.last_stats = dict(step=tel["steps"], kernel_s=tel["kernel_s"] - k0, nvme_s=0.0,
                              step_s=dt, buckets=self.nbuckets, skipped=False,
                              grad_multiplier=mult)
