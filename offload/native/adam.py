"""native/adam.py: the fp32-moment Adam entry points of the native core ``offload._C``.

It validates tensors (device, dtype, layout, sizes, storage bounds, neg/conj bits, overlap: the
checks of offload/base/tensors.py) before any pointer crosses into C++, and builds the int64 task
tables the private native multi-tensor entry points (``_C._adam_step``, ``_C._grad_sumsq``,
``_C._bandwidth_probe``) take. Everything above this file deals in tensors; everything below it in
pointers and lengths. The public, validated subset is re-exported as ``offload.kernels``
(offload/kernels.py); ``step_table`` is internal (tables built by the optimizer, the store and the
GPU pipeline from tensors they validated; see the comment at the top of csrc/bindings.cpp).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

from ..base.dtypes import LOW_PRECISION, NATIVE_DTYPES
from ..base.tensors import bump_versions, check_no_overlap, check_tensor, ptr
from . import _C

__all__ = [
    "DTYPE_CODES", "TASK_COLS", "PROBE_MODES", "MOMENT_PROBE_MODES", "adam_step", "adam_table",
    "step_table",
    "grad_sumsq", "bandwidth_probe", "bandwidth_probe_moments", "fingerprint", "set_isa",
    "get_isa", "available_isas", "set_stream_prefetch", "get_stream_prefetch",
    "get_num_threads", "set_num_threads", "affinity_cpus",
]

# dtype codes shared with csrc/common.h
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
OUT_NONE = 0
# out codes for a bf16/fp16 parameter that is the kernel's output (csrc/common.h
# kBF16Sync/kF16Sync): elements the user wrote since the last step (they differ from round(master))
# are adopted first
OUT_USER_PARAM = {torch.bfloat16: 4, torch.float16: 5}
# the task table's columns, as the native row struct lays them out (AdamTask, csrc/common.h)
TASK_COLS = int(_C.TASK_COLS)  # p, m, v, vmax, g, out, n, step, gdtype, odtype
COL_P, COL_M, COL_V, COL_VMAX, COL_G, COL_OUT, COL_N, COL_STEP, COL_GD, COL_OD = (int(getattr(
    _C, f"COL_{c}")) for c in ("P", "M", "V", "VMAX", "G", "OUT", "N", "STEP", "GD", "OD"))


def out_and_step(outs, steps, i: int, k: int) -> tuple:
    """Tensor i's optional low-precision output (checked: a kernel dtype, k elements) and its step
    count (an int >= 1), as the kernel tables of this module and of native/moments.py take them."""
    o = outs[i] if outs is not None else None
    if o is not None:
        check_tensor(o, f"outs[{i}]", dtypes=tuple(DTYPE_CODES), numel=k)
    step = int(steps[i])
    if step < 1:
        raise ValueError(f"steps[{i}] must be >= 1, got {step}")
    return o, step


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor],
              exp_avg_sqs: Sequence[torch.Tensor],
              max_exp_avg_sqs: Optional[Sequence[torch.Tensor]],
              steps: Sequence[int], *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, decoupled: bool, amsgrad: bool = False, maximize: bool = False,
              grad_multiplier: float = 1.0,
              outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
              threads: int = 0, reference: bool = False) -> None:
    """One Adam/AdamW update of every tensor, in one native call (validated tensor API).

    ``params``/``exp_avgs``/``exp_avg_sqs``/``max_exp_avg_sqs`` are fp32 and updated in place;
    ``grads`` may be fp32, bf16 or fp16; ``outs[i]`` (optional) receives the new weights as
    bf16/fp16/fp32. ``steps[i]`` is the step count after this update (>= 1).
    ``reference=True`` runs the plain scalar reference instead of the SIMD kernels. Every tensor
    written gets its version counter raised, as torch's in-place ops do.
    """
    n = len(params)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("steps", steps)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries, params has {n}")
    if amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != n):
        raise ValueError("amsgrad=True needs one max_exp_avg_sq per param")
    if outs is not None and len(outs) != n:
        raise ValueError(f"outs has {len(outs)} entries, params has {n}")
    table = adam_table(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None,
                       steps, outs)
    _C._adam_step(table, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                  bool(decoupled), bool(amsgrad), bool(maximize), float(grad_multiplier),
                  int(threads), bool(reference))
    bump_versions([t for seq in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else (),
                                 outs or ())
                   for t in seq if t is not None])


def adam_table(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
               outs=None) -> np.ndarray:
    """Validate the tensors of one multi-tensor Adam call and return its task table (rows as in
    ``TASK_COLS``). ``max_exp_avg_sqs`` is None without amsgrad; ``outs[i]`` may be None. The
    table holds raw pointers: the tensors must stay alive and unmoved while it is used."""
    n = len(params)
    amsgrad = max_exp_avg_sqs is not None
    table = np.zeros((n, TASK_COLS), dtype=np.int64)
    written, read = [], []
    for i in range(n):
        p = check_tensor(params[i], f"params[{i}]")
        k = p.numel()
        g = check_tensor(grads[i], f"grads[{i}]", dtypes=tuple(DTYPE_CODES), numel=k)
        m = check_tensor(exp_avgs[i], f"exp_avgs[{i}]", numel=k)
        v = check_tensor(exp_avg_sqs[i], f"exp_avg_sqs[{i}]", numel=k)
        vm = check_tensor(max_exp_avg_sqs[i], f"max_exp_avg_sqs[{i}]",
                          numel=k) if amsgrad else None
        o, step = out_and_step(outs, steps, i, k)
        written += [(f"params[{i}]", p), (f"exp_avgs[{i}]", m), (f"exp_avg_sqs[{i}]", v),
                    (f"max_exp_avg_sqs[{i}]", vm), (f"outs[{i}]", o)]
        read.append((f"grads[{i}]", g))
        table[i] = (ptr(p), ptr(m), ptr(v), ptr(vm), ptr(g), ptr(o), k, step,
                    DTYPE_CODES[g.dtype], DTYPE_CODES[o.dtype] if o is not None else OUT_NONE)
    check_no_overlap(written, read)
    return table


def step_table(table: np.ndarray, hyper: dict, grad_multiplier: float, threads: int) -> None:
    """Run the native Adam step over a prebuilt task table (rows as in ``TASK_COLS``). Internal.

    ``hyper`` holds lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad and maximize, as
    ``offload.Adam.group_hyper`` returns them. The native layer re-checks the table's
    shape, dtype codes, lengths and per-row overlap, but TRUSTS every address to be live memory
    of the stated length: callers build rows only from tensors they validated with
    ``check_tensor``, keep those tensors alive, and revalidate a row whenever
    ``tensor_signature`` of its tensors changes. Not part of ``offload.kernels``.
    """
    _C._adam_step(table, hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"],
                  hyper["weight_decay"],
                 hyper["decoupled"], hyper["amsgrad"], hyper["maximize"], float(grad_multiplier),
                  int(threads),
                 False)


def grad_sumsq(grads: Sequence[torch.Tensor], threads: int = 0) -> float:
    """Sum of squares (float64) over all gradients; inf/nan if any element is non-finite.

    Deterministic for any thread count.
    """
    table = np.zeros((len(grads), 3), dtype=np.int64)
    for i, g in enumerate(grads):
        check_tensor(g, f"grads[{i}]", dtypes=tuple(DTYPE_CODES))
        table[i] = (ptr(g), g.numel(), DTYPE_CODES[g.dtype])
    return _C._grad_sumsq(table, int(threads))


# the probe's ways of walking memory (csrc/common.h ProbeMode), in mode order
PROBE_MODES = ("fused + software prefetch", "fused, hardware prefetch only",
               "threads on alternate 1 MiB tiles", "one stream at a time, 16 KiB tiles")


def bandwidth_probe(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    threads: int = 0, mode: int = 0) -> None:
    """Memory-bandwidth probe with Adam's access pattern (reads p, m, v, g; writes p, m, v).

    All four fp32, contiguous, the same number of elements; p, m, v must not overlap anything.
    ``mode``: how memory is walked, an index into ``PROBE_MODES``.
    """
    n = check_tensor(p, "p").numel()
    for name, t in (("m", m), ("v", v), ("g", g)):
        check_tensor(t, name, numel=n)
    check_no_overlap([("p", p), ("m", m), ("v", v)], [("g", g)])
    if not isinstance(mode, int) or not 0 <= mode < len(PROBE_MODES):
        raise ValueError(f"mode must be an int in [0, {len(PROBE_MODES)}) "
                         f"(PROBE_MODES), got {mode!r}")
    _C._bandwidth_probe(ptr(p), ptr(m), ptr(v), ptr(g), n, int(threads), mode)


_MOMENT_PROBE_DTYPES = {1: (torch.int8, torch.uint8),
                        2: (torch.bfloat16, torch.float16, torch.int16), 4: (torch.float32,)}


MOMENT_PROBE_MODES = PROBE_MODES[:3]  # the ways bandwidth_probe_moments walks memory (mode order)


def bandwidth_probe_moments(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            out: Optional[torch.Tensor] = None, threads: int = 0,
                            mode: int = 0) -> None:
    """The probe with a compressed-moment step's streams (bench: each format's ceiling): reads and
    writes fp32 p and the moments m, v (1, 2 or 4 bytes each, as their dtype says), reads g (fp32
    or 2-byte), reads and writes the optional 2-byte out. All contiguous CPU tensors of p's element
    count; what is written must not overlap anything. ``mode``: an index into
    ``MOMENT_PROBE_MODES``."""
    n = check_tensor(p, "p").numel()
    mb = m.element_size() if isinstance(m, torch.Tensor) else 0
    if mb not in _MOMENT_PROBE_DTYPES:
        raise TypeError("bandwidth_probe_moments: m must be a tensor of 1-, 2- or 4-byte elements")
    check_tensor(m, "m", dtypes=_MOMENT_PROBE_DTYPES[mb], numel=n)
    check_tensor(v, "v", dtypes=(m.dtype,), numel=n)
    check_tensor(g, "g", dtypes=NATIVE_DTYPES, numel=n)
    written = [("p", p), ("m", m), ("v", v)]
    if out is not None:
        check_tensor(out, "out", dtypes=LOW_PRECISION, numel=n)
        written.append(("out", out))
    check_no_overlap(written, [("g", g)])
    if not isinstance(mode, int) or not 0 <= mode < len(MOMENT_PROBE_MODES):
        raise ValueError(f"mode must be an int in [0, {len(MOMENT_PROBE_MODES)}) "
                         f"(MOMENT_PROBE_MODES), got {mode!r}")
    _C._bandwidth_probe_moments(ptr(p), ptr(m), ptr(v), ptr(g), ptr(out) if out is not None else 0,
                                n, mb, g.element_size(), int(threads), mode)


def fingerprint(t: torch.Tensor) -> int:
    """Position-weighted sum of a contiguous CPU tensor's bytes as 32-bit words (exact 64-bit
    products, summed mod 2^64, returned as int64; any dtype): the CPU path of
    offload/params/fingerprint.py."""
    check_tensor(t, "tensor", dtypes=(t.dtype,))
    return int(_C._fingerprint(ptr(t), t.numel() * t.element_size()))


def available_isas() -> list:
    """Instruction sets this CPU supports, best last (always starts with 'scalar')."""
    return list(_C.available_isas())


def get_isa() -> str:
    return _C.get_isa()


def set_isa(name: str) -> None:
    """Force the kernels to an ISA: 'scalar', 'avx2', 'avx512' (x86-64), 'neon', 'sve128',
    'sve256', 'sve512' (aarch64: the SVE one of the CPU's vector length) or 'auto'."""
    _C.set_isa(name)


def set_stream_prefetch(mode: str) -> None:
    """Software prefetch in the fp32 update loop: 'on', 'off' or 'auto' (the default: on for Intel
    CPUs, off for AMD ones, whose hardware prefetchers walk the step's streams faster alone). The
    results are the same bits either way; only the speed differs."""
    _C.set_stream_prefetch(str(mode))


def get_stream_prefetch() -> tuple:
    """(the setting, whether the fp32 loop prefetches now): ('auto', False) on an AMD CPU by
    default."""
    mode, on = _C.get_stream_prefetch()
    return str(mode), bool(on)


def get_num_threads() -> int:
    return _C.get_num_threads()


def set_num_threads(n: int) -> None:
    _C.set_num_threads(int(n))


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (the thread pool's default size)."""
    return _C.affinity_cpu_count()


def _apply_env(name: str, setter, hint: str = "") -> None:
    """``setter(value)`` for a set environment variable; a value it refuses fails the import by
    name."""
    value = os.environ.get(name, "").strip().lower()
    if value:
        try:
            setter(value)
        except ValueError as e:
            raise ImportError(f"{name}={value!r}: {e}{hint}") from None


def init_from_env() -> None:
    """Apply OFFLOAD_ISA, OFFLOAD_PREFETCH and OFFLOAD_NUM_THREADS as import does; ImportError
    names a refused value."""
    _apply_env("OFFLOAD_ISA", _C.set_isa, f" (available: {_C.available_isas()})")
    _apply_env("OFFLOAD_PREFETCH", _C.set_stream_prefetch)
    threads = os.environ.get("OFFLOAD_NUM_THREADS", "").strip()
    if threads:
        _C.set_num_threads(int(threads))


init_from_env()
