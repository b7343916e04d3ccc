"""optim.py: ``offload.Adam`` and ``offload.AdamW``, drop-in ``torch.optim.Optimizer`` subclasses.

The math runs in the native multi-tensor kernel (one call per param group per step). The class
keeps torch's constructor signature, defaults, validation messages and ``state_dict`` layout
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so a state saved here loads into
``torch.optim.AdamW`` and back. bf16/fp16 parameters get an fp32 master copy (state key
``master_param``, the one addition to torch's layout); the kernel writes the rounded new weight
straight into the parameter in the same pass. Parameters the kernel cannot take but torch steps (float64,
complex, non-contiguous, listed twice) go through torch's Adam code, state in RAM (offload/fallback.py).

The class is assembled from: state_dict.py (state_dict / load_state_dict / checkpoint tensors),
gpu.py (the GPU-offload face), clipping.py (clip_grad_norm_ folded into the step), checks.py
(argument checks); this file holds the constructor, param groups and step dispatch. Every mode
steps through one state engine (step/engine.py): where the state lives (state/), where the
parameters live (params/) and the moment format are its configuration.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _to_scalar

from . import fallback
from .checks import _check_group_options, _check_hyper, _check_init, _check_moments, _check_param, _scalar
from .clipping import ClippingMixin
from .base.failstop import OptimizerFailedError, detached, failed_message
from .gpu import GpuOffloadMixin, make_state_engine, split_params, start_engine  # GPU offload, NVMe/mmap state
from .options import GPU_OPTION_NAMES, OPTIONS_DOC, given_gpu_options, resolve_storage
from .state_dict import StateDictMixin
from .step.feedstep import WriteRaceError
from .step.rebuild import fits, rebuild

__all__ = ["Adam", "AdamW"]


# the constructor's own options (not torch's hyperparameters): per optimizer, never per param group
_OPTIMIZER_WIDE = ("moments", "moments_min_size", "storage", "state", "threads", "nvme_dir", "host_budget",
                   "keep_files", "nvme_options", "offload_device") + GPU_OPTION_NAMES


class _AdamBase(ClippingMixin, StateDictMixin, GpuOffloadMixin, Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False, threads: Optional[int] = None,
                 storage: Optional[str] = None, nvme_dir=None, host_budget="2GiB", keep_files: bool = False,
                 nvme_options: Optional[dict] = None, offload_device=None, moments: str = "fp32",
                 moments_min_size: int = 4096, bucket_mb=None, overlap=None, step_during_backward=None,
                 max_grad_norm=None, check_overflow=None, release_grads=None, trace=None, small_param_numel=None,
                 delay_updates=None, delay_after=None, delay_extrapolate=None, state: Optional[str] = None):
        gpu_options = given_gpu_options(bucket_mb=bucket_mb, overlap=overlap, step_during_backward=step_during_backward,
            max_grad_norm=max_grad_norm, check_overflow=check_overflow, release_grads=release_grads, trace=trace,
            small_param_numel=small_param_numel, delay_updates=delay_updates, delay_after=delay_after,
            delay_extrapolate=delay_extrapolate)
        state = resolve_storage(storage, state, nvme_dir)   # state=: the old name of storage= (deprecated)
        if isinstance(lr, torch.Tensor) and foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True: pass lr as a "
                             "float, or leave foreach unset")
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
        if state == "ram" and (nvme_dir is not None or set(nvme_options or ()) - {"staging_slots"}):
            raise ValueError("nvme_dir/nvme_options only apply to storage='nvme' or storage='mmap' (with storage='ram', "
                             "nvme_options={'staging_slots': n} sizes the staging ring of device parameters)")
        self._store = None
        # what a param group may repeat (ZeroRedundancyOptimizer puts every constructor option in its groups)
        self._wide = dict(moments=moments, moments_min_size=moments_min_size, storage=state, state=state, threads=threads,
                          nvme_dir=nvme_dir, host_budget=host_budget, keep_files=keep_files, nvme_options=nvme_options,
                          offload_device=offload_device, **gpu_options)
        # --- compressed Adam moments (docs/moments.md): run by the state engine, also for RAM
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
        self._failure = None   # set when a step failed part-way (offload/base/failstop.py)
        self._state_mode = state
        # float64/complex/strided/duplicate params: torch's code, state in RAM (fallback.py)
        self._router = fallback.Router(elsewhere=fallback.elsewhere(state, moments, offload_device))
        # --- GPU offload: the mode follows from where the parameters are (offload/gpu.py) ---
        params, self._gpu_device = split_params(params, offload_device, gpu_options)
        if state == "ram" and nvme_options and self._gpu_device is None:
            raise ValueError("nvme_options={'staging_slots': ...} with storage='ram' only applies to device parameters")
        self._gpu = None
        super().__init__(params, defaults)
        # --- the state engine (offload/step/engine.py): one for all groups, every tier and parameter side
        opts = dict(nvme_options or {})
        if self.moments != "fp32":
            opts.update(moments=self.moments, moments_min_size=self.moments_min_size)
        self._engine_args = dict(state=state, nvme_dir=nvme_dir, host_budget=host_budget, keep=keep_files,
                                 nvme_options=opts, gpu_options=gpu_options)
        self._store = self._make_engine()
        self._gpu = start_engine(self, self._gpu_device, gpu_options, self._store)
        # --- end GPU offload ---

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group (named parameters, duplicate warning, its checks and messages),
        then offload's own checks of every parameter; the group is not added if one fails.
        With NVMe/mmap state the new group is laid out after the existing state (the file grows)."""
        self._check_usable()
        store = getattr(self, "_store", None)
        n = len(self.param_groups)
        if getattr(self, "_gpu", None) is not None:
            # the last step may still run on the CPU worker (overlapped schedules), and the layout,
            # the tier and the staging ring grow below: nothing may be in flight; writes into the
            # parameters since then are adopted first
            self._gpu.quiesce()
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[n], n)
        except BaseException:
            del self.param_groups[n:]
            raise
        self._plans.clear()
        if store is not None:  # NVMe/mmap state: the new group is laid out after the existing state
            try:
                store.add_group(self._engine_groups()[n]["params"], self.param_groups[n]["amsgrad"])
            except BaseException:
                del self.param_groups[n:]
                raise
            if self._gpu is not None:
                self._gpu.load_state()

    def _group_options(self) -> dict:
        """The optimizer-wide options a param group may repeat with the same value (checks.py): the
        constructor's arguments (an option it was not given has no value a group could repeat)."""
        return self.__dict__.get("_wide") or dict(moments=getattr(self, "moments", "fp32"),
                                                  moments_min_size=getattr(self, "moments_min_size", 4096))

    def _check_group(self, group: dict, gi: int) -> None:
        _check_group_options(group, f"param group {gi}", _OPTIMIZER_WIDE, self._group_options())
        gpu = self._gpu_device is not None
        if getattr(self, "moments", "fp32") != "fp32" and group.get("amsgrad"):
            raise ValueError(f"param group {gi}: amsgrad=True with moments={self.moments!r}: compressed moments "
                             "have no max_exp_avg_sq; use moments='fp32' for amsgrad")
        params = group["params"]
        names = group.get("param_names")
        for i, p in enumerate(params):   # (host parameters torch's code steps: offload/fallback.py)
            if gpu or fallback.reason(p) is None:
                _check_param(p, f"parameter {i} of group {gi}" + (f" ({names[i]!r})" if names else ""), gpu)
        if gpu and len(set(map(id, params))) != len(params):
            i = next(i for i, p in enumerate(params) if any(q is p for q in params[:i]))
            raise ValueError(f"parameter {i} of group {gi} is listed twice: with parameters on a device (GPU "
                             "offload) every parameter must appear once (torch.optim.AdamW steps a repeated "
                             "parameter once per listing, host parameters do the same); remove the duplicate")

    def _engine_groups(self) -> list:
        """The param groups as the state engine holds them: host parameters without those torch's code
        steps (offload/fallback.py: their state stays in host RAM), device parameters all."""
        return self.param_groups if self._gpu_device is not None else self._router.split(self.param_groups)[0]

    def _make_engine(self, groups: Optional[list] = None):
        """An empty state engine (offload/step/engine.py) for ``groups`` (default: the param groups as they
        are now, without the parameters torch's code steps)."""
        a = self._engine_args
        groups = self._engine_groups() if groups is None else groups
        return make_state_engine(groups, a["state"], nvme_dir=a["nvme_dir"], host_budget=a["host_budget"],
                                 keep=a["keep"], nvme_options=a["nvme_options"], device=self._gpu_device,
                                 gpu_options=a["gpu_options"])

    @property
    def _rebuildable(self) -> bool:
        """Host parameters with fp32 moments in RAM: the engine can be built again from opt.state."""
        return self._state_mode == "ram" and self.moments == "fp32" and self._gpu_device is None

    def _sync_engine(self, native: Optional[list] = None, stepping: bool = False) -> None:
        """Make the engine hold the param groups as they are: built again from opt.state (offload/step/
        rebuild.py) where a group's params list (or, ``stepping``, amsgrad) changed, if the configuration
        allows; else the engine refuses by name at its next use."""
        native = self._engine_groups() if native is None else native
        if self._store is None or (self._rebuildable and not fits(self._store, native, stepping)):
            self.state.update(self._rebuild_engine(native, self.state))

    def _rebuild_engine(self, native: list, state) -> dict:
        """A new engine for ``native`` holding ``state`` (step/rebuild.py; raises before any change): views."""
        engine, views = rebuild(lambda: self._make_engine(native), native, state, self._param_name)
        old, self._store = self._store, engine
        if old is not None:
            old.close()
        return views

    def _param_name(self, gi: int, i: int) -> str:
        names = self.param_groups[gi].get("param_names") if gi < len(self.param_groups) else None
        return f"parameter {i}" + (f" ({names[i]!r})" if names and i < len(names) else "") + f" of group {gi}"

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
        self._failure = None   # a loaded state (load_state_dict, offload.load) is the way back after a failure
        self._plans = {}
        if "_router" not in self.__dict__:   # (load_state_dict keeps the split and what it logged)
            self._router = fallback.Router()
        if self._decoupled is not None:  # AdamW: torch forces decoupled weight decay for any loaded state
            for group in self.param_groups:
                group["decoupled_weight_decay"] = self._decoupled
        if self._store is None and self._rebuildable:   # unpickled or deep-copied: the engine from opt.state
            self.__dict__.setdefault("_engine_args", dict(state="ram", nvme_dir=None, host_budget="2GiB", keep=False,
                                                          nvme_options={}, gpu_options={}))
            self._sync_engine()

    def __getstate__(self):
        self._check_usable()
        if getattr(self, "_store", None) is not None and not self._rebuildable:
            what = ("NVMe/mmap state" if self._state_mode != "ram" else
                    "parameters on a device (GPU offload)" if self._gpu_device is not None else "compressed moments")
            raise TypeError(f"an optimizer with {what} cannot be pickled or deep-copied; use state_dict() / "
                            "load_state_dict()")
        d = super().__getstate__()
        d = dict(d)
        d.pop("_plans", None)
        d["_store"] = None   # built again from opt.state by __setstate__ (offload/step/rebuild.py)
        for k in ("_engine_args", "_state_mode", "moments", "moments_min_size", "_threads", "_wide"):
            if k in self.__dict__:
                d[k] = self.__dict__[k]
        d.pop("_router", None)
        d.pop("_gpu", None)
        d.pop("_gpu_device", None)
        d.pop("_failure", None)
        return d

    def _group_hyper(self, group: dict) -> dict:
        if len(group) > len(self.defaults) + 1:   # keys beyond torch's: one set after the group was added?
            _check_group_options(group, "a param group", _OPTIMIZER_WIDE, self._group_options())
        lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        _check_hyper(lr, (beta1, beta2), eps, wd)
        decoupled = self._decoupled if self._decoupled is not None else bool(group["decoupled_weight_decay"])
        return dict(lr=lr, beta1=_scalar(beta1), beta2=_scalar(beta2), eps=float(eps), weight_decay=float(wd),
                    decoupled=decoupled, amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_multiplier: Optional[float] = None):
        """Perform one optimization step.

        ``grad_multiplier`` (keyword-only) scales every gradient inside the kernel pass (e.g. 1/loss
        scale); it is multiplied with the coefficient left by :meth:`clip_grad_norm_`, if any.
        Everything is validated (hyperparameters of every group, every row) before any step count
        advances: a step that raises changes nothing.
        """
        self._check_usable()
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
        native, fb = self._router.split(self.param_groups)  # fb: stepped by torch's code (offload/fallback.py)
        for group, _ in fb:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        fallback.check(self.state, fb, self.param_groups)
        self._sync_engine(native, stepping=True)
        self._store.step(native, lambda gi: self._group_hyper(self.param_groups[gi]), self.state, mult, threads)
        self._clear_pending()
        try:
            if fb:
                fallback.step(self, fb, mult, self._decoupled)
        except BaseException as e:
            self._failure = detached(e)  # the engine's parameters are stepped: refuse to continue from here
            raise
        return loss

    def _check_usable(self) -> None:
        """Raise if an earlier step failed part-way (offload/base/failstop.py) and no state was loaded since."""
        failure = self.__dict__.get("_failure")
        if failure is not None:
            raise OptimizerFailedError(failed_message("the optimizer", failure)) from failure

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; also discards a clip coefficient computed from the discarded gradients."""
        self._clear_pending()
        if self._gpu is not None and not set_to_none:
            self._gpu.synchronize()   # zeroing in place: not while the last step's D2H may still read them
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Release NVMe/mmap state (waits for I/O, deletes the state file unless keep_files) and the
        GPU-offload machinery (hooks, worker thread, a device the optimizer created). No-op otherwise."""
        gpu = getattr(self, "_gpu", None)
        try:
            if gpu is not None and not gpu.closed:
                try:
                    gpu.synchronize()   # the last step lands first
                except WriteRaceError as e:   # reported, not raised: close() is cleanup
                    warnings.warn(str(e), RuntimeWarning, stacklevel=2)
                finally:
                    gpu.close()
        finally:
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

    _decoupled: Optional[bool] = None


# Entry points run eagerly even when called from a torch.compile'd function: dynamo must not trace
# the native calls, the cached task tables or the NVMe store (its weakref.finalize breaks guards,
# and side effects on optimizer attributes would be replayed out of order). Wrapped here, once,
# rather than at each definition; torch.optim.Optimizer._patch_step_function wraps on top.
for _name in ("step", "clip_grad_norm_", "zero_grad", "state_dict", "load_state_dict", "add_param_group",
              "close", "storage_info"):
    setattr(_AdamBase, _name, torch.compiler.disable(getattr(_AdamBase, _name), recursive=True))
del _name


def _forward(args: dict) -> dict:
    """A subclass constructor's arguments, as keywords for _AdamBase.__init__."""
    return {k: v for k, v in args.items() if k not in ("self", "__class__")}


class Adam(_AdamBase):
    __doc__ = "Adam (L2 weight decay added to the gradient), same signature and defaults as torch.optim.Adam.\n" \
        + OPTIONS_DOC

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, threads=None, storage=None, nvme_dir=None, host_budget="2GiB",
                 keep_files=False, nvme_options=None, offload_device=None, moments="fp32", moments_min_size=4096,
                 bucket_mb=None, overlap=None, step_during_backward=None, max_grad_norm=None, check_overflow=None,
                 release_grads=None, trace=None, small_param_numel=None, delay_updates=None, delay_after=None,
                 delay_extrapolate=None, state=None):
        super().__init__(**_forward(locals()))


class AdamW(_AdamBase):
    __doc__ = "AdamW (decoupled weight decay), same signature and defaults as torch.optim.AdamW.\n" + OPTIONS_DOC

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, threads=None,
                 storage=None, nvme_dir=None, host_budget="2GiB", keep_files=False, nvme_options=None,
                 offload_device=None, moments="fp32", moments_min_size=4096, bucket_mb=None, overlap=None,
                 step_during_backward=None, max_grad_norm=None, check_overflow=None, release_grads=None,
                 trace=None, small_param_numel=None, delay_updates=None, delay_after=None, delay_extrapolate=None,
                 state=None):
        super().__init__(decoupled_weight_decay=True, **_forward(locals()))
