"""optim/fallback.py: the parameters offload's native kernel cannot step, stepped by torch's own
Adam code.

torch.optim.Adam/AdamW accept float64 and complex parameters, non-contiguous ones (a transposed
weight, a strided view) and a parameter listed more than once (torch warns, then steps it once
per listing). The native kernel takes dense fp32/bf16/fp16 tensors only, so these parameters go
through ``torch.optim.adam.adam`` (the single-tensor for-loop implementation, the one torch uses
for CPU tensors by default) with the group's hyperparameters, the fused clip multiplier applied
to a copy of their gradients first. Their ``opt.state[p]`` has torch's layout (``step`` as a
0-dim fp32 tensor, moments in the parameter's dtype and strides), so ``state_dict`` round-trips
with ``torch.optim.AdamW`` and their results are torch's bit for bit.

With ``storage="nvme"|"mmap"`` or compressed moments (the state engine lays out dense
fp32/bf16/fp16 tensors) these parameters are stepped the same way and their state stays in host RAM
in torch's layout, beside the state file: the engine gets the other parameters only
(``Router.split``, whose native part has every parameter at most once) and :func:`engine_index`
maps its positions back to torch's numbering. In GPU-offload mode such parameters are refused by
name (optim/checks.py). The split is logged at INFO on the ``offload.fallback`` logger whenever it
changes (how many, why, and where their state lives); when their host-RAM state exceeds
``RAM_WARN_BYTES`` while the rest lives in a file or in compressed moments, a ``UserWarning`` says
so once per optimizer.
"""
from __future__ import annotations

import logging
import operator
import warnings
from typing import Optional

import torch
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import _get_scalar_dtype

from ..base.dist import is_dtensor, local
from ..base.dtypes import NATIVE_DTYPES as _NATIVE_DTYPES
from ..base.torchadam import check_state
from ..moments.format import moment_format
from ..params.guards import SharedMemoryError, extent

__all__ = ["FALLBACK_DTYPES", "RAM_WARN_BYTES", "elsewhere", "reason", "Router", "check", "step",
           "grad_sumsq", "cast_state", "engine_index"]

FALLBACK_DTYPES = (torch.float64, torch.complex64, torch.complex128)
log = logging.getLogger("offload.fallback")
RAM_WARN_BYTES = 64 << 20   # host-RAM state of these parameters above which a disk tier warns once


def elsewhere(state: str, moments: str) -> Optional[str]:
    """Where the state of the native kernel's parameters lives when not in host RAM like these
    parameters' (the log line and the warning name it); None: host RAM too. (Device parameters are
    never stepped here, but refused by name: for them it is never read.)"""
    if state != "ram":
        return f"the state file (storage={state!r})"
    compressed = moment_format(moments).compressed
    return f"compressed moments (moments={moments!r})" if compressed else None


def reason(p: torch.Tensor) -> Optional[str]:
    """Why ``p`` (alone) needs torch's implementation, or None when the native kernel steps it.

    Tensors the fallback cannot take either (not CPU, sparse, DTensor, other dtypes) return None
    so that the native checks refuse them with their own message.
    """
    if not isinstance(p, torch.Tensor) or is_dtensor(p):
        return None
    if p.device.type != "cpu" or p.layout is not torch.strided:
        return None
    if p.dtype in FALLBACK_DTYPES:
        return f"dtype {p.dtype}"
    if p.dtype in _NATIVE_DTYPES and not p.is_contiguous():
        return f"non-contiguous (strides {tuple(p.stride())})"
    return None


class Router:
    """Splits the param groups into the native part and the fallback part; cached per layout.

    A parameter goes to the fallback when :func:`reason` says so, or when it is listed more than
    once anywhere in the groups (torch steps it once per listing, in group order). The split is
    recomputed whenever the list of parameters of any group changes (compared by identity every
    step); a dtype or layout change of a parameter already stepped natively is refused by the
    native revalidation, as torch itself fails on a moment/parameter dtype mismatch. Only parameter
    lists are cached: hyperparameters are always read from the live group dicts.
    """

    def __init__(self, announce: bool = True, elsewhere: Optional[str] = None):
        # False: a throwaway router (state_dict loading) that logs nothing
        self._announce = announce
        self._elsewhere = elsewhere  # where the other parameters' state lives (None: host RAM too)
        self._warned = False
        self._logged: Optional[str] = None
        self._key: Optional[list] = None
        self._native: list = []      # per group: None (all native) or the list of native params
        # per group: [] or the fallback params in order, duplicates included
        self._fallback: list = []
        self._ids: set = set()
        self._any = False

    def _same(self, groups: list) -> bool:
        key = self._key
        return (key is not None and len(key) == len(groups)
                and all(len(ps) == len(g["params"]) and all(map(operator.is_, ps, g["params"]))
                        for ps, g in zip(key, groups)))

    def _split(self, groups: list) -> None:
        if self._same(groups):  # identity, element by element, in C: no per-parameter Python work
            return
        key = [list(g["params"]) for g in groups]
        seen: dict = {}
        for ps in key:
            for p in ps:
                seen[id(p)] = seen.get(id(p), 0) + 1
        self._native, self._fallback = [], []
        for g in groups:
            ps = g["params"]
            out = [p for p in ps if seen[id(p)] > 1 or reason(p) is not None]
            out_ids = set(map(id, out))
            self._native.append([p for p in ps if id(p) not in out_ids] if out else None)
            self._fallback.append(out)
        if any(self._fallback):
            _refuse_shared_memory(groups, self._native, self._fallback)
        self._ids = {id(p) for f in self._fallback for p in f}
        self._any = bool(self._ids)
        self._key = key
        if self._announce:
            self._log_split(seen, groups)

    def _log_split(self, seen: dict, groups: list) -> None:
        """One INFO line when the set of parameters stepped by torch's code changed (never per
        step)."""
        why: dict = {}
        nbytes = 0
        for g, ps in zip(groups, self._fallback):
            for p in {id(q): q for q in ps}.values():
                r = "listed more than once" if seen[id(p)] > 1 else reason(p)
                r = ("non-contiguous" if r.startswith("non-contiguous")
                     else r.replace("dtype torch.", ""))
                why[r] = why.get(r, 0) + 1
                nbytes += p.numel() * p.element_size() * (3 if g.get("amsgrad") else 2)
        where = (f"; their optimizer state ({nbytes / 2**20:.1f} MiB: moments in the parameter's "
                 f"dtype) is kept in host RAM in torch's layout, not in {self._elsewhere}"
                 ) if self._elsewhere else ""
        msg = (f"{sum(why.values())} of {len(seen)} parameters are stepped by torch's own Adam "
               "code instead of offload's native kernel "
               f"({', '.join(f'{n} {r}' for r, n in sorted(why.items()))}): same results as "
               "torch.optim, but slower; contiguous float32/bfloat16/float16 parameters listed "
               f"once use the native kernel{where}") if why else None
        if self._elsewhere and nbytes > RAM_WARN_BYTES and not self._warned:
            self._warned = True
            warnings.warn(f"{sum(why.values())} parameters ({', '.join(sorted(why))}) keep "
                          f"{nbytes / 2**20:.0f} MiB of optimizer state in host RAM instead of "
                          f"{self._elsewhere}: offload's native kernel takes contiguous "
                          "float32/bfloat16/float16 parameters listed once; convert these (e.g. "
                          "model.float(), p.data = p.data.contiguous()) to keep their "
                          "state there too",
                          UserWarning, stacklevel=4)
        if msg != self._logged:
            if msg is not None:
                log.info(msg)
            elif self._logged is not None:
                log.info("every parameter is now stepped by offload's native kernel")
            self._logged = msg

    def split(self, groups: list) -> tuple:
        """(the groups as the native path sees them, [(group, fallback params)]), one pass."""
        self._split(groups)
        if not self._any:
            return groups, []
        return ([g if n is None else dict(g, params=n) for g, n in zip(groups, self._native)],
                [(g, f) for g, f in zip(groups, self._fallback) if f])

    def is_fallback(self, groups: list, p: torch.Tensor) -> bool:
        self._split(groups)
        return id(p) in self._ids


def _refuse_shared_memory(groups: list, native: list, fallback: list) -> None:
    """A parameter stepped by torch's code that shares memory with one the native kernel steps
    would be updated in another order than torch's (each parameter in turn): refused by name."""
    spans: dict = {}
    for gi, (g, ns) in enumerate(zip(groups, native)):
        for p in (g["params"] if ns is None else ns):
            lp = local(p)
            spans.setdefault(lp.untyped_storage().data_ptr(), []).append((_bytes(lp), gi, p))
    for gi, (g, fs) in enumerate(zip(groups, fallback)):
        for q in fs:
            lq = local(q)
            c, d = _bytes(lq)
            for (a, b), gj, p in spans.get(lq.untyped_storage().data_ptr(), ()):
                if a < d and c < b:
                    i = next(k for k, x in enumerate(g["params"]) if x is q)
                    j = next(k for k, x in enumerate(groups[gj]["params"]) if x is p)
                    raise SharedMemoryError(
                        f"parameter {i} of group {gi} ({reason(q) or 'listed more than once'}: "
                        f"stepped by torch's code) shares memory with parameter {j} of group {gj} "
                        "(stepped by offload's kernel): the two would not be updated in torch's "
                        "order. Register one tensor for that memory, or make the other one a "
                        "contiguous float32/bfloat16/float16 tensor of its own")


def _bytes(t: torch.Tensor) -> tuple:
    """The bytes [start, end) a tensor's elements lie in (guards.extent); (0, 0) when empty."""
    return (t.data_ptr(), t.data_ptr() + extent(t)) if t.numel() else (0, 0)


def _init_state(p: torch.Tensor, amsgrad: bool) -> dict:
    # exactly torch.optim.Adam._init_group (capturable=False, fused=False)
    st = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"),
          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if amsgrad:
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def check(state, fallback: list, groups: list) -> None:
    """Everything torch's code would refuse part-way through :func:`step` (after stepping the
    parameters before it), refused before anything is stepped: the gradient (sparse, another shape,
    dtype or device) and the state entries its update reads."""
    for group, params in fallback:
        gi = next(k for k, g in enumerate(groups) if g is group)
        for p in params:
            g = p.grad
            if g is None:
                continue
            where = ("parameter "
                     f"{next(i for i, q in enumerate(group['params']) if q is p)} of group {gi}")
            if g.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider "
                                   "SparseAdam instead")
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise RuntimeError(f"the gradient of {where} is a {g.dtype} tensor of shape "
                                   f"{tuple(g.shape)} on {g.device}, but the parameter is a "
                                   f"{p.dtype} tensor of shape {tuple(p.shape)} on {p.device}: "
                                   "give it a gradient like the parameter (was "
                                   "p.grad.data replaced?)")
            st = state.get(p)
            if not st:
                continue   # fresh state, made by step()
            check_state(p, st, group, where)


def step(state, fallback: list, mult: float, decoupled_override: Optional[bool]) -> None:
    """One torch Adam/AdamW step of the fallback parameters (second item of ``Router.split``);
    ``state``: the optimizer's ``state``."""
    for group, params in fallback:
        plist, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        has_complex = False
        for p in params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider "
                                   "SparseAdam instead")
            st = state[p]
            if len(st) == 0:
                st.update(_init_state(p, group["amsgrad"]))
            elif group["amsgrad"] and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            has_complex |= torch.is_complex(p)
            plist.append(p)
            # never modifies the user's gradient
            grads.append(p.grad if mult == 1.0 else p.grad * mult)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            if group["amsgrad"]:
                max_sqs.append(st["max_exp_avg_sq"])
            steps.append(st["step"])
        if not plist:
            continue
        beta1, beta2 = group["betas"]
        decoupled = (decoupled_override if decoupled_override is not None
                     else bool(group["decoupled_weight_decay"]))
        _torch_adam(plist, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, foreach=False,
                    capturable=False,
                    differentiable=False, fused=None, grad_scale=None, found_inf=None,
                    has_complex=has_complex,
                    decoupled_weight_decay=decoupled, amsgrad=bool(group["amsgrad"]), beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=bool(group["maximize"]))


def grad_sumsq(grads: list) -> float:
    """Sum of |g|^2 over gradients the native reduction does not take (float64, complex,
    strided)."""
    total = 0.0
    for g in grads:
        g = g.detach()
        if g.is_sparse:
            g = g.coalesce().values()
        total += float(g.abs().to(torch.float64).pow(2).sum()) if g.numel() else 0.0
    return total


def cast_state(p: torch.Tensor, st: dict) -> dict:
    """A loaded state entry for a fallback parameter, cast as torch.optim.Optimizer.load_state_dict
    does."""
    out = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor) and k != "step":
            v = (v.to(dtype=p.dtype, device=p.device) if p.is_floating_point()
                 else v.to(device=p.device))
        elif k == "step" and not isinstance(v, torch.Tensor):  # as torch.optim.Adam.__setstate__
            v = torch.tensor(float(v), dtype=_get_scalar_dtype())
        out[k] = v
    return out


def engine_index(groups: list, native: list) -> dict:
    """{(group, position in the state engine's list): index in torch's state_dict numbering} for
    the native parameters ``native`` (the first item of ``Router.split``), which the engine
    holds."""
    out, index = {}, 0
    for gi, (g, n) in enumerate(zip(groups, native)):
        ps = g["params"]
        if n is g or n["params"] is ps:
            out.update({(gi, i): index + i for i in range(len(ps))})
        else:
            ids = {id(p) for p in n["params"]}
            j = 0
            for i, p in enumerate(ps):
                if id(p) in ids:
                    out[(gi, j)] = index + i
                    j += 1
        index += len(ps)
    return out
