"""step/table.py: native task-table rows of one bucket (the only place that knows the column order).

A row points the kernel at one piece: its fp32 master (a state section, or the host fp32 parameter
itself), its moments (state sections), its gradient and, for bf16/fp16 or device parameters, where
the rounded new weight goes (the parameter, or a staging slot).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .._kernels import (COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_STEP, COL_V, COL_VMAX,
                        TASK_COLS)

__all__ = ["bucket_rows"]


def bucket_rows(b, pieces: Sequence, base: int, ptrs: Sequence[tuple], steps: Sequence[int]) -> np.ndarray:
    """Rows for ``pieces`` of bucket ``b`` whose state starts at address ``base``.

    ``ptrs[r]`` = (param address or 0 for the master section, grad address, grad dtype code,
    out address or 0, out dtype code); ``steps[r]`` the step count after this update.
    """
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
