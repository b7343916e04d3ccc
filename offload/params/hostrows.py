"""params/hostrows.py: the state engine's per-step check of host parameters and their gradients,
cached.

What ``check_grad`` (params/base.py) and the overlap check (guards.py) establish about a row (a
parameter and its gradient) is recorded when the row is validated. Each step the native
``collect_rows`` (offload/native/rows.py, csrc/rows.cpp: the check the fp32 RAM path uses) compares
every row with its record and validates a new plain gradient itself; only rows that changed in any
way (a new parameter tensor or ``p.data = ...``: pointer, dtype, shape, strides, neg bit; a
bf16/fp16 parameter written in place; a gradient that is not a plain CPU tensor) and parameters of
other types (DTensor) go through the Python checks (check_grad), which raise their own messages.

The write spans (parameters, the tier's buffers) are checked disjoint and indexed once
(guards.SpanIndex), and built again, with every gradient checked against them, whenever any of
that memory may have moved: a row revalidated, a parameter without a gradient whose (address,
bytes) differ, another tier buffer, a new group. Otherwise only new gradients are checked. At a
rebuild the record of every gradient not checked in it is dropped, so a gradient that comes back
later is checked again; after any exception nothing is trusted (the next step rebuilds).
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..base.dist import is_dtensor, local
from ..base.tensors import ptr
from ..native.adam import (COL_G, COL_GD, COL_OD, COL_OUT, COL_P, DTYPE_CODES, OUT_USER_PARAM,
                           TASK_COLS)
from .guards import SpanIndex, span_of, spans_of
from ..state.layout import piece_columns
from .base import LOW_PRECISION, check_grad
from ..native.rows import (M_CODE, M_COLS, M_GPTR, M_LOWP, M_NUMEL, M_PPTR, M_PVER, ROW_FNS,
                           collect_rows, no_grad_ref, record_param)

__all__ = ["HostRows"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ESIZE = np.array([0, 4, 2, 2], dtype=np.int64)   # bytes per element by DTYPE_CODES
_PTR_COLS = np.array([COL_P, COL_G, COL_GD, COL_OUT, COL_OD])   # ptrs' columns, in its order


def _row_bytes(meta: np.ndarray) -> np.ndarray:
    """Bytes of each recorded row's parameter (and of its gradient: same dtype and shape), from its
    record."""
    return meta[:, M_NUMEL] * _ESIZE[np.clip(meta[:, M_CODE], 0, 3)]


class StepGrads(list):
    """One group's gradients of one step, as collect returns them; ``token`` ties them to the
    records made in the same collect (ptrs reads the table only for these), without keeping them
    alive."""
    __slots__ = ("token",)


class GroupRows:
    """The records of one group (the arrays collect_rows reads and writes), and this step's
    result."""

    def __init__(self, params: list):
        n = len(params)
        self.params = params
        self.meta = np.zeros((n, M_COLS), dtype=np.int64)
        self.meta[:, [M_PPTR, M_GPTR, M_PVER]] = -1
        self.layouts: list = [None] * n
        self.g_ref: list = [no_grad_ref] * n
        # P, OUT, OD, G, GD columns as ptrs() needs them
        self.table = np.zeros((n, TASK_COLS), dtype=np.int64)
        self.token = -1                       # the collect whose gradients the table describes
        # rows whose table columns describe this step's tensors
        self.plain = np.zeros(n, dtype=bool)
        # (SpanIndex, key of the records) last found to match that index
        self.spans_ok = (None, None)
        # record() calls: the only writer of a row's span columns
        self.recorded = 0

    def record(self, i: int, lp: torch.Tensor, g: torch.Tensor) -> None:
        """Row i was validated (check_grad) with plain parameter ``lp`` and gradient ``g``."""
        low = lp.dtype in LOW_PRECISION
        self.recorded += 1
        record_param(self, i, lp, DTYPE_CODES[lp.dtype])
        m, t = self.meta[i], self.table[i]
        m[M_PVER], m[M_LOWP] = (lp._version if low else -1), low
        t[COL_P], t[COL_OUT] = (0, ptr(lp)) if low else (ptr(lp), 0)
        t[COL_OD] = OUT_USER_PARAM[lp.dtype] if low else 0
        self.g_ref[i] = weakref.ref(g)
        m[M_GPTR] = g.data_ptr()
        t[COL_G], t[COL_GD] = ptr(g), DTYPE_CODES[g.dtype]


class HostRows:
    def __init__(self):
        self.groups: List[GroupRows] = []
        self.spans: Optional[SpanIndex] = None
        self.steps = 0
        self.revalidated: list = []

    def collect(self, groups: Sequence[list], local_groups: Sequence[list], dtypes: list,
                numels: list, own: Optional[torch.Tensor], mode: str) -> tuple:
        """(active, grads): per group a bool mask of the parameters with a gradient and the list of
        their (local) gradients; raises, as check_grad / check_overlaps do, for what cannot be
        stepped."""
        try:
            return self._collect(groups, local_groups, dtypes, numels, own, mode)
        except BaseException:
            self.spans = None
            raise

    def _collect(self, groups, local_groups, dtypes, numels, own, mode) -> tuple:
        while len(self.groups) < len(groups):
            self.groups.append(GroupRows(groups[len(self.groups)]))
        active, grads, new = [], [], []
        # (gi, rows) checked in Python this step (changed in any way)
        self.revalidated = revalidated = []
        moved = False
        self.steps += 1
        for gi, params in enumerate(groups):
            rows = self.groups[gi]
            if rows.params is not params or len(rows.g_ref) != len(params):
                rows = self.groups[gi] = GroupRows(params)
            n = len(params)
            rows.token = -1
            got = [None] * n
            ready, newgrad, changed, other = collect_rows(params, rows.g_ref, rows.meta,
                                                          rows.layouts, rows.table,
                                                             ROW_FNS, got)
            gs = StepGrads(got)
            # every row as recorded (each row is in one list at most): the steady state
            if len(ready) == n:
                a = np.ones(n, dtype=bool)
                slow = []
            else:
                a = np.zeros(n, dtype=bool)
                a[ready] = True
                a[newgrad] = True
                slow = sorted(changed.tolist()
                              + [i for i in other.tolist() if params[i].grad is not None])
            rows.plain[:] = a
            for i in slow:   # the full Python checks, each with its message
                p = params[i]
                g = p.grad
                check_grad(p, g, gi, i, dtypes[gi][i], numels[gi][i], mode, False)
                lg = local(g)
                gs[i] = lg
                a[i] = True
                if type(p) in _PLAIN and not is_dtensor(lg):
                    rows.record(i, p, lg)
                    rows.plain[i] = True
            moved = moved or bool(slow) or bool(len(other))
            gs.token = rows.token = self.steps
            active.append(a)
            grads.append(gs)
            new.append((gi, newgrad, slow))
            if slow:
                revalidated.append((gi, slow))
        self._check_overlaps(local_groups, active, grads, new, own, mode, moved)
        return active, grads

    def _check_overlaps(self, local_groups, active, grads, new, own, mode, moved: bool) -> None:
        spans = self.spans
        if not moved and spans is not None:
            moved = len(spans.where) != len(local_groups) or spans.own != spans_of(own) or \
                any(len(w) != len(ps) for w, ps in zip(spans.where, local_groups))
        if not moved and spans is not None:
            for gi, (rows, a) in enumerate(zip(self.groups, active)):
                w = spans.where[gi]
                # the comparison below reads only the rows' span columns, written by record()
                # alone, and w (fixed for one SpanIndex): the same rows, not recorded since, match
                # this index again
                key = (rows.plain.tobytes(), rows.recorded)
                if rows.spans_ok[0] is not spans or rows.spans_ok[1] != key:
                    meta = rows.meta[rows.plain]
                    nb = _row_bytes(meta)
                    if not (np.array_equal(w[rows.plain, 1], nb) and
                            np.array_equal(np.where(nb > 0, w[rows.plain, 0], 0),
                                           np.where(nb > 0, meta[:, M_PPTR], 0))):
                        moved = True
                        break
                    rows.spans_ok = (spans, key)
                if a.all():
                    continue
                ps = local_groups[gi]
                if any(span_of(ps[i]) != tuple(w[i]) for i in np.flatnonzero(~a).tolist()):
                    # a parameter without a gradient: its memory is written by no one, but
                    moved = True
                    break          # another's gradient may not overlap it either
        if moved or spans is None:
            self.spans = None
            spans = SpanIndex(local_groups, own, mode)   # raises for parameters that share memory
            spans.check_grads((gi, i, g) for gi, gs in enumerate(grads) for i, g in enumerate(gs)
                              if g is not None)
            for rows, a in zip(self.groups, active):
                for i in np.flatnonzero(~a).tolist():
                    # not checked against these spans: checked when it comes back
                    rows.g_ref[i] = no_grad_ref
            self.spans = spans
        else:
            for gi, fresh, slow in new:
                # new plain gradients, validated natively: their records give (address, bytes)
                if len(fresh):
                    rows = self.groups[gi]
                    meta = rows.meta[fresh]
                    nb = _row_bytes(meta)
                    bad = spans.check_spans(rows.table[fresh, COL_G], nb)
                    if len(bad):   # the checks of the tensors themselves raise, naming both
                        spans.check_grads((gi, i, grads[gi][i]) for i in fresh.tolist())
                if slow:
                    spans.check_grads((gi, i, grads[gi][i]) for i in slow)

    @property
    def rows_epoch(self) -> int:
        """Moves with every full check (``collect``): records made, write spans built again."""
        return self.steps

    def steady(self, groups: Sequence[list]) -> Optional[list]:
        """The row check of a planned step (engine/fastpath.py): per group (its gradients, the rows
        with a new gradient) when every parameter is as recorded and has its recorded gradient or
        a new plain one (which the native check accepted and which is checked here against the
        write spans, as ``collect`` checks it); None, the records left as they were, when anything
        else changed (``collect`` then looks at every row)."""
        spans, out = self.spans, []
        if spans is None or len(self.groups) != len(groups):
            return None
        try:
            for gi, params in enumerate(groups):
                r = self.groups[gi]
                got = [None] * len(params)
                ready, newgrad, _, _ = collect_rows(params, r.g_ref, r.meta, r.layouts, r.table,
                                                    ROW_FNS, got)
                out.append((got, newgrad))
                if len(ready) + len(newgrad) != len(params):
                    for (_, fresh), r in zip(out, self.groups):   # collect sees them as new again
                        for i in fresh.tolist():
                            r.g_ref[i] = no_grad_ref
                    return None
            for gi, (got, fresh) in enumerate(out):
                if len(fresh):
                    r = self.groups[gi]
                    if len(spans.check_spans(r.table[fresh, COL_G], _row_bytes(r.meta[fresh]))):
                        spans.check_grads((gi, i, got[i]) for i in fresh.tolist())
        except BaseException:
            self.spans = None   # as after a failed collect: nothing is trusted
            self.steps += 1
            raise
        return out

    def bumped_all(self) -> None:
        """:meth:`bumped` with every parameter active."""
        self.bumped([np.ones(len(r.plain), dtype=bool) for r in self.groups])

    def bumped(self, active: list) -> None:
        """The step raised the version counter of the parameters ``active`` by one
        (HostParams.stepped): the recorded version of each bf16/fp16 row among them follows. Every
        such row was checked against its record (or recorded) by this step's collect, and nothing
        writes a parameter between that and the kernel; a write by anyone else leaves the counter
        ahead of the record (a revalidation and a resync, never a missed write)."""
        for rows, a in zip(self.groups, active):
            if len(a) != len(rows.plain):
                continue
            sel = a & rows.plain & (rows.meta[:, M_LOWP] != 0) & (rows.meta[:, M_PVER] >= 0)
            if sel.any():
                rows.meta[sel, M_PVER] += 1

    def ptrs(self, b, pieces, grads) -> Optional[np.ndarray]:
        """The (param, grad, grad dtype, out, out dtype) addresses of ``pieces`` of bucket ``b`` as
        params/host.py computes them, from this step's records; None if a piece is not recorded."""
        if b.group >= len(self.groups):
            return None
        rows = self.groups[b.group]
        if getattr(grads, "token", None) != rows.token or rows.token < 0:
            return None
        idx, starts = piece_columns(b, pieces, "param", "start")
        if not rows.plain[idx].all():
            return None
        out = rows.table[idx[:, None], _PTR_COLS]   # (a copy)
        # pieces that start inside their parameter: addresses move by their offsets
        if starts.any():
            off = starts * _ESIZE[out[:, 2]]
            out[:, 1] += off
            for c in (0, 3):   # (0: no such address)
                out[:, c] += np.where(out[:, c] != 0, off, 0)
        return out


