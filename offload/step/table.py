"""step/table.py: native task-table rows of one bucket (the only place that knows the column order).

A row points the kernel at one piece: its fp32 master (a state section, or the host fp32 parameter
itself), its moments (state sections), its gradient and, for bf16/fp16 or device parameters, where
the rounded new weight goes (the parameter, or a staging slot).

Buckets with compressed moments (``b.moments`` "bf16"/"8bit") get rows of the compressed-moment
kernel (offload/_moments.py) instead; its column order is read once from ``moment_table`` itself
(:func:`_moment_cols`), not assumed.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from .._kernels import (COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_STEP, COL_V, COL_VMAX,
                        TASK_COLS)

__all__ = ["bucket_rows", "kernel_for"]


def bucket_rows(b, pieces: Sequence, base: int, ptrs: Sequence[tuple], steps: Sequence[int]) -> np.ndarray:
    """Rows for ``pieces`` of bucket ``b`` whose state starts at address ``base``.

    ``ptrs[r]`` = (param address or 0 for the master section, grad address, grad dtype code,
    out address or 0, out dtype code); ``steps[r]`` the step count after this update.
    """
    if b.moments != "fp32":
        return _moment_rows(b, pieces, base, ptrs, steps)
    t = np.zeros((len(pieces), TASK_COLS), dtype=np.int64)
    m, v = base + b.section("exp_avg"), base + b.section("exp_avg_sq")
    vmax = base + b.section("max_exp_avg_sq") if b.amsgrad else 0
    master = base + b.section("master_param") if b.master else 0
    for r, (pc, (pa, ga, gc, oa, oc), st) in enumerate(zip(pieces, ptrs, steps)):
        row = t[r]
        off = pc.pos * 4
        row[COL_P] = pa if pa else master + off
        row[COL_M] = m + off
        row[COL_V] = v + off
        row[COL_VMAX] = vmax + off if vmax else 0
        row[COL_G] = ga
        row[COL_OUT] = oa
        row[COL_N] = pc.n
        row[COL_STEP] = int(st)
        row[COL_GD] = gc
        row[COL_OD] = oc
    return t


def kernel_for(b):
    """The native entry that steps bucket ``b``'s rows (fp32 or compressed moments)."""
    if b.moments == "fp32":
        from .._kernels import step_table
        return step_table
    from .._moments import step_moment_table
    return step_moment_table


@lru_cache(maxsize=None)
def _moment_cols(fmt: str) -> dict:
    """Column of each field in a compressed-moment table row, found by building one row with
    ``moment_table`` from tensors whose addresses and sizes are known."""
    from .._kernels import DTYPE_CODES
    from .._moments import MOMENT_FORMATS, moment_state, moment_table
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


def _moment_rows(b, pieces, base, ptrs, steps) -> np.ndarray:
    from .._moments import MOMENT_FORMATS
    c = _moment_cols(b.moments)
    t = np.zeros((len(pieces), c["ncols"]), dtype=np.int64)
    keys = dict(b.keys)
    for r, (pc, (pa, ga, gc, oa, oc), st) in enumerate(zip(pieces, ptrs, steps)):
        row = t[r]
        row[c["p"]] = pa if pa else base + b.section("master_param") + pc.pos * 4
        row[c["m"]] = base + b.span("exp_avg", pc)[0]
        row[c["v"]] = base + b.span("exp_avg_sq", pc)[0]
        if "exp_avg_scale" in keys:
            row[c["m_scale"]] = base + b.span("exp_avg_scale", pc)[0]
            row[c["v_scale"]] = base + b.span("exp_avg_sq_scale", pc)[0]
        row[c["g"]] = ga
        row[c["out"]] = oa
        row[c["n"]] = pc.n
        row[c["step"]] = int(st)
        row[c["gdtype"]] = gc
        row[c["odtype"]] = oc
        row[c["mfmt"]] = MOMENT_FORMATS[b.moments]
    return t
