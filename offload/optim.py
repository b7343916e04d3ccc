"""optim.py: ``offload.Adam`` and ``offload.AdamW``, drop-in ``torch.optim.Optimizer`` subclasses.

The math runs in the native multi-tensor kernel (one call per param group per step). The class
keeps torch's constructor signature, defaults, validation messages and ``state_dict`` layout
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so a state saved here loads into
``torch.optim.AdamW`` and back. bf16/fp16 parameters get an fp32 master copy (state key
``master_param``, the one addition to torch's layout); the kernel writes the rounded new weight
straight into the parameter in the same pass. Parameters the kernel cannot take but torch steps
(float64, complex, non-contiguous, listed twice) go through torch's own Adam code (offload/fallback.py).
"""
from __future__ import annotations

import math
import weakref
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _to_scalar

from . import _C, _kernels, fallback, mformat
from ._dist import is_dtensor, like, local  # DTensor (FSDP2): step the local shard
from ._kernels import (COL_G, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_STEP, COL_V, COL_VMAX,
                       COL_GD, DTYPE_CODES, OUT_USER_PARAM, check_tensor)
from .buffers import round_up
from ._plan import (REC_KEYS, GroupPlan, OverlapIndex, ParamState, StateMap, check_storage, fingerprint,
                    get_version, no_grad_ref, record_param, sync_master)
from .step.compressed import CompressedState  # opt.state[p] with compressed moments (issue 9)
from .gpu import GpuOffloadMixin, make_state_engine, split_params, start_engine  # GPU offload, NVMe/mmap state

__all__ = ["Adam", "AdamW"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what the native fast path (_C.collect_rows, csrc/rows.cpp) reads of each param/grad: the getset
# descriptors and unbound methods of torch's tensor base class (direct C calls, no attribute lookup),
# then the constants it compares with; the order is fixed by csrc/rows.cpp
_TensorBase = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
_TB = _TensorBase.__dict__
_ROW_FNS = (_TB["grad"], _TB["data_ptr"], _TB["dtype"], _TB["stride"], _TB["is_neg"], _TB["is_conj"], _TB["_version"],
            _TB["shape"], _TB["is_cpu"], _TB["layout"], _TB["storage_offset"], _TB["untyped_storage"],
            torch._C.StorageBase.nbytes, torch.Tensor, torch.nn.Parameter, torch.strided,
            torch.float32, torch.bfloat16, torch.float16, _TensorBase)
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_ARENA_STAGGER = 16400  # floats (64 KiB + 64 B) between state streams of one arena: see _init_states


def arena_gap(per_kind: int) -> int:
    """Floats left after each state stream of an arena whose streams hold per_kind floats."""
    return _ARENA_STAGGER if per_kind >= (1 << 18) else 16
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _check_param(p: torch.Tensor, where: str, gpu_mode: bool = False) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(p).__name__}")
    p = local(p)  # DTensor (FSDP2): check the local shard
    if gpu_mode:  # GPU offload: parameters on the device (or CPU tensors driven by a test device)
        if p.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"{where} is on {p.device}: GPU offload supports CUDA parameters")
    elif p.device.type != "cpu":
        raise RuntimeError(f"{where} is on {p.device}: offload steps CPU parameters, or CUDA parameters "
                           "in GPU-offload mode (all parameters on one CUDA device, or offload_device=...)")
    if p.layout is not torch.strided:
        raise RuntimeError(f"{where} is a sparse ({p.layout}) tensor: not supported")
    if p.is_complex():
        raise TypeError(f"{where} is complex ({p.dtype}): offload supports float32, bfloat16 and float16 parameters")
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(f"{where} has dtype {p.dtype}: offload supports float32, bfloat16 and float16 parameters")
    if not p.is_contiguous():
        raise RuntimeError(f"{where} is not contiguous (strides {tuple(p.stride())}): offload updates "
                           "parameters in place and never a temporary copy; make it contiguous first")
    if p.is_neg():  # e.g. z.conj().imag: its memory holds the negated values, and is what the kernel updates
        raise RuntimeError(f"{where} is a lazy negative-bit view: its memory does not hold its values; "
                           "use p.data = p.data.resolve_neg() first")


_F32_MAX = float(torch.finfo(torch.float32).max)


def _check_moments(moments, min_size, amsgrad, params) -> str:
    """``moments=`` and ``moments_min_size=`` of the constructor (issue 9)."""
    mformat.check_moments(moments)
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"moments_min_size must be an int >= 0, got {min_size!r}")
    if moments != "fp32":
        if amsgrad or any(isinstance(g, dict) and g.get("amsgrad") for g in params):
            raise ValueError(f"amsgrad=True is not supported with moments={moments!r} (compressed moments keep no "
                             "max_exp_avg_sq); use moments='fp32' for amsgrad")
    return moments


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    # Same checks and messages as torch.optim.Adam.
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= _scalar(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= _scalar(betas[0]) < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= _scalar(betas[1]) < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    # Beyond torch: torch.optim.AdamW raises "value cannot be converted to type float without
    # overflow" at its first step for lr/eps above the float32 range and silently gives inf/NaN
    # weights for lr=inf or a huge weight_decay; the native kernel computes in float32, so refuse.
    for name, v in (("lr", _scalar(lr)), ("eps", float(eps)), ("weight_decay", float(weight_decay))):
        if not v <= _F32_MAX:
            raise ValueError(f"{name}={v} overflows float32 (max {_F32_MAX:.4g}), the precision the optimizer "
                             "computes in: every weight would become inf/NaN; use a finite value in range")
    if not _scalar(lr) * float(weight_decay) <= _F32_MAX:
        raise ValueError(f"lr * weight_decay = {_scalar(lr) * float(weight_decay)} overflows float32: the decay "
                         "factor 1 - lr*weight_decay would turn every weight into inf; use smaller values")


def _check_init(params, betas, foreach, capturable) -> None:
    """The constructor-only checks of torch.optim.Adam/Optimizer after the value checks, in torch's order."""
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        "but got " + torch.typename(params))


class _AdamBase(GpuOffloadMixin, Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False, threads: Optional[int] = None,
                 state: str = "ram", nvme_dir=None, host_budget="2GiB", keep_files: bool = False,
                 nvme_options: Optional[dict] = None, offload_device=None, moments: str = "fp32",
                 moments_min_size: int = 4096, **gpu_options):
        if isinstance(lr, torch.Tensor) and foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        _check_hyper(lr, betas, eps, weight_decay)
        _check_init(params, betas, foreach, capturable)
        params = list(params)
        for g in params:  # torch's add_param_group check, before split_params turns a set into a list
            if isinstance(g, dict) and isinstance(g.get("params"), set):
                raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                                "of tensors in sets will change between runs. Please use a list instead.")
        # --- NVMe/mmap state (offload/store.py): validated before anything is allocated
        if state not in ("ram", "nvme", "mmap"):
            raise ValueError(f"state must be 'ram', 'nvme' or 'mmap', got {state!r}")
        if state == "ram" and (nvme_dir is not None or nvme_options):
            raise ValueError("nvme_dir/nvme_options only apply to state='nvme' or state='mmap'")
        self._store = None
        # --- compressed Adam moments (issue 9, docs/moments.md): run by the state engine, also for RAM
        self.moments = _check_moments(moments, moments_min_size, amsgrad, params)
        self.moments_min_size = int(moments_min_size)
        # ---
        if capturable:
            raise ValueError("capturable=True is not supported by offload (the step runs on the CPU)")
        if differentiable:
            raise ValueError("differentiable=True is not supported by offload")
        if fused:
            raise ValueError("fused=True selects torch's own kernel; offload always uses its native kernel")
        if threads is not None and not (isinstance(threads, int) and 1 <= threads <= 1024):
            raise ValueError(f"threads must be an int in [1, 1024] or None, got {threads!r}")
        betas = tuple(map(_to_scalar, betas))  # as torch: 1-element tensors become 0-dim tensors
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=False, differentiable=False,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._threads = threads
        self._plans: dict = {}
        self._pending_multiplier = 1.0
        self._state_mode = state
        self._router = fallback.Router()  # float64/complex/strided/duplicate params: torch's code (fallback.py)
        # --- GPU offload: the mode follows from where the parameters are (offload/gpu.py) ---
        params, self._gpu_device = split_params(params, offload_device, gpu_options)
        self._gpu = None
        super().__init__(params, defaults)
        # --- NVMe/mmap state (offload/step/engine.py): one engine for all groups, any parameter side
        if state != "ram" or self.moments != "fp32":
            opts = dict(nvme_options or {})
            if self.moments != "fp32":
                opts.update(moments=self.moments, moments_min_size=self.moments_min_size)
            self._store = make_state_engine(self.param_groups, state, nvme_dir=nvme_dir, host_budget=host_budget,
                                            keep=keep_files, nvme_options=opts,
                                            device=self._gpu_device, gpu_options=gpu_options)
        self._gpu = start_engine(self, self._gpu_device, gpu_options, self._store)
        # --- end GPU offload ---

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group (named parameters, duplicate warning, its checks and messages),
        then offload's own checks of every parameter; the group is not added if one fails.
        With NVMe/mmap state the new group is laid out after the existing state (the file grows)."""
        store = getattr(self, "_store", None)
        if self._gpu is not None and store is None:
            raise NotImplementedError("add_param_group after construction is not supported in GPU-offload mode "
                                      "with state='ram' (it is with state='nvme' or 'mmap')")
        n = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[n], n)
        except BaseException:
            del self.param_groups[n:]
            raise
        self._plans.clear()
        if store is not None:  # NVMe/mmap state: the new group is laid out after the existing state
            try:
                store.add_group(self.param_groups[n]["params"], self.param_groups[n]["amsgrad"])
            except BaseException:
                del self.param_groups[n:]
                raise
            if self._gpu is not None:
                self._gpu.load_state()

    def _check_group(self, group: dict, gi: int) -> None:
        gpu = self._gpu_device is not None
        mode = getattr(self, "_state_mode", "ram")
        if getattr(self, "moments", "fp32") != "fp32":
            if group.get("amsgrad"):
                raise ValueError(f"param group {gi}: amsgrad=True with moments={self.moments!r}: compressed moments "
                                 "have no max_exp_avg_sq; use moments='fp32' for amsgrad")
        engine = mode != "ram" or getattr(self, "moments", "fp32") != "fp32"   # the state engine's rules
        label = f"state={mode!r}" if mode != "ram" else f"moments={getattr(self, 'moments', 'fp32')!r}"
        fix = "state='ram'" if mode != "ram" else "moments='fp32'"
        params = group["params"]
        names = group.get("param_names")
        for i, p in enumerate(params):
            where = f"parameter {i} of group {gi}" + (f" ({names[i]!r})" if names else "")
            why = fallback.reason(p)
            if why is None or gpu:
                _check_param(p, where, gpu)
            elif engine:
                raise ValueError(f"{where} is {why}: with {label} offload steps dense float32/bfloat16/"
                                 f"float16 parameters only; use {fix} (such parameters are then stepped by "
                                 "torch's own Adam code) or make the parameter a contiguous float32 tensor")
        if engine and len(set(map(id, params))) != len(params):
            i = next(i for i, p in enumerate(params) if any(q is p for q in params[:i]))
            raise ValueError(f"parameter {i} of group {gi} is listed twice: with {label} every parameter "
                             "must appear once (torch.optim.AdamW steps a repeated parameter once per listing, "
                             "state='ram' does the same); remove the duplicate")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)
        self.__dict__.setdefault("_threads", None)
        self.__dict__.setdefault("_pending_multiplier", 1.0)
        self.__dict__.setdefault("_store", None)
        self.__dict__.setdefault("_gpu", None)
        self.__dict__.setdefault("_gpu_device", None)
        self.__dict__.setdefault("_state_mode", "ram")
        self.__dict__.setdefault("moments", "fp32")
        self.__dict__.setdefault("moments_min_size", 4096)
        self._plans = {}
        self._router = fallback.Router()
        if self._decoupled is not None:  # AdamW: torch forces decoupled weight decay for any loaded state
            for group in self.param_groups:
                group["decoupled_weight_decay"] = self._decoupled

    def __getstate__(self):
        if getattr(self, "_store", None) is not None:
            raise TypeError(f"an optimizer with {'NVMe/mmap state' if self._state_mode != 'ram' else 'compressed moments'}"
                            " cannot be pickled or deep-copied; use state_dict() / load_state_dict()")
        d = super().__getstate__()
        d = dict(d)
        d.pop("_plans", None)
        d.pop("_router", None)
        d.pop("_gpu", None)
        d.pop("_gpu_device", None)
        return d

    def _plan(self, gi: int, group: dict) -> GroupPlan:
        plan = self._plans.get(gi)
        params = group["params"]
        if plan is not None and plan.matches(params):
            return plan
        plan = GroupPlan(params)
        for i, p in enumerate(params):
            st = self.state.get(p)
            if st:
                self._adopt_state(plan, i, p, st, group)
        self._plans[gi] = plan
        self._plans.pop("overlap", None)
        return plan

    # ------------------------------------------------------------------ state
    def _track_state(self) -> None:
        """Make ``self.state`` a mutation-counting map and re-check every row if anything in it changed.

        ``opt.state = defaultdict(dict)``, ``opt.state.clear()``, ``del opt.state[p]`` and
        ``opt.state[p] = {}`` give fresh state (step 0) as in torch; a replaced state tensor is
        adopted (validated, converted to fp32 if needed) and the kernel writes into it from then on.
        """
        d = self.__dict__
        epoch = d.get("_state_epoch")
        if epoch is None:
            epoch = d["_state_epoch"] = [0]
        state = self.state
        if type(state) is not StateMap or state._epoch is not epoch:
            wrapped = StateMap(epoch=epoch)
            for k, v in state.items():
                wrapped[k] = v
            self.state = state = wrapped
            epoch[0] += 1  # a replaced (even empty) opt.state: every row is re-checked below
        if d.get("_state_seen") == epoch[0]:
            return
        for gi, plan in list(self._plans.items()):
            if not isinstance(gi, int):
                continue
            group = self.param_groups[gi] if gi < len(self.param_groups) else None
            if group is None or not plan.matches(group["params"]):
                continue  # rebuilt (and every state adopted) by _plan
            for i, p in enumerate(plan.params):
                st, rec = state.get(p), plan.rec[i]
                if not st:
                    if rec is not None:  # deleted or emptied: fresh state at step 0 on its next gradient
                        plan.rec[i] = None
                        plan.p_ptr[i] = -1
                        plan.g_ref[i] = no_grad_ref
                elif rec is None or st is not rec[0] or any(st.get(k) is not t for k, t in zip(REC_KEYS, rec[1:])):
                    self._adopt_state(plan, i, p, st, group)
        d["_state_seen"] = epoch[0]

    def _init_states(self, plan: GroupPlan, rows: list, group: dict) -> None:
        """Create the state of several parameters at once, carved out of one zeroed fp32 arena.

        Each state kind is one contiguous stream (all exp_avg, then all exp_avg_sq, ...) with every
        tensor starting on a 64-byte boundary, so many small parameters still stream like one large
        one (no page-sized hops, fewer TLB misses). ``state[p][key]`` are ordinary views of it. The
        arena is numpy-backed: its storage cannot be resized (freed) under the kernel.
        """
        dparams = [plan.params[i] for i in rows]
        for i, p in zip(rows, dparams):
            _check_param(p, f"parameter {i}")
        params = [local(p) for p in dparams]  # DTensor (FSDP2): state of the local shard
        kinds = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        padded = [round_up(p.numel(), 16) for p in params]  # 64-byte aligned fp32
        lowp = [p.dtype in _LOW_PRECISION for p in params]
        per_kind = sum(padded)
        # Each stream starts `gap` floats after the previous one ends: streams exactly per_kind
        # apart are congruent modulo a large power of two whenever the sizes are (128M params:
        # 512 MiB), and then contend for the same cache sets / DRAM banks (measured on an AVX2
        # EPYC: a 128M step 250 ms instead of 134 ms; issue 11). Small arenas fit the caches:
        # one cache line of gap is enough there.
        gap = arena_gap(per_kind)
        total = (per_kind * len(kinds) + sum(n for n, lp in zip(padded, lowp) if lp)
                 + gap * len(kinds))
        arena = torch.from_numpy(np.zeros(total, dtype=np.float32))  # numpy-owned: cannot be resized under the kernel
        off = 0
        views: list = [ParamState() for _ in params]
        for key in kinds:
            for j, (p, n) in enumerate(zip(params, padded)):
                views[j][key] = arena[off:off + p.numel()].view(p.shape)
                off += n
            off += gap
        for j, (p, n) in enumerate(zip(params, padded)):
            if lowp[j]:
                master = arena[off:off + p.numel()].view(p.shape)
                master.copy_(p.detach())
                views[j]["master_param"] = master
                off += n
        for i, p, lp, st, low in zip(rows, dparams, params, views, lowp):
            if is_dtensor(p):
                st.update({k: like(p, v) for k, v in st.items()})
            st["step"] = torch.tensor(0.0)
            self.state[p] = st
            self._adopt_state(plan, i, p, st, group)
            if low:
                plan.p_ver[i] = lp._version  # the master was just read from the parameter

    def _adopt_state(self, plan: GroupPlan, i: int, p: torch.Tensor, st: dict, group: dict) -> None:
        """Make state[p] native-ready (fp32, contiguous, CPU, p's shape) and record its pointers and objects."""
        where = f"state of parameter {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                raise KeyError(f"{where} has no '{key}'")
        lp = local(p)
        if group["amsgrad"] and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = like(p, torch.zeros(lp.shape, dtype=torch.float32))
        if p.dtype in _LOW_PRECISION and "master_param" not in st:
            st["master_param"] = like(p, lp.detach().to(torch.float32, copy=True))
            plan.p_ver[i] = lp._version
        for key in _STATE_KEYS:
            if key in st:
                t = st[key]
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{where}: '{key}' is not a tensor")
                lt = local(t)
                if lt.numel() != lp.numel():
                    raise ValueError(f"{where}: '{key}' has shape {tuple(lt.shape)} but the parameter has "
                                     f"shape {tuple(lp.shape)}")
                if lt.dtype != torch.float32 or lt.device.type != "cpu" or not lt.is_contiguous():
                    lt = lt.detach().to(device="cpu", dtype=torch.float32).contiguous()
                    st[key] = like(p, lt.view(lp.shape))
                elif lt.shape != lp.shape:  # same elements, the parameter was reshaped
                    st[key] = like(p, lt.view(lp.shape))
                elif is_dtensor(p) and not is_dtensor(t):
                    st[key] = like(p, lt)
                check_storage(lt, f"{where}: '{key}'")
        step = st.get("step", 0.0)
        if isinstance(step, torch.Tensor) and step.numel() != 1:
            raise ValueError(f"{where}: 'step' must be a number or a 1-element tensor, got shape {tuple(step.shape)}")
        plan.steps[i] = _scalar(step)
        st["step"] = plan.steps[i]  # 0-dim view: one vectorised add advances every step
        row = plan.table[i]
        row[COL_M] = _kernels._ptr(local(st["exp_avg"]))
        row[COL_V] = _kernels._ptr(local(st["exp_avg_sq"]))
        row[COL_VMAX] = _kernels._ptr(local(st.get("max_exp_avg_sq")))
        row[COL_N] = lp.numel()
        plan.rec[i] = (st,) + tuple(st.get(k) for k in REC_KEYS)  # keeps what the kernel writes alive
        plan.p_ptr[i] = -1  # forces the param columns to be refreshed
        plan.p_meta[i] = None
        plan.g_ref[i] = no_grad_ref
        self._plans.pop("overlap", None)

    def _refresh_param(self, plan: GroupPlan, i: int, p: torch.Tensor, st: dict) -> None:
        """Re-validate parameter i if anything a user can change on it differs from the last step."""
        lp = local(p)
        meta = fingerprint(lp)
        if meta == plan.p_meta[i]:
            if plan.lowp[i] and lp._version != plan.p_ver[i]:
                sync_master(st["master_param"], lp)  # written in place since the last step
                plan.p_ver[i] = lp._version
            if plan.p_ptr[i] == -1:  # record dropped (_track_state), row columns still valid
                record_param(plan, i, lp, DTYPE_CODES[lp.dtype])
            return
        _check_param(p, f"parameter {i}")
        check_storage(lp, f"parameter {i}")
        if lp.numel() != plan.table[i, COL_N]:
            raise RuntimeError(f"parameter {i} changed size ({plan.table[i, COL_N]} -> {lp.numel()} elements) "
                               "since its optimizer state was created")
        if plan.rec[i] is not None and plan.rec[i][1] is not None and local(plan.rec[i][1]).shape != lp.shape:
            for key in _STATE_KEYS:  # reshaped (same elements): the state follows the parameter's shape
                if key in st:
                    st[key] = like(p, local(st[key]).view(lp.shape))
            plan.rec[i] = (st,) + tuple(st.get(k) for k in REC_KEYS)
        row = plan.table[i]
        if lp.dtype in _LOW_PRECISION:
            if "master_param" not in st:
                st["master_param"] = like(p, lp.detach().to(torch.float32, copy=True))
                plan.rec[i] = (st,) + tuple(st.get(k) for k in REC_KEYS)
            else:  # a new tensor (p.data = ...) or a write in place: re-read what differs
                sync_master(st["master_param"], lp)
            plan.p_ver[i] = lp._version
            row[COL_P] = _kernels._ptr(local(st["master_param"]))
            row[COL_OUT] = _kernels._ptr(lp)
            row[COL_OD] = OUT_USER_PARAM[lp.dtype]  # writes through p.data are adopted natively
        else:
            row[COL_P] = _kernels._ptr(lp)
            row[COL_OUT] = 0
            row[COL_OD] = 0
        plan.lowp[i] = lp.dtype in _LOW_PRECISION
        record_param(plan, i, lp, DTYPE_CODES[lp.dtype])  # what collect_rows compares from now on
        plan.p_meta[i] = meta
        self._plans.pop("overlap", None)

    # ------------------------------------------------------------------ step
    def _group_hyper(self, group: dict) -> dict:
        lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        _check_hyper(lr, (beta1, beta2), eps, wd)
        decoupled = self._decoupled if self._decoupled is not None else bool(group["decoupled_weight_decay"])
        return dict(lr=lr, beta1=_scalar(beta1), beta2=_scalar(beta2), eps=float(eps), weight_decay=float(wd),
                    decoupled=decoupled, amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]))

    def _collect(self, plan: GroupPlan, group: dict) -> tuple:
        """Rows of parameters with a gradient, in order, and the rows whose gradient is new (to be
        checked against the buffers the kernel writes); validates whatever changed since the last step.

        The native gather (``_C.collect_rows``, csrc/rows.cpp) compares each row with its record
        (param pointer, dtype, exact shape, contiguity, neg bit, bf16/fp16 version; the grad object,
        and the same of the grad) and validates a new plain CPU gradient of an unchanged param
        itself; every other row with a gradient is (re)validated here.
        """
        ready, newgrad, changed, other = _C.collect_rows(plan.params, plan.g_ref, plan.meta, plan.layouts,
                                                         plan.table, _ROW_FNS)
        if len(other):  # DTensor (FSDP2) and other subclasses: their grad as they report it
            changed = np.union1d(changed, np.array([i for i in other.tolist() if plan.params[i].grad is not None],
                                                   dtype=np.int64))
        if not len(changed):
            if not len(newgrad):
                return ready, newgrad
            return np.union1d(ready, newgrad), newgrad
        changed = changed.tolist()
        table, state = plan.table, self.state
        fresh = [i for i in changed if not state.get(plan.params[i])]
        if fresh:
            self._init_states(plan, fresh, group)
        for i in changed:
            p = plan.params[i]
            st = state[p]
            lp, g = local(p), local(p.grad)
            self._refresh_param(plan, i, p, st)
            check_tensor(g, f"gradient of parameter {i}", dtypes=(p.dtype,), shape=lp.shape)
            check_storage(g, f"gradient of parameter {i}")
            plan.g_ref[i] = weakref.ref(g)
            plan.g_ptr[i] = g.data_ptr()
            table[i, COL_G] = _kernels._ptr(g)
            table[i, COL_GD] = DTYPE_CODES[g.dtype]
        checked = np.union1d(newgrad, changed)
        return np.union1d(ready, checked), checked

    def _name(self, gi: int, i: int) -> str:
        names = self.param_groups[gi].get("param_names") if gi < len(self.param_groups) else None
        name = f" ({names[i]!r})" if names and i < len(names) else ""
        return f"parameter {i}{name} of group {gi}"

    def _check_overlap(self, work: list, changed: dict) -> None:
        """Refuse rows about to be stepped that share memory, across all groups: what the kernel writes
        must be disjoint, and no gradient may overlap a write. The write index is rebuilt only when a
        row's parameter or state, or the set of stepped rows, changed; new gradients are checked
        against it (binary search)."""
        index = self._plans.get("overlap")
        key = [(gi, rows) for gi, _, rows, _ in work]
        if index is None or len(index.key) != len(key) or any(
                a[0] != b[0] or not np.array_equal(a[1], b[1]) for a, b in zip(index.key, key)):
            gis = [gi for gi, _, _, _ in work]
            index = OverlapIndex([plan for _, plan, _, _ in work], [rows for _, _, rows, _ in work],
                                 lambda pi, r: self._name(gis[pi], r))
            index.key = key
            self._plans["overlap"] = index
            reads = {pi: rows for pi, (_, _, rows, _) in enumerate(work)}
        else:
            reads = {pi: changed[gi] for pi, (gi, _, _, _) in enumerate(work) if gi in changed}
        if reads:
            index.check_reads([plan for _, plan, _, _ in work], reads)

    def _pending_coefficient(self) -> float:
        """The clip coefficient left by clip_grad_norm_, if the gradients it was computed from are
        still the ones about to be used; 1.0 if they were replaced (zero_grad/backward: stale)."""
        mult, rec = self._pending_multiplier, self._plans.get("clip")
        if rec is None:
            return mult
        params, refs, vers = rec
        grads = [p.grad for p in params]
        same = [g is not None and g is r() for g, r in zip(grads, refs)]
        if not any(same):  # every gradient is new (or gone): the clipped ones were discarded
            return 1.0
        moved = [i for i, s in enumerate(same) if s and grads[i]._version != vers[i]]
        if moved or not all(same):
            i = moved[0] if moved else same.index(False)
            raise RuntimeError(
                f"the gradient of parameter {i} (in optimizer order) was {'modified' if moved else 'replaced'} after "
                "clip_grad_norm_, whose coefficient offload applies inside the next step instead of scaling the "
                "gradients in place (torch would now use clipped + new values): call opt.clip_grad_norm_ after the "
                "last backward of the step, or opt.zero_grad() to discard the pending coefficient")
        return mult

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_multiplier: Optional[float] = None):
        """Perform one optimization step.

        ``grad_multiplier`` (keyword-only) scales every gradient inside the kernel pass (e.g. 1/loss
        scale); it is multiplied with the coefficient left by :meth:`clip_grad_norm_`, if any.
        Everything is validated (hyperparameters of every group, every row) before any step count
        advances: a step that raises changes nothing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._gpu is not None:
            self._gpu.step(grad_multiplier)
            return loss
        mult = self._pending_coefficient() * (1.0 if grad_multiplier is None else float(grad_multiplier))
        if not math.isfinite(mult):
            raise ValueError(f"grad_multiplier must be finite, got {mult}")
        threads = self._threads or 0
        if self._store is not None:  # NVMe/mmap state: the store pipelines all groups (offload/store.py)
            self._store.step(self.param_groups, lambda gi: self._group_hyper(self.param_groups[gi]), self.state,
                             mult, threads)
            self._clear_pending()
            return loss
        native, fb = self._router.split(self.param_groups)  # fb: stepped by torch's code (offload/fallback.py)
        for group, _ in fb:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        self._track_state()
        work, changed = [], {}
        try:
            for gi, group in enumerate(native):
                plan = self._plan(gi, group)
                rows, ch = self._collect(plan, group)
                if len(ch):
                    changed[gi] = ch
                if len(rows):
                    work.append((gi, plan, rows, self._group_hyper(group)))
            self.__dict__["_state_seen"] = self._state_epoch[0]  # our own additions above
            if changed or "overlap" not in self._plans:
                self._check_overlap(work, changed)
        except BaseException:
            # rows validated before the error are cached as validated, but their gradients may not have
            # been checked against the buffers the kernel writes yet: the next step checks every row
            self._plans.pop("overlap", None)
            raise
        self._clear_pending()
        for _, plan, rows, hyper in work:
            if len(rows) == len(plan.params):  # every parameter has a gradient: no row selection
                plan.steps_np += 1
                table = plan.table
                table[:, COL_STEP] = plan.steps_np
            else:
                plan.steps_np[rows] += 1
                table = plan.table[rows]
                table[:, COL_STEP] = plan.steps_np[rows]
            _kernels.step_table(table, hyper, mult, threads)
        if fb:
            fallback.step(self, fb, mult, self._decoupled)
        return loss

    def _clear_pending(self) -> None:
        self._pending_multiplier = 1.0
        self._plans.pop("clip", None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; also discards a clip coefficient computed from the discarded gradients."""
        self._clear_pending()
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Global L2 gradient norm of all parameters, with clipping folded into the next step.

        Like ``torch.nn.utils.clip_grad_norm_`` it returns the total norm, but instead of
        rescaling the gradients in a separate pass it records the coefficient
        ``min(1, max_norm / (norm + 1e-6))`` and the next :meth:`step` applies it inside the Adam
        kernel (one pass over memory instead of three). The gradients themselves are not modified.

        The coefficient belongs to these gradients: ``zero_grad()`` or new gradients (a step that
        GradScaler skipped, a skipped batch) discard it; modifying these gradients in place before
        the step (another backward accumulating into them) makes the step raise, since torch would
        have accumulated onto clipped values. A second call clips what the first call left.
        """
        if self._gpu is not None:
            return self._gpu.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        pending = self._pending_coefficient()
        groups, fbg = self._router.split(self.param_groups)
        params = [p for g in groups for p in g["params"] if p.grad is not None]
        fbp = list({id(p): p for _, ps in fbg for p in ps
                    if p.grad is not None}.values())  # (offload/fallback.py; a repeated parameter counted once)
        grads, fbgrads = [p.grad for p in params], [p.grad for p in fbp]
        sumsq = self._grad_sumsq(grads) + (fallback.grad_sumsq(fbgrads) if fbgrads else 0.0)
        total = math.sqrt(sumsq) * pending  # the norm of what the step would use
        params, grads = params + fbp, grads + fbgrads
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total}), so it cannot be clipped")
        coef = float(max_norm) / (total + 1e-6)
        self._pending_multiplier = pending * coef if coef < 1.0 else pending
        if self._pending_multiplier != 1.0:  # tied to these gradients (weakly: zero_grad frees them)
            self._plans["clip"] = (params, list(map(weakref.ref, grads)), list(map(get_version, grads)))
        else:
            self._plans.pop("clip", None)
        return torch.tensor(total, dtype=torch.float32)

    def _grad_sumsq(self, grads: list) -> float:
        """Sum of squares of all gradients; for DTensor (FSDP2) shards, all-reduced across ranks."""
        if not any(is_dtensor(g) for g in grads):
            return _kernels.grad_sumsq(grads, self._threads or 0) if grads else 0.0
        from ._dist import allreduce_sumsq, layout_key
        parts: dict = {}
        for g in grads:
            parts.setdefault(layout_key(g), []).append(g)
        partial = {k: (_kernels.grad_sumsq([local(g) for g in gs], self._threads or 0), gs[0] if k else None)
                   for k, gs in parts.items()}
        return allreduce_sumsq(partial)

    # ------------------------------------------------------------------ state_dict
    def state_dict(self) -> dict:
        if self._gpu is not None:
            self._gpu.synchronize()
        if self._store is not None:
            tensors = self._store.state_tensors()  # views of the mapped state file, not copies
        sd = super().state_dict()
        # hand out copies of step counters: ours are views into one shared buffer
        sd["state"] = {k: ({kk: (vv.clone() if kk == "step" and isinstance(vv, torch.Tensor) else vv)
                            for kk, vv in (v.plain() if isinstance(v, CompressedState) else v).items()}
                           if isinstance(k, int) and isinstance(v, (dict, CompressedState)) else v)
                       for k, v in sd["state"].items()}  # a non-parameter key (user data) is kept as is
        if self._store is not None:
            index = 0
            for gi, g in enumerate(self.param_groups):
                for i, _ in enumerate(g["params"]):
                    if index in sd["state"] and (gi, i) in tensors:
                        sd["state"][index].update(tensors[(gi, i)])
                    index += 1
        return sd

    @property
    def checkpoint_tensors(self):
        """``offload.save``'s extension point (offload/checkpoint/adapter.py): with compressed moments
        the checkpoint stores them compressed (``exp_avg.8bit``, scales, ...), so it resumes bitwise.
        None otherwise: the checkpoint then goes through ``state_dict()`` as for any optimizer."""
        if getattr(self, "moments", "fp32") == "fp32" or self._store is None:
            return None
        return self._checkpoint_tensors

    def _checkpoint_tensors(self, create_from):
        from .checkpoint.adapter import tensor_ref
        if create_from is not None:  # never asked: this state loads through load_state_dict (loads_itself)
            raise RuntimeError("compressed-moment state loads through load_state_dict")
        tensors = self._store.raw_state_tensors()
        refs, index = [], 0
        for gi, g in enumerate(self.param_groups):
            for i, p in enumerate(g["params"]):
                if (gi, i) in tensors and self.state.get(p):
                    for key in sorted(tensors[(gi, i)]):
                        r = tensor_ref(f"state.{index}.{key}", index, key, tensors[(gi, i)][key])
                        r.keep = self._store
                        refs.append(r)
                index += 1
        return refs

    def close(self) -> None:
        """Release NVMe/mmap state (waits for I/O, deletes the state file unless keep_files) and the
        GPU-offload machinery (hooks, worker thread, a device the optimizer created). No-op otherwise."""
        if getattr(self, "_gpu", None) is not None:
            self._gpu.synchronize()
            self._gpu.close()
        if self._store is not None:
            self._store.close()

    def group_hyper(self, gi: int) -> dict:
        """The validated hyperparameters of param group ``gi`` as the kernels take them (lr, beta1,
        beta2, eps, weight_decay, decoupled, amsgrad, maximize); raises ValueError on a bad value."""
        return self._group_hyper(self.param_groups[gi])

    @property
    def kernel_threads(self) -> int:
        """Native threads each kernel call uses (the ``threads=`` option; 0 = the pool's size)."""
        return self._threads or 0

    @kernel_threads.setter
    def kernel_threads(self, threads: Optional[int]) -> None:
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 1024):
            raise ValueError(f"threads must be None or an int in [0, 1024] (0 = the pool's size), got {threads!r}")
        self._threads = threads or None

    def storage_info(self) -> dict:
        """Telemetry of NVMe/mmap state (bytes moved, I/O wait, kernel time, O_DIRECT or not); {} for RAM state."""
        return self._store.info() if self._store is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by this class or by ``torch.optim.Adam/AdamW``.

        Unlike torch, moments stay fp32 for bf16/fp16 parameters (torch would cast them to the
        parameter dtype); sizes are checked before anything is replaced.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group (group {gi}: {len(sg['params'])} saved, {len(g['params'])} here)")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        new_state: defaultdict = defaultdict(dict)
        router = fallback.Router()
        for k, v in state_dict["state"].items():
            if k not in id_map:
                new_state[k] = v
                continue
            p = id_map[k]
            if self._store is None and router.is_fallback(groups, p):  # torch's layout (offload/fallback.py)
                for key, val in v.items():
                    if isinstance(val, torch.Tensor) and key != "step" and val.shape != p.shape:
                        raise ValueError(f"state '{key}' of saved parameter {k} has shape {tuple(val.shape)}, "
                                         f"but the parameter has shape {tuple(p.shape)}")
                new_state[p] = fallback.cast_state(p, deepcopy(v))
                continue
            st = {}
            for key, val in v.items():
                if key == "step":
                    st[key] = torch.tensor(_scalar(val), dtype=torch.float32)
                elif isinstance(val, torch.Tensor):
                    if mformat.parse_saved_key(key) is not None:   # compressed moments: checked by the engine
                        if self._store is None:
                            raise ValueError(f"state '{key}' of saved parameter {k} holds compressed moments; this "
                                             f"optimizer has moments={self.moments!r}: build it with moments="
                                             f"{key.rsplit('.', 1)[1]!r}, or load a state_dict() (fp32 moments)")
                        st[key] = val
                        continue
                    # a DTensor (FSDP2) parameter's state may come as its local shard (offload.load)
                    want = local(p).shape if is_dtensor(p) and not is_dtensor(val) else p.shape
                    if val.shape != want:
                        raise ValueError(f"state '{key}' of saved parameter {k} has shape {tuple(val.shape)}, "
                                         f"but the parameter has shape {tuple(want)}")
                    dtype = torch.float32 if val.is_floating_point() else val.dtype
                    if self._store is not None:
                        st[key] = val  # streamed into the state file below, one bucket at a time
                    else:
                        st[key] = val.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
                else:
                    st[key] = deepcopy(val)
            new_state[p] = st
        for g, sg in zip(groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
        if self._gpu is not None:
            self._gpu.synchronize()
        if self._store is not None:  # NVMe/mmap state: write tensors to the file, keep only 'step' in RAM
            where = {id(p): (gi, i) for gi, g in enumerate(groups) for i, p in enumerate(g["params"])}
            entries = {where[id(p)]: st for p, st in new_state.items() if isinstance(p, torch.Tensor)}
            self._store.load(entries)
            for p, st in list(new_state.items()):
                if isinstance(p, torch.Tensor):
                    gi, i = where[id(p)]
                    new_state[p] = self._store.torch_state(gi, i)  # step counter + views of the moments
        self.__setstate__({"state": new_state, "param_groups": saved_groups})
        if self._gpu is not None:
            self._gpu.load_state()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    _decoupled: Optional[bool] = None


# Entry points run eagerly even when called from a torch.compile'd function: dynamo must not trace
# the native calls, the cached task tables or the NVMe store (its weakref.finalize breaks guards,
# and side effects on optimizer attributes would be replayed out of order). Wrapped here, once,
# rather than at each definition; torch.optim.Optimizer._patch_step_function wraps on top.
for _name in ("step", "clip_grad_norm_", "zero_grad", "state_dict", "load_state_dict", "add_param_group",
              "close", "storage_info"):
    setattr(_AdamBase, _name, torch.compiler.disable(getattr(_AdamBase, _name), recursive=True))
del _name


class Adam(_AdamBase):
    """Adam (L2 weight decay added to the gradient), same signature and defaults as torch.optim.Adam.

    Extra keyword: ``threads`` (native threads per step; default: CPUs in the affinity mask).
    State on disk: ``state="nvme"|"mmap"``, ``nvme_dir``, ``host_budget``, ``keep_files``,
    ``nvme_options`` (see docs/nvme.md and offload/store.py). Compressed moments:
    ``moments="fp32"|"bf16"|"8bit"``, ``moments_min_size`` (docs/moments.md).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, threads=None, state="ram", nvme_dir=None, host_budget="2GiB",
                 keep_files=False, nvme_options=None, offload_device=None, moments="fp32", moments_min_size=4096,
                 **gpu_options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=decoupled_weight_decay, threads=threads, state=state,
                         nvme_dir=nvme_dir, host_budget=host_budget, keep_files=keep_files,
                         nvme_options=nvme_options, offload_device=offload_device, moments=moments,
                         moments_min_size=moments_min_size, **gpu_options)


class AdamW(_AdamBase):
    """AdamW (decoupled weight decay), same signature and defaults as torch.optim.AdamW.

    Extra keywords as for :class:`Adam` (``threads``; ``state``, ``nvme_dir``, ``host_budget``,
    ``keep_files``, ``nvme_options`` for optimizer state on disk; ``moments``, ``moments_min_size``
    for compressed Adam moments, docs/moments.md).
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, threads=None,
                 state="ram", nvme_dir=None, host_budget="2GiB", keep_files=False, nvme_options=None,
                 offload_device=None, moments="fp32", moments_min_size=4096, **gpu_options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, threads=threads, state=state, nvme_dir=nvme_dir,
                         host_budget=host_budget, keep_files=keep_files, nvme_options=nvme_options,
                         offload_device=offload_device, moments=moments, moments_min_size=moments_min_size,
                         **gpu_options)
