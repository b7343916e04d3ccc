"""native/moments.py: validated tensor API of the compressed-moment Adam kernel (formats in
csrc/moments.h). Re-exported by ``offload.kernels``; the state engine steps compressed buckets
through ``moment_table`` / ``step_moment_table`` (offload/engine/table.py).

Formats: ``"bf16"`` (exp_avg/exp_avg_sq are bfloat16 tensors, round-to-nearest-even) and ``"8bit"``
(exp_avg int8, exp_avg_sq uint8, blocks of 256 elements with one float32 scale per block and
moment: m through a square-root-like code, v through a 4th-root-like one, both bit shifts of the
float pattern; exact definition in csrc/moments.h). Use :func:`moment_state` for zeroed buffers,
:func:`adam_step_moments` for a validated call, :func:`moment_table` + :func:`step_moment_table`
for a prebuilt table, :func:`decode_moments` to read fp32 values back.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from . import _C
from ..base.tensors import bump_versions, check_tensor, ptr
from .adam import DTYPE_CODES, OUT_NONE, out_and_step

__all__ = ["MOMENT_FORMATS", "MOMENT_BLOCK", "MOMENT_TASK_COLS", "MOMENT_COLS", "moment_state",
           "moment_table", "adam_step_moments", "step_moment_table", "decode_moments"]

# the codes of the mfmt column (csrc/moments.h)
MOMENT_FORMATS = {"bf16": int(_C.MOMENT_CODE_BF16), "8bit": int(_C.MOMENT_CODE_8BIT)}
MOMENT_BLOCK = int(_C.MOMENT_BLOCK)  # 256
# p, m, v, m_scale, v_scale, g, out, n, step, gdtype, odtype, mfmt
MOMENT_TASK_COLS = int(_C.MOMENT_TASK_COLS)
# {field: column} of a row, as the native row struct lays them out (AdamQTask, csrc/moments.h)
MOMENT_COLS = {f: int(getattr(_C, f"MOMENT_COL_{f.upper()}")) for f in (
    "p", "m", "v", "m_scale", "v_scale", "g", "out", "n", "step", "gd", "od", "fmt")}
# per format: exp_avg's and exp_avg_sq's dtypes, and whether it has per-block scales
_LAYOUT = {"bf16": (torch.bfloat16, torch.bfloat16, False),
           "8bit": (torch.int8, torch.uint8, True)}


def _check_fmt(fmt: str) -> tuple:
    """(exp_avg dtype, exp_avg_sq dtype, scaled) of format ``fmt``; ValueError if unknown."""
    got = _LAYOUT.get(fmt) if isinstance(fmt, str) else None
    if got is None:
        raise ValueError(f"unknown moment format {fmt!r}: expected one of "
                         f"{', '.join(MOMENT_FORMATS)}")
    return got


def _nblocks(n: int) -> int:
    return (n + MOMENT_BLOCK - 1) // MOMENT_BLOCK


def moment_state(numel: int, fmt: str) -> dict:
    """Zeroed compressed moments for ``numel`` elements: exp_avg, exp_avg_sq (+ the two scale
    vectors for "8bit"; all-zero bytes and scales are the zero state)."""
    md, vd, scaled = _check_fmt(fmt)
    st = {"exp_avg": torch.zeros(numel, dtype=md), "exp_avg_sq": torch.zeros(numel, dtype=vd)}
    if scaled:
        st["exp_avg_scale"] = torch.zeros(_nblocks(numel))
        st["exp_avg_sq_scale"] = torch.zeros(_nblocks(numel))
    return st


def moment_table(params, grads, exp_avgs, exp_avg_sqs, steps, *, fmt: str, m_scales=None,
                 v_scales=None, outs=None) -> np.ndarray:
    """Validate the tensors and build the int64 table for :func:`step_moment_table`.

    The table holds raw pointers: the tensors must stay alive (and unmoved) while it is used.
    """
    md, vd, q8 = _check_fmt(fmt)
    n = len(params)
    seqs = [("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
            ("steps", steps)]
    if q8:
        if m_scales is None or v_scales is None:
            raise ValueError('fmt="8bit" needs m_scales and v_scales (see moment_state)')
        seqs += [("m_scales", m_scales), ("v_scales", v_scales)]
    if outs is not None:
        seqs.append(("outs", outs))
    for name, seq in seqs:
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries, params has {n}")
    table = np.zeros((n, MOMENT_TASK_COLS), dtype=np.int64)
    for i in range(n):
        p = check_tensor(params[i], f"params[{i}]")
        k = p.numel()
        g = check_tensor(grads[i], f"grads[{i}]", dtypes=tuple(DTYPE_CODES), numel=k)
        m = check_tensor(exp_avgs[i], f"exp_avgs[{i}]", dtypes=(md,), numel=k)
        v = check_tensor(exp_avg_sqs[i], f"exp_avg_sqs[{i}]", dtypes=(vd,), numel=k)
        ms = vs = None
        if q8:
            ms = check_tensor(m_scales[i], f"m_scales[{i}]", numel=_nblocks(k))
            vs = check_tensor(v_scales[i], f"v_scales[{i}]", numel=_nblocks(k))
        o, step = out_and_step(outs, steps, i, k)
        table[i] = (ptr(p), ptr(m), ptr(v), ptr(ms), ptr(vs), ptr(g), ptr(o), k, step,
                    DTYPE_CODES[g.dtype], DTYPE_CODES[o.dtype] if o is not None else OUT_NONE,
                    MOMENT_FORMATS[fmt])
    return table


def step_moment_table(table: np.ndarray, hyper: dict, grad_multiplier: float = 1.0,
                      threads: int = 0, reference: bool = False) -> None:
    """Run the compressed-moment step over a prebuilt table (``hyper`` as for ``step_table``:
    lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize). The native layer
    re-checks the table; amsgrad=True is refused."""
    _C._adam_step_moments(table, float(hyper["lr"]), float(hyper["beta1"]), float(hyper["beta2"]),
                         float(hyper["eps"]), float(hyper["weight_decay"]),
                          bool(hyper["decoupled"]),
                         bool(hyper["amsgrad"]), bool(hyper["maximize"]), float(grad_multiplier),
                          int(threads),
                         bool(reference))


def adam_step_moments(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                      steps: Sequence[int],
                      *, fmt: str, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float,
                      decoupled: bool, amsgrad: bool = False, maximize: bool = False,
                      grad_multiplier: float = 1.0,
                      m_scales: Optional[Sequence[torch.Tensor]] = None,
                      v_scales: Optional[Sequence[torch.Tensor]] = None,
                      outs: Optional[Sequence[Optional[torch.Tensor]]] = None, threads: int = 0,
                      reference: bool = False) -> None:
    """One Adam/AdamW update of every tensor with compressed moments, in one native call.

    ``params`` are fp32 masters (updated in place), ``grads`` fp32/bf16/fp16, moments as made
    by :func:`moment_state`. Same math as :func:`offload.kernels.adam_step` on the decoded moments;
    every tensor written gets its version counter raised, as torch's in-place ops do.
    """
    table = moment_table(params, grads, exp_avgs, exp_avg_sqs, steps, fmt=fmt, m_scales=m_scales,
                         v_scales=v_scales, outs=outs)
    step_moment_table(table, dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay,
                                  decoupled=decoupled, amsgrad=amsgrad, maximize=maximize),
                      grad_multiplier, threads, reference)
    bump_versions([t for seq in (params, exp_avgs, exp_avg_sqs, m_scales or (), v_scales or (),
                                 outs or ())
                   for t in seq if t is not None])


def decode_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, fmt: str,
                   m_scale: Optional[torch.Tensor] = None,
                   v_scale: Optional[torch.Tensor] = None) -> tuple:
    """fp32 (exp_avg, exp_avg_sq) exactly as the kernel decodes them."""
    if not _check_fmt(fmt)[2]:   # bf16: exactly the stored values
        return exp_avg.float(), exp_avg_sq.float()
    n = exp_avg.numel()
    idx = torch.arange(n) // MOMENT_BLOCK
    # the kernel's decode (csrc/moments.h): x = q * (scale / 127); m = shl1(|x|) with x's sign; w =
    # q * (scale / 255); s = shl1(w); v = s * s. shl1: the float bit pattern shifted left by one.
    xi = (exp_avg.float() * (m_scale / 127.0)[idx]).view(torch.int32)
    m = (((xi & 0x7FFFFFFF) << 1) | (xi & -2**31)).view(torch.float32)  # |x| < 2: no overflow
    s = ((exp_avg_sq.float() * (v_scale / 255.0)[idx]).view(torch.int32) << 1).view(torch.float32)
    v = s * s
    bad = (torch.isnan(m_scale) | torch.isnan(v_scale))[idx]  # a poisoned block decodes to NaN
    if bool(bad.any()):
        m = m.masked_fill(bad, float("nan"))
        v = v.masked_fill(bad, float("nan"))
    return m, v
