"""engine/table.py: native task-table rows of one bucket (the only place that knows the column order).

A row points the kernel at one piece: its fp32 master (a state section, or the host fp32 parameter
itself), its moments (state sections), its gradient and, for bf16/fp16 or device parameters, where
the rounded new weight goes (the parameter, or a staging slot).

Buckets with compressed moments (``b.moments`` "bf16"/"8bit") get rows of the compressed-moment
kernel (offload/native/moments.py) instead; its column order is read once from ``moment_table`` itself
(:func:`_moment_cols`), not assumed.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from ..native.adam import COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_STEP, COL_V, COL_VMAX, TASK_COLS
from ..state.layout import piece_columns

__all__ = ["bucket_rows", "kernel_for", "step_columns"]


def bucket_rows(b, pieces: Sequence, base: int, ptrs, steps: Sequence[int]) -> np.ndarray:
    """Rows for ``pieces`` of bucket ``b`` whose state starts at address ``base``.

    ``ptrs[r]`` = (param address or 0 for the master section, grad address, grad dtype code,
    out address or 0, out dtype code), a sequence of tuples or an (n, 5) int64 array;
    ``steps[r]`` the step count after this update.
    """
    if b.moments != "fp32":
        return _moment_rows(b, pieces, base, ptrs, steps)
    k = len(pieces)
    if not k:
        return np.zeros((0, TASK_COLS), dtype=np.int64)
    t = _static_rows(b, pieces, base).copy()
    p = np.asarray(ptrs, dtype=np.int64).reshape(k, 5)
    pa = p[:, 0]
    t[:, COL_P] = np.where(pa != 0, pa, t[:, COL_P])   # the parameter itself, or its master section
    t[:, _DYNAMIC] = p[:, 1:]
    t[:, COL_STEP] = _step_col(steps, k)
    return t


_DYNAMIC = [COL_G, COL_GD, COL_OUT, COL_OD]   # ptrs' columns 1..4, in that order


def _static_rows(b, pieces, base: int) -> np.ndarray:
    """The columns of bucket_rows that depend only on the bucket, its pieces and the state's address:
    master section (in COL_P), moments, max_exp_avg_sq and element counts. Cached on the bucket for
    its full piece list at one address (the per-step case); the other columns are left 0."""
    full = pieces is b.pieces
    if full:
        got = b.__dict__.get("_static_rows")
        if got is not None and got[0] == base and got[1] == len(pieces) and got[2] == (b.master, b.amsgrad, b.cap, b.gap):
            return got[3]
    k = len(pieces)
    t = np.zeros((k, TASK_COLS), dtype=np.int64)
    pos, n = piece_columns(b, pieces, "pos", "n")
    off = pos * 4
    t[:, COL_P] = (base + b.section("master_param") + off) if b.master else 0
    t[:, COL_M] = base + b.section("exp_avg") + off
    t[:, COL_V] = base + b.section("exp_avg_sq") + off
    if b.amsgrad:
        t[:, COL_VMAX] = base + b.section("max_exp_avg_sq") + off
    t[:, COL_N] = n
    if full:
        b.__dict__["_static_rows"] = (base, k, (b.master, b.amsgrad, b.cap, b.gap), t)
    return t


def _step_col(steps, k: int) -> np.ndarray:
    """The step counts (fp32 values, a list of numpy scalars or an array) as int64, like int(step)."""
    if isinstance(steps, np.ndarray):
        return steps.reshape(k).astype(np.int64)
    if k and isinstance(steps[0], np.floating):   # the registry's fp32 counts: read in their own dtype (exact)
        return np.fromiter(steps, dtype=steps[0].dtype, count=k).astype(np.int64)
    return np.asarray(steps, dtype=np.float64).reshape(k).astype(np.int64)


def kernel_for(b):
    """The native entry that steps bucket ``b``'s rows (fp32 or compressed moments)."""
    if b.moments == "fp32":
        from ..native.adam import step_table
        return step_table
    from ..native.moments import step_moment_table
    return step_moment_table


def step_columns(b) -> tuple:
    """(step count column, gradient address column) of bucket ``b``'s rows."""
    if b.moments == "fp32":
        return COL_STEP, COL_G
    c = _moment_cols(b.moments)
    return c["step"], c["g"]


@lru_cache(maxsize=None)
def _moment_cols(fmt: str) -> dict:
    """Column of each field in a compressed-moment table row, found by building one row with
    ``moment_table`` from tensors whose addresses and sizes are known."""
    from ..native.adam import DTYPE_CODES
    from ..native.moments import MOMENT_FORMATS, moment_state, moment_table
    n = 3
    st = moment_state(n, fmt)
    p, g, out = torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    ms, vs = st.get("exp_avg_scale"), st.get("exp_avg_sq_scale")
    row = moment_table([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [5], fmt=fmt,
                       m_scales=None if ms is None else [ms], v_scales=None if vs is None else [vs], outs=[out])[0]
    ptrs = dict(p=p, m=st["exp_avg"], v=st["exp_avg_sq"], g=g, out=out)
    if ms is not None:
        ptrs.update(m_scale=ms, v_scale=vs)
    cols = {}
    for name, t in ptrs.items():
        hit = np.flatnonzero(row == t.data_ptr())
        if len(hit) != 1:
            raise RuntimeError(f"cannot find the {name!r} column of the compressed-moment table")
        cols[name] = int(hit[0])
    rest = [c for c in range(len(row)) if c not in cols.values()]
    for name, val in (("n", n), ("step", 5), ("gdtype", DTYPE_CODES[torch.float32]),
                      ("odtype", DTYPE_CODES[torch.bfloat16]), ("mfmt", MOMENT_FORMATS[fmt])):
        hit = [c for c in rest if row[c] == val and c not in cols.values()]
        if not hit:
            raise RuntimeError(f"cannot find the {name!r} column of the compressed-moment table")
        cols[name] = hit[0]
    if ms is None:   # unused scale columns: whatever is left (zero)
        left = [c for c in rest if c not in cols.values()]
        cols.update(m_scale=left[0], v_scale=left[1]) if len(left) >= 2 else None
    cols["ncols"] = len(row)
    return cols


def _sections(b) -> dict:
    """{key: (byte offset in the bucket, bytes per entry, per_block)} of a compressed bucket (cached)."""
    got = b.__dict__.get("_msecs")
    if got is not None and got[0] == (b.cap, b.moments, b.master, b.gap):
        return got[1]
    from ..moments import format as mformat
    pb = {k: blk for k, _, blk in mformat.sections(b.moments)}
    out = {k: (b.section(k), size, pb.get(k, False)) for k, size in b.keys}
    b.__dict__["_msecs"] = ((b.cap, b.moments, b.master, b.gap), out)
    return out


def _moment_rows(b, pieces, base, ptrs, steps) -> np.ndarray:
    from ..moments import format as mformat
    from ..native.moments import MOMENT_FORMATS
    c = _moment_cols(b.moments)
    secs = _sections(b)
    t = np.zeros((len(pieces), c["ncols"]), dtype=np.int64)
    pos, n = piece_columns(b, pieces, "pos", "n")
    pa, ga, gc, oa, oc = np.asarray(ptrs, dtype=np.int64).reshape(len(pieces), 5).T

    def at(key):
        off, size, per_block = secs[key]
        return base + off + (pos // mformat.BLOCK if per_block else pos) * size

    t[:, c["p"]] = np.where(pa != 0, pa, at("master_param")) if b.master else pa
    t[:, c["m"]] = at("exp_avg")
    t[:, c["v"]] = at("exp_avg_sq")
    if "exp_avg_scale" in secs:
        t[:, c["m_scale"]] = at("exp_avg_scale")
        t[:, c["v_scale"]] = at("exp_avg_sq_scale")
    t[:, c["g"]] = ga
    t[:, c["out"]] = oa
    t[:, c["n"]] = n
    t[:, c["step"]] = _step_col(steps, len(pieces))
    t[:, c["gdtype"]] = gc
    t[:, c["odtype"]] = oc
    t[:, c["mfmt"]] = MOMENT_FORMATS[b.moments]
    return t
