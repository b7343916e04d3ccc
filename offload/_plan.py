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
from .guards import SharedMemoryError
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
    """Everything a user can change on a tensor while its object and data pointer stay the same
    (``t.data = t.data.t()``, a reshape, a dtype view, a neg-bit view)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_neg()


# columns of GroupPlan.meta, the per-row record csrc/rows.cpp (collect_rows) compares against
M_PPTR, M_GPTR, M_CODE, M_DIM, M_SIZE0, M_NUMEL, M_PVER, M_LOWP = range(8)
M_COLS = 8


def record_param(plan, i: int, lp: torch.Tensor, code: int) -> None:
    """Record validated parameter ``lp`` (a plain contiguous CPU tensor) in row i of ``plan.meta``."""
    m = plan.meta[i]
    m[M_PPTR], m[M_CODE], m[M_DIM] = lp.data_ptr(), code, lp.dim()
    m[M_SIZE0], m[M_NUMEL] = (lp.shape[0] if lp.dim() else 0), lp.numel()
    plan.layouts[i] = (lp.shape, lp.stride())


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
        # what collect_rows (csrc/rows.cpp) compares each row against, one int64 record per row
        # (columns REC_*): param pointer (-1: none, forces revalidation), grad pointer, dtype code
        # (0: no record), dim, size(0), numel, bf16/fp16 version after the last master sync, lowp
        self.meta = np.zeros((n, M_COLS), dtype=np.int64)
        self.meta[:, [M_PPTR, M_GPTR, M_PVER]] = -1
        self.p_ptr = self.meta[:, M_PPTR]          # views: p_ptr[i] = -1 forces revalidation
        self.g_ptr = self.meta[:, M_GPTR]
        self.p_ver = self.meta[:, M_PVER]
        self.lowp = self.meta[:, M_LOWP]
        self.lowp[:] = [p.dtype in _LOW_PRECISION for p in params]
        self.layouts: list = [None] * n              # (torch.Size, strides) of the param last validated
        self.g_ref: list = [no_grad_ref] * n        # weakref to the gradient last validated
        self.p_meta: list = [None] * n               # fingerprint of the parameter last validated
        self.rec: list = [None] * n                  # (state dict, *tensors in REC_KEYS) the row points into

    def matches(self, params: list) -> bool:
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))


KINDS = ("parameter", "master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "gradient")


def _intervals(plans: list, rows: list, reads: dict):
    """Byte intervals [start, end) the kernel writes (W) for ``rows[k]`` of ``plans[k]``, and reads only
    (R, gradients) for ``reads[k]``; each labelled by a (3, n) array of (plan index, row, KINDS index)."""
    ws, we, wl, rs, re_, rl = [], [], [], [], [], []
    for pi, (plan, sel) in enumerate(zip(plans, rows)):
        t = plan.table
        for col, kind in ((COL_P, None), (COL_M, 2), (COL_V, 3), (COL_VMAX, 4), (COL_OUT, 0)):
            r = sel[(t[sel, col] != 0) & (t[sel, COL_N] > 0)]
            esz = 4 if col != COL_OUT else np.where(t[r, COL_OD] == 1, 4, 2)
            ws.append(t[r, col])
            we.append(t[r, col] + esz * t[r, COL_N])
            kinds = np.where(t[r, COL_OUT] != 0, 1, 0) if kind is None else np.full(r.size, kind)
            wl.append(np.stack([np.full(r.size, pi), r, kinds]))
        if pi in reads:
            r = np.asarray(reads[pi], dtype=np.int64)
            r = r[(t[r, COL_G] != 0) & (t[r, COL_N] > 0)]
            rs.append(t[r, COL_G])
            re_.append(t[r, COL_G] + np.where(t[r, COL_GD] == 1, 4, 2) * t[r, COL_N])
            rl.append(np.stack([np.full(r.size, pi), r, np.full(r.size, 5)]))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    lab = lambda xs: np.concatenate(xs, axis=1) if xs else np.zeros((3, 0), dtype=np.int64)  # noqa: E731
    return cat(ws), cat(we), lab(wl), cat(rs), cat(re_), lab(rl)


class OverlapIndex:
    """Sorted, checked-disjoint write intervals of the rows about to be stepped (all groups);
    gradients are checked against it (reads may overlap each other, nothing may overlap a write)."""

    def __init__(self, plans: list, rows: list, name):
        ws, we, wl, _, _, _ = _intervals(plans, rows, {})
        order = np.argsort(ws, kind="stable")
        self.starts, self.ends = ws[order], we[order]
        self.labels = wl[:, order]
        self.rows = rows
        self.name = name
        if len(self.starts) > 1:
            run_end = np.maximum.accumulate(self.ends)
            bad = np.flatnonzero(self.starts[1:] < run_end[:-1])
            if bad.size:
                k = int(bad[0]) + 1
                j = int(np.argmax(self.ends[:k] > self.starts[k]))
                self._raise(self.labels[:, j], self.labels[:, k])

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
            self._raise(self.labels[:, int(idx[k])], rl[:, k])

    def _raise(self, a, b) -> None:
        (ap, ar, ak), (bp, br, bk) = (map(int, a), map(int, b))
        raise SharedMemoryError(f"the {KINDS[ak]} of {self.name(ap, ar)} and the {KINDS[bk]} of {self.name(bp, br)} "
                           "share memory (overlapping views, or the same tensor listed twice): the step would "
                           "update them in an undefined order; give each parameter, gradient and state its "
                           "own storage (e.g. .clone())")
