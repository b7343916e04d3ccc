"""optim/adam.py: ``offload.Adam`` and ``offload.AdamW``, drop-in ``torch.optim.Optimizer`` subclasses.

The math runs in the native multi-tensor kernel (one call per param group per step). The class
keeps torch's constructor signature, defaults, validation messages and ``state_dict`` layout
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so a state saved here loads into
``torch.optim.AdamW`` and back. bf16/fp16 parameters get an fp32 master copy (state key
``master_param``, the one addition to torch's layout); the kernel writes the rounded new weight
straight into the parameter in the same pass. Parameters the kernel cannot take but torch steps
(float64, complex, non-contiguous, listed twice) go through torch's Adam code, state in RAM
(offload/optim/fallback.py).

The class derives from ``torch.optim.Optimizer`` (and optim/rebuilding.py's ``EngineSync``, which
keeps ``_engine`` laid out for the param groups as they are) and holds parts, which its methods call
in a few lines each: ``_engine``, the state engine of every mode (engine/engine.py), built by
``_slot`` (optim/engine_slot.py); ``_face``, where the parameters are (optim/faces.py: host memory,
or a device and its schedule); ``_clip``, the pending clip coefficient (optim/clipping.py);
``_router``, which parameters torch's code steps (optim/fallback.py); and optim/torch_state.py's
functions. This file holds the constructor, param groups, pickling and step dispatch.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _to_scalar

from . import faces, fallback, gpu, stephooks, torch_state as sdict
from .checks import HyperCache, check_group, check_options, check_threads
from .clipping import CLIP_GRAD_NORM_DOC, Clip
from ..checkpoint.adapter import CheckpointPort
from ..base.failstop import OptimizerFailedError, detached, failed_message
from .engine_slot import EngineSlot
from ..engine.port import port_of
from .rebuilding import EngineSync
from ..moments.format import moment_format
from ..state.choice import resolve_storage
from .options import OPTIMIZER_WIDE, OPTIONS_DOC, constructor_args, given_gpu_options

__all__ = ["Adam", "AdamW"]


# what __setstate__ fills in: of a param group (torch's keys, as torch.optim.Adam), of the optimizer
_GROUP_KEYS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                   differentiable=False, fused=None, decoupled_weight_decay=False)
_OWN_KEYS = dict(_threads=None, _engine=None, _face=None, moments="fp32", moments_min_size=4096)


class _AdamBase(EngineSync, Optimizer):
    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, *, foreach, maximize, capturable, differentiable,
                 fused, decoupled_weight_decay, threads, storage, nvme_dir, host_budget, keep_files, nvme_options,
                 offload_device, moments, moments_min_size, state, **gpu_options):
        """Adam's and AdamW's arguments (below), all given; ``gpu_options``: options.GPU_OPTION_NAMES."""
        gpu_options = given_gpu_options(**gpu_options)
        state = resolve_storage(storage, state, nvme_dir)  # state=: a deprecated alias of storage=
        params, self.moments = check_options(params, lr, betas, eps, weight_decay, amsgrad, foreach, capturable,
                                             differentiable, fused, threads, state, nvme_dir,
                                             nvme_options, moments, moments_min_size)
        self._engine = self._face = None  # (made below, once torch's constructor added the groups)
        # what a param group may repeat (optim/checks.py; ZeroRedundancyOptimizer puts every constructor option in its groups)
        self._wide = dict(moments=moments, moments_min_size=moments_min_size, storage=state, state=state, threads=threads,
                          nvme_dir=nvme_dir, host_budget=host_budget, keep_files=keep_files,
                          nvme_options=nvme_options, offload_device=offload_device, **gpu_options)
        self.moments_min_size = int(moments_min_size)   # compressed moments (docs/moments.md): any tier
        betas = tuple(map(_to_scalar, betas))  # as torch: 1-element tensors become 0-dim tensors
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=False, differentiable=False,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._threads = threads
        self._clip, self._hyper = Clip(), HyperCache()   # (HyperCache: checked group hyperparameters)
        self._failure = None   # set when a step failed part-way (offload/base/failstop.py)
        # float64/complex/strided/duplicate params: torch's code, state in RAM (optim/fallback.py)
        self._router = fallback.Router(elsewhere=fallback.elsewhere(state, moments))
        # --- GPU offload: the mode follows from where the parameters are (offload/optim/gpu.py) ---
        params, device, owns_device = gpu.split_params(params, offload_device, gpu_options)
        # --- the state engine (offload/engine/engine.py): one for all groups, every tier and parameter side
        self._slot = EngineSlot.configure(state, nvme_dir, host_budget, keep_files, nvme_options,
                                          gpu_options, device, self.moments, self.moments_min_size)
        super().__init__(params, defaults)
        self._engine = self._slot.make(self._slot.groups(self.param_groups, self._router))
        self._face = self._start_face(device, gpu_options, owns_device, log=True)
        if self._face.amp_scaling:   # GradScaler hands us grad_scale / found_inf: no unscaling
            self._step_supports_amp_scaling = True

    def _start_face(self, device, gpu_options: dict, owns_device: bool = False, log: bool = False):
        """Where the parameters are (optim/faces.py start), over the engine ``_engine``."""
        return faces.start(port_of(self), device, gpu_options, self._engine, owns_device,
                           lay_out=self._sync_engine, clip=self._clip, router=self._router,
                           fail=self._fail, decoupled=self._decoupled,
                           keep_on_device=self._slot.keep_on_device,
                           describe=functools.partial(gpu.describe, self) if log else None)

    def _fail(self, exc: BaseException) -> None:
        self._failure = detached(exc)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group (named parameters, duplicate warning, its checks and messages),
        then offload's own checks of every parameter; the group is not added if one fails.
        With NVMe/mmap state the new group is laid out after the existing state (the file grows);
        where other groups' params lists were edited (a parameter moved here) the state engine is
        built again, every entry of opt.state kept (offload/engine/rebuild.py)."""
        self._check_usable()
        engine = getattr(self, "_engine", None)  # (None while torch's constructor adds the groups)
        n = len(self.param_groups)
        if engine is not None:
            # the last step may still run on the CPU worker, and the layout, the tier and the staging
            # ring grow below: nothing may be in flight; writes into the parameters since are adopted
            self._face.quiesce()
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[n], n, OPTIMIZER_WIDE, self._wide,
                        getattr(self, "moments", "fp32"), self._slot.on_device)
            self._clip.forget()
            native = self._slot.groups(self.param_groups, self._router)
            if engine is not None and not self._slot.stale(engine, native[:n], False):
                engine.add_group(native[n]["params"], self.param_groups[n]["amsgrad"])
            elif engine is not None:
                self.state.update(self._rebuild_engine(native, self.state))
        except BaseException:
            del self.param_groups[n:]
            raise
        if engine is not None:
            self._face.load_state()

    # ------------------------------------------------------------------ pickling, deepcopy, a loaded state
    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in _GROUP_KEYS.items():
                group.setdefault(k, v)
            if self._decoupled is not None:  # AdamW: torch forces decoupled weight decay for any loaded state
                group["decoupled_weight_decay"] = self._decoupled
        for k, v in _OWN_KEYS.items():
            self.__dict__.setdefault(k, v)
        # (load_state_dict keeps its own parts: the router's split and what it logged, the clip coefficient)
        for k, v in dict(_clip=Clip(), _router=fallback.Router(),
                         _slot=EngineSlot(moments=self.moments), _hyper=HyperCache(),
                         _wide=dict(moments=self.moments, moments_min_size=self.moments_min_size)).items():
            self.__dict__.setdefault(k, v)
        self._clip.forget()   # (load_state_dict: the coefficient stays, tied to no gradients)
        self._failure = None   # a loaded state (load_state_dict, offload.load) is the way back after a failure
        if self._engine is None and self._slot.picklable:  # unpickled, deep-copied: from opt.state
            self._face = self._start_face(self._slot.device, {})
            self._sync_engine()

    def __getstate__(self):
        self._check_usable()
        self._slot.check_picklable()
        d = dict(super().__getstate__(), _engine=None)   # (torch's: defaults, state, param_groups); the engine is
        d.update({k: v for k, v in self.__dict__.items()   # built again from opt.state by __setstate__
                  if k in ("_slot", "moments", "moments_min_size", "_threads", "_wide")})
        return d

    # ------------------------------------------------------------------ step
    @stephooks.grad_off
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_multiplier: Optional[float] = None):
        """Perform one optimization step.

        ``grad_multiplier`` (keyword-only) scales every gradient inside the kernel pass (e.g.
        1/loss scale); it is multiplied with the coefficient left by :meth:`clip_grad_norm_`, if
        any. Everything is validated (hyperparameters of every group, every row) before any step
        count advances: a step that raises changes nothing."""
        self._check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._face.step(grad_multiplier)
        return loss

    def _check_usable(self) -> None:
        """Raise if an earlier step failed part-way (offload/base/failstop.py) and no state was loaded since."""
        face = self.__dict__.get("_face")   # (None while torch's constructor adds the groups)
        if face is not None:
            face.check_open()   # device parameters: not after close()
        failure = self.__dict__.get("_failure")
        if failure is not None:
            raise OptimizerFailedError(failed_message("the optimizer", failure)) from failure

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; also discards a clip coefficient computed from the discarded gradients."""
        self._clip.clear()
        self._face.zero_grad(set_to_none)   # (device: zeroing in place waits for the last copies)
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Release NVMe/mmap state (waits for I/O, deletes the state file unless keep_files) and
        the GPU-offload machinery (hooks, worker thread, a device the optimizer created); no-op
        otherwise. Then, with device parameters, step(), synchronize(), state_dict() ... refuse
        (docs/gpu.md)."""
        try:
            self._face.close()
        finally:
            self._engine.close()

    def group_hyper(self, gi: int) -> dict:
        """The validated hyperparameters of param group ``gi`` as the kernels take them (lr, beta1,
        beta2, eps, weight_decay, decoupled, amsgrad, maximize); raises ValueError on a bad value."""
        return self._hyper.get(gi, self.param_groups[gi], len(self.defaults) + 1, OPTIMIZER_WIDE,
                               self._wide, self._decoupled)

    @property
    def kernel_threads(self) -> int:
        """Native threads each kernel call uses (the ``threads=`` option; 0 = the pool's size)."""
        return self._threads or 0

    @kernel_threads.setter
    def kernel_threads(self, threads: Optional[int]) -> None:
        check_threads(threads)
        self._threads = threads or None

    def storage_info(self) -> dict:
        """Telemetry of the state: its storage, buckets, steps and kernel time; with NVMe/mmap
        state also bytes moved, I/O wait and whether I/O is O_DIRECT."""
        return self._engine.info()

    _decoupled: Optional[bool] = None

    # ------------------------------------------------------------------ clipping (optim/clipping.py)
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        self._clip.whole_model()
        return self._face.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
    clip_grad_norm_.__doc__ = CLIP_GRAD_NORM_DOC   # (optim/clipping.py: what it does, with the rule it follows)

    def pending_clip_coefficient(self) -> float:
        """The coefficient a clip_grad_norm_ left for the next step, if its gradients are still the
        ones about to be used (1.0 if they were replaced; RuntimeError if modified in place)."""
        return self._clip.coefficient()

    def set_clip_coefficient(self, mult: float, params: list) -> None:
        """Record ``mult`` as the coefficient the next step applies, tied to the current gradients of
        ``params`` (weakly: zero_grad frees them), as clip_grad_norm_ does (also the GPU path's)."""
        self._clip.set(mult, params)

    @property
    def pending_grad_multiplier(self) -> float:
        """The coefficient clip_grad_norm_ left for the next step (1.0 if none)."""
        return float(self._clip.mult)

    def set_pending_grad_multiplier(self, value: float) -> None:
        """Restore a pending coefficient (offload.load of a checkpoint saved between clip and step)."""
        self._clip.mult = float(value)

    # ------------------------------------------------------------------ state_dict (optim/torch_state.py)
    state = property(lambda self: _settled(self.__dict__.get("_face"), self.__dict__["state"]),
                     lambda self, v: self.__dict__.__setitem__("state", v), doc=gpu.STATE_DOC)

    def state_dict(self) -> dict:
        self._settle()   # never hand out a partially updated state as a checkpoint
        tensors = self._engine.state_tensors()  # views of the tier (a mapped state file, an arena), not copies
        return sdict.with_tensors(sdict.plain(super().state_dict()), tensors, self._engine_index())

    def checkpoint_state(self) -> dict:
        """``state_dict()['state']`` without the tensors that ``checkpoint_tensors`` hands out (the
        moments and master weights kept in a tier): step counts and any other entries. offload.save
        uses it so that saving compressed moments never decodes them (a transient fp32 copy of
        every moment, 8 B per parameter in RAM)."""
        self._settle()
        return sdict.plain(super().state_dict())["state"]

    def _engine_index(self) -> dict:   # {(group, i in the engine's list): i in torch's numbering}
        return self._slot.index(self.param_groups, self._router)

    def _settle(self) -> None:
        """Usable, the last step landed, groups and opt.state taken in: what a save reads."""
        self._check_usable()
        self.synchronize()
        self._sync_engine()
        self._engine.adopt(self.state)

    @property
    def checkpoint_tensors(self):
        """``offload.save``'s extension point (offload/checkpoint/adapter.py): with compressed moments
        the checkpoint stores them compressed (``exp_avg.8bit``, scales, ...), so it resumes bitwise.
        None otherwise: the checkpoint then goes through ``state_dict()`` as for any optimizer."""
        compressed = moment_format(getattr(self, "moments", "fp32")).compressed
        return self._checkpoint_tensors if compressed else None

    def _checkpoint_tensors(self, create_from):
        if create_from is not None:  # never asked: this state loads through load_state_dict (loads_itself)
            raise RuntimeError("compressed-moment state loads through load_state_dict")
        self._settle()
        return sdict.checkpoint_tensors(self.param_groups, self.state, self._engine, self._engine_index(), self._router)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by this class or by ``torch.optim.Adam/AdamW``. Unlike torch, moments
        stay fp32 for bf16/fp16 parameters (torch would cast them to the parameter dtype); sizes
        are checked before anything is replaced."""
        state_dict = sdict.pre_hooks(self, state_dict)
        self._sync_engine()   # (a group's params list edited: the engine is laid out for the groups as they are)
        host = not self._slot.on_device
        new_state, groups = sdict.map_saved(self.param_groups, state_dict, host=host)
        self.synchronize()
        sdict.install(new_state, self.param_groups, self._router.split(groups)[0], self._engine,
                      self._engine_index, self._rebuild_engine)
        self.__setstate__({"state": new_state, "param_groups": groups})
        self._face.load_state(loaded=True)
        sdict.post_hooks(self)

    # ------------------------------------------------------------ GPU offload (optim/faces.py)
    def no_sync(self):
        """Backward passes inside this block only accumulate gradients on the device (no transfer);
        the first backward outside it is the accumulation boundary. No-op in CPU mode."""
        return self._face.no_sync()

    def set_accumulation_boundary(self, flag: bool) -> None:
        """False: the following backward passes only accumulate; True: the next one sends gradients."""
        self._face.set_accumulation_boundary(flag)

    def synchronize(self) -> None:
        """Wait until the last step is fully applied and the new weights are on the device (and lay
        the state out again for param groups changed since: they keep their opt.state entries)."""
        self._face.synchronize()

    def reload_params(self) -> None:
        """Re-read the fp32 master weights from the device parameters after changing them in place."""
        self._face.reload_params()

    def last_step_stats(self, wait: bool = False) -> Optional[dict]:
        """Seconds in D2H, CPU kernel, H2D, NVMe I/O (time the step waited on it) and exposed
        (training thread blocked) of the latest finished step, with bytes moved and whether it was
        skipped. Every mode reports it; without a device the copy figures are 0."""
        return self._face.last_step_stats(wait)

    @property
    def steps_during_backward(self) -> bool:
        """True when buckets are stepped during backward (GPU offload, eager mode with RAM state)."""
        return self._face.steps_during_backward

    def io_only_pass(self) -> float:
        """Seconds to read and write back every bucket, no compute (NVMe benchmark helper)."""
        return self._engine.io_pass()

    def export_chrome_trace(self, path: str) -> int:
        """Write the recorded timeline (needs trace=True) as Chrome trace JSON; returns the span count."""
        return self._face.export_chrome_trace(path)

    # ------------------------------------------------------------------ what offload.save/load ask (public)
    @property
    def gpu_offload(self) -> bool:
        """True when the parameters live on a device (GPU offload)."""
        return self._face.on_device

    def checkpoint_port(self) -> CheckpointPort:
        """What offload.save / offload.load use of this optimizer beyond torch's API (its state is
        loaded through load_state_dict; the engine stays mapped while a background save reads it)."""
        return CheckpointPort(
            keepalive=lambda: self._engine, loads_itself=lambda: True, on_device=lambda: self.gpu_offload,
            pending=lambda: self.pending_grad_multiplier, set_pending=self.set_pending_grad_multiplier,
            tensors=self.checkpoint_tensors, scalars=self.checkpoint_state)


def _settled(face, state: dict) -> dict:
    """``state`` (opt.state) once no step writes it (``face``: None in torch's constructor)."""
    if face is not None:
        face.settle()
    return state


# Entry points run eagerly even when called from a torch.compile'd function: dynamo must not trace
# the native calls, the cached task tables or the NVMe store (its weakref.finalize breaks guards;
# side effects on attributes would replay out of order). Wrapped once, here; step() then gets
# torch's step hooks on top (optim/stephooks.py).
for _name in ("step", "clip_grad_norm_", "zero_grad", "state_dict", "load_state_dict",
              "add_param_group", "close", "storage_info"):
    setattr(_AdamBase, _name, torch.compiler.disable(getattr(_AdamBase, _name), recursive=True))
_AdamBase.step = stephooks.hooked_step(_AdamBase.step)
del _name


class Adam(_AdamBase):
    __doc__ = "Adam (L2 weight decay added to the gradient), same signature and defaults as torch.optim.Adam.\n" \
        + OPTIONS_DOC

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, threads=None, storage=None, nvme_dir=None, host_budget="2GiB",
                 keep_files=False, nvme_options=None, offload_device=None, moments="fp32", moments_min_size=4096,
                 bucket_mb=None, overlap=None, step_during_backward=None, max_grad_norm=None, check_overflow=None,
                 release_grads=None, trace=None, small_param_numel=None, delay_updates=None,
                 delay_after=None, delay_extrapolate=None, gpu_state=None, state=None):
        super().__init__(**constructor_args(locals()))


class AdamW(_AdamBase):
    __doc__ = "AdamW (decoupled weight decay), same signature and defaults as torch.optim.AdamW.\n" + OPTIONS_DOC

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, threads=None,
                 storage=None, nvme_dir=None, host_budget="2GiB", keep_files=False, nvme_options=None,
                 offload_device=None, moments="fp32", moments_min_size=4096, bucket_mb=None, overlap=None,
                 step_during_backward=None, max_grad_norm=None, check_overflow=None, release_grads=None,
                 trace=None, small_param_numel=None, delay_updates=None, delay_after=None,
                 delay_extrapolate=None, gpu_state=None, state=None):
        super().__init__(decoupled_weight_decay=True, **constructor_args(locals()))
