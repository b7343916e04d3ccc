"""_plan.py: the bookkeeping behind ``offload.Adam/AdamW``'s RAM-mode step.

The cached native task table of each param group (``GroupPlan``), with a record of what every row
was validated against; ``opt.state`` containers that count their own mutations (``StateMap``,
``ParamState``) so a replaced or deleted state entry is noticed at O(1) cost per step; the
storage-bounds and overlap checks run before a pointer reaches the kernel; the elementwise re-read
of a bf16/fp16 parameter's fp32 master after the user wrote the parameter.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import numpy as np
import torch

from ._dist import local
from ._kernels import COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_V, COL_VMAX, TASK_COLS

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def no_grad_ref():  # stands in for a weakref of a row that has no validated gradient yet
    return None


class ParamState(dict):
    """``opt.state[p]``: a plain dict that counts its mutations in the optimizer's epoch cell, so a
    replaced state tensor (``opt.state[p]["exp_avg"] = ...``) is seen by the next step at O(1) cost."""
    _epoch = [0]  # rebound to the owning optimizer's cell by StateMap.__setitem__

    def __setitem__(self, k, v):
        self._epoch[0] += 1
        dict.__setitem__(self, k, v)

    def __delitem__(self, k):
        self._epoch[0] += 1
        dict.__delitem__(self, k)

    def __ior__(self, other):
        self._epoch[0] += 1
        return dict.__ior__(self, other)

    def pop(self, *args):
        self._epoch[0] += 1
        return dict.pop(self, *args)

    def popitem(self):
        self._epoch[0] += 1
        return dict.popitem(self)

    def clear(self):
        self._epoch[0] += 1
        dict.clear(self)

    def update(self, *args, **kwargs):
        self._epoch[0] += 1
        dict.update(self, *args, **kwargs)

    def setdefault(self, k, default=None):
        self._epoch[0] += 1
        return dict.setdefault(self, k, default)


class StateMap(defaultdict):
    """``opt.state`` in RAM mode: torch's ``defaultdict(dict)`` that counts its own mutations and those
    of every per-parameter dict (``del opt.state[p]``, ``opt.state[p] = {}``, ``clear()``, replaced
    tensors), so the cached task table is re-checked only after something changed."""

    def __init__(self, default_factory=ParamState, *args, epoch=None, **kwargs):
        self._epoch = epoch if epoch is not None else [0]
        super().__init__(ParamState, *args, **kwargs)

    def __setitem__(self, k, v):
        self._epoch[0] += 1
        if isinstance(v, dict):
            if type(v) is not ParamState:
                v = ParamState(v)
            v._epoch = self._epoch
        defaultdict.__setitem__(self, k, v)

    def __delitem__(self, k):
        self._epoch[0] += 1
        defaultdict.__delitem__(self, k)

    def __ior__(self, other):
        for k, v in dict(other).items():
            self[k] = v
        return self

    def pop(self, *args):
        self._epoch[0] += 1
        return defaultdict.pop(self, *args)

    def popitem(self):
        self._epoch[0] += 1
        return defaultdict.popitem(self)

    def clear(self):
        self._epoch[0] += 1
        defaultdict.clear(self)

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, k, default=None):
        if k not in self:
            self[k] = {} if default is None else default
        return self[k]


get_version = operator.attrgetter("_version")
REC_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "step")
ESIZE = {1: 4, 2: 2, 3: 2}  # bytes per element of the DTYPE_CODES


def check_storage(t: torch.Tensor, name: str) -> None:
    """Raise unless the elements of contiguous ``t`` lie inside its storage (a shrunk storage would
    let the kernel read or write past the allocation)."""
    if t.numel() == 0:
        return
    need = (t.storage_offset() + t.numel()) * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        raise RuntimeError(f"{name} has {t.numel()} elements at offset {t.storage_offset()} but its storage holds "
                           f"only {have} bytes (was its storage resized?): give it storage of the right size")


def fingerprint(t: torch.Tensor) -> tuple:
    """Everything a user can change on a tensor while its object and data pointer stay the same."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def sync_master(master: torch.Tensor, p: torch.Tensor) -> None:
    """Re-read the fp32 master from the bf16/fp16 parameter where the parameter was written since the
    last step (elements that still equal round(master) keep their fp32 precision)."""
    mv, pv = local(master).view(-1), local(p).detach().reshape(-1)
    diff = pv != mv.to(pv.dtype)
    if bool(diff.any()):
        mv[diff] = pv[diff].to(torch.float32)


class GroupPlan:
    """Cached native task table of one param group: one row per parameter.

    What a row was validated against is recorded (parameter fingerprint, gradient weakref, pointer
    and version, the state dict and tensors it points into); the step re-validates a row when any
    of it changed. The plan keeps the state tensors it points into alive, so a replaced or deleted
    state entry can never leave the kernel writing freed memory. ``steps`` holds every parameter's
    step count (numpy-backed, so its storage cannot be resized); ``state['step']`` is a 0-dim
    view into it, so one vectorised add advances all of them. No strong reference to a gradient is
    kept between steps.
    """

    def __init__(self, params: list):
        self.params = list(params)
        n = len(params)
        self.table = np.zeros((n, TASK_COLS), dtype=np.int64)
        self.steps_np = np.zeros(n, dtype=np.float32)
        self.steps = torch.from_numpy(self.steps_np)
        self.p_ptr = np.full(n, -1, dtype=np.int64)  # param pointer the table row was built for
        self.g_ptr = np.full(n, -1, dtype=np.int64)  # gradient pointer last validated
        self.g_ver = np.full(n, -1, dtype=np.int64)  # version counter of that gradient
        self.g_ref: list = [no_grad_ref] * n        # weakref to that gradient
        self.p_meta: list = [None] * n               # fingerprint of the parameter last validated
        self.p_ver = np.full(n, -1, dtype=np.int64)  # bf16/fp16 rows: parameter version after the last sync
        self.lowp = np.array([p.dtype in _LOW_PRECISION for p in params], dtype=bool)
        self.rec: list = [None] * n                  # (state dict, *tensors in REC_KEYS) the row points into

    def matches(self, params: list) -> bool:
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))


def _intervals(plans: list, rows: list, reads: dict):
    """Byte intervals [start, end) the kernel writes (W) for ``rows[k]`` of ``plans[k]``, and reads only
    (R, gradients) for ``reads[k]``; each labelled (plan index, row, kind)."""
    ws, we, wl, rs, re_, rl = [], [], [], [], [], []
    for pi, (plan, sel) in enumerate(zip(plans, rows)):
        t = plan.table
        for col, kind in ((COL_P, None), (COL_M, "exp_avg"), (COL_V, "exp_avg_sq"), (COL_VMAX, "max_exp_avg_sq"),
                          (COL_OUT, "parameter")):
            r = sel[(t[sel, col] != 0) & (t[sel, COL_N] > 0)]
            esz = 4 if col != COL_OUT else np.where(t[r, COL_OD] == 1, 4, 2)
            ws.append(t[r, col])
            we.append(t[r, col] + esz * t[r, COL_N])
            wl += [(pi, int(k), kind or ("master_param" if t[k, COL_OUT] else "parameter")) for k in r]
        if pi in reads:
            r = np.asarray(reads[pi], dtype=np.int64)
            r = r[(t[r, COL_G] != 0) & (t[r, COL_N] > 0)]
            rs.append(t[r, COL_G])
            re_.append(t[r, COL_G] + np.where(t[r, COL_GD] == 1, 4, 2) * t[r, COL_N])
            rl += [(pi, int(k), "gradient") for k in r]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    return cat(ws), cat(we), wl, cat(rs), cat(re_), rl


class OverlapIndex:
    """Sorted, checked-disjoint write intervals of the rows about to be stepped (all groups);
    gradients are checked against it (reads may overlap each other, nothing may overlap a write)."""

    def __init__(self, plans: list, rows: list, name):
        ws, we, wl, _, _, _ = _intervals(plans, rows, {})
        order = np.argsort(ws, kind="stable")
        self.starts, self.ends = ws[order], we[order]
        self.labels = [wl[k] for k in order]
        self.rows = rows
        self.name = name
        if len(self.starts) > 1:
            run_end = np.maximum.accumulate(self.ends)
            bad = np.flatnonzero(self.starts[1:] < run_end[:-1])
            if bad.size:
                k = int(bad[0]) + 1
                j = int(np.argmax(self.ends[:k] > self.starts[k]))
                self._raise(self.labels[j], self.labels[k])

    def check_reads(self, plans: list, reads: dict) -> None:
        _, _, _, rs, re_, rl = _intervals(plans, [np.zeros(0, dtype=np.int64)] * len(plans), reads)
        if not rs.size or not self.starts.size:
            return
        idx = np.searchsorted(self.ends, rs, side="right")  # first write ending after the read starts
        hit = idx < self.starts.size
        hit[hit] = self.starts[idx[hit]] < re_[hit]
        bad = np.flatnonzero(hit)
        if bad.size:
            k = int(bad[0])
            self._raise(self.labels[int(idx[k])], rl[k])

    def _raise(self, a, b) -> None:
        raise RuntimeError(f"the {a[2]} of {self.name(a[0], a[1])} and the {b[2]} of {self.name(b[0], b[1])} "
                           "share memory (overlapping views, or the same tensor listed twice): the step would "
                           "update them in an undefined order; give each parameter, gradient and state its "
                           "own storage (e.g. .clone())")
