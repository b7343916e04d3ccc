"""engine/table.py: the native task-table rows of one bucket, by the columns of its moment format.

A row points the kernel at one piece: its fp32 master (a state section, or the host fp32 parameter
itself), its moment sections, its gradient and, for bf16/fp16 or device parameters, where the
rounded new weight goes (the parameter, or a staging slot). Which column holds what, and which
native entry steps the rows, is the bucket's moment format's (``b.moments.columns`` /
``b.moments.kernel``, offload/moments/format.py): every format's rows are built here the same way.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..state.layout import piece_columns

__all__ = ["bucket_rows"]


def bucket_rows(b, pieces: Sequence, base: int, ptrs, steps: Sequence[int]) -> np.ndarray:
    """Rows for ``pieces`` of bucket ``b`` whose state starts at address ``base``.

    ``ptrs[r]`` = (param address or 0 for the master section, grad address, grad dtype code,
    out address or 0, out dtype code), a sequence of tuples or an (n, 5) int64 array;
    ``steps[r]`` the step count after this update.
    """
    c = b.moments.columns
    k = len(pieces)
    if not k:
        return np.zeros((0, c.ncols), dtype=np.int64)
    t = _static_rows(b, pieces, base).copy()
    p = np.asarray(ptrs, dtype=np.int64).reshape(k, 5)
    pa = p[:, 0]
    t[:, c.p] = np.where(pa != 0, pa, t[:, c.p])   # the parameter itself, or its master section
    t[:, c.dynamic] = p[:, 1:]
    t[:, c.step] = _step_col(steps, k)
    return t


def _static_rows(b, pieces, base: int) -> np.ndarray:
    """The columns of bucket_rows that depend only on the bucket, its pieces and the state's
    address: master section (in the p column), the format's sections, element counts and the
    format's fixed columns. Cached on the bucket for its full piece list at one address (the
    per-step case); the other columns are left 0."""
    full = pieces is b.pieces
    shape = (b.master, b.amsgrad, b.cap, b.gap, b.moments)
    if full:
        got = b.__dict__.get("_static_rows")
        if got is not None and got[0] == base and got[1] == len(pieces) and got[2] == shape:
            return got[3]
    fmt = b.moments
    c = fmt.columns
    k = len(pieces)
    t = np.zeros((k, c.ncols), dtype=np.int64)
    pos, n = piece_columns(b, pieces, "pos", "n")
    for key, size in b.keys:
        col = c.p if key == "master_param" else c.sections[key]
        t[:, col] = base + b.section(key) + fmt.entries(key, pos) * size
    t[:, c.n] = n
    for col, value in c.fixed:
        t[:, col] = value
    if full:
        b.__dict__["_static_rows"] = (base, k, shape, t)
    return t


def _step_col(steps, k: int) -> np.ndarray:
    """The step counts (fp32 values, a list of numpy scalars or an array) as int64, like
    int(step)."""
    if isinstance(steps, np.ndarray):
        return steps.reshape(k).astype(np.int64)
    # the registry's fp32 counts: read in their own dtype (exact)
    if k and isinstance(steps[0], np.floating):
        return np.fromiter(steps, dtype=steps[0].dtype, count=k).astype(np.int64)
    return np.asarray(steps, dtype=np.float64).reshape(k).astype(np.int64)
