"""gpu.py: the GPU-offload face of ``offload.Adam``/``offload.AdamW``.

``GpuOffloadMixin`` adds the methods that only mean something when parameters live on a GPU
(accumulation boundary, synchronize, telemetry); ``start_engine`` decides the mode from where the
parameters are (or an explicit ``offload_device=``) and builds the device face
(offload/step/device_step.py) over the one state engine (offload/step/engine.py), any tier.
Kept apart from optim.py so that the optimizer class only delegates. ``start_engine`` logs the
setup chosen (parameter side, state tier, moment format) as one INFO line on the ``offload`` logger.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch

from .device import Device, resolve_device
from .step.smallparams import small_params
from .step.device_step import DeviceStep
from .step.port import port_of

__all__ = ["GpuOffloadMixin", "describe", "make_state_engine", "split_params", "start_engine"]

log = logging.getLogger("offload")


def _flat(params: list) -> list:
    out = []
    for item in params:
        if isinstance(item, dict):
            ps = item["params"]
            out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            out.append(item)
    # named parameters come as (name, tensor) pairs
    out = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in out]
    return [p for p in out if isinstance(p, torch.Tensor)]


def split_params(params, offload_device, gpu_options: dict):
    """Materialize ``params`` and return (params, Device or None for the CPU mode)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    # a group's "params" may be a generator (model.parameters()): materialize it once, here,
    # or _flat() below would consume it and the optimizer would get an empty group
    params = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
              if isinstance(g, dict) else g for g in params]
    device = resolve_device(offload_device, _flat(params))
    if device is not None and device is not offload_device:
        device._created_by_offload = True   # made here, not passed in: the engine closes it
    if device is None and gpu_options:
        raise TypeError(f"{sorted(gpu_options)} only apply to GPU offload (parameters on a GPU or offload_device=...)")
    return params, device


def make_state_engine(param_groups: list, state: str, *, nvme_dir, host_budget, keep: bool, nvme_options,
                      device: Optional[Device], gpu_options: dict):
    """The state engine (offload/step/engine.py): host parameters with NVMe/mmap state or compressed
    moments, or device parameters with any tier (their small parameters excluded: stepped on the device)."""
    from .step.engine import StateEngine
    opts = dict(nvme_options or {})
    if device is not None:
        mb = gpu_options.get("bucket_mb", 32.0)
        if isinstance(mb, bool) or not (isinstance(mb, (int, float)) and mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {mb!r}")
        opts.setdefault("bucket_bytes", int(float(mb) * 2 ** 20))
        opts["exclude"] = small_params(param_groups, gpu_options.get("small_param_numel", 0))
    amsgrad = [bool(g.get("amsgrad", False)) for g in param_groups]
    return StateEngine([g["params"] for g in param_groups], amsgrad, mode=state,
                       nvme_dir=nvme_dir, host_budget=host_budget, keep=keep, device=device, **opts)


_HOST_STATS = dict(step=0, d2h_s=0.0, kernel_s=0.0, h2d_s=0.0, nvme_s=0.0, exposed_s=0.0, d2h_bytes=0, h2d_bytes=0,
                   buckets=0, skipped=False, grad_multiplier=1.0, overlapped=False, waited_all=False, complete=True)


def describe(opt, device: Optional[Device], store, engine=None) -> str:
    """One line: where the parameters are stepped, where the state lives, the moment format."""
    n = sum(len(g["params"]) for g in opt.param_groups)
    side = ("parameters on the CPU, stepped in place by the native kernel" if device is None else
            f"parameters on device {device.name} (GPU offload: gradients are copied to host memory, the CPU steps them"
            f"{' during backward' if getattr(engine, 'eager', False) else ''}, the new weights are copied back)")
    tier = getattr(store, "tier", None)
    mode = getattr(store, "mode", "ram")
    if mode == "nvme" and tier is not None:
        direct = tier.telemetry.get("direct")
        where = (f"optimizer state in the file {tier.where()} ({'direct' if direct else 'buffered'} I/O, "
                 f"{len(getattr(tier, 'slots', ()))} host buffers of {tier.arena.slot_bytes / 2**20:.1f} MiB)"
                 if getattr(tier, "arena", None) is not None else f"optimizer state in the file {tier.where()}")
    elif mode == "mmap" and tier is not None:
        where = f"optimizer state in the memory-mapped file {tier.where()}"
    else:
        where = "optimizer state in host RAM"
    moments = getattr(opt, "moments", "fp32")
    fmt = ("fp32 Adam moments" if moments == "fp32" else
           f"{moments} Adam moments (fp32 for tensors under {getattr(opt, 'moments_min_size', 4096)} elements)")
    return f"offload.{type(opt).__name__} with {n} parameter{'s' if n != 1 else ''}: {side}; {where}; {fmt}"


def start_engine(opt, device: Optional[Device], gpu_options: dict, store=None):
    if device is None:
        log.info(describe(opt, None, store))
        return None
    opt._step_supports_amp_scaling = True   # GradScaler hands us grad_scale / found_inf instead of unscaling
    engine = DeviceStep(port_of(opt), store, device, **gpu_options)   # buckets stream through a staging ring
    engine.owns_device = getattr(device, "_created_by_offload", False)
    log.info(describe(opt, device, store, engine))
    return engine


class GpuOffloadMixin:
    """Methods of the GPU-offload mode; in CPU mode they are harmless no-ops where that makes sense."""

    _gpu: Optional[DeviceStep] = None

    def _gpu_engine(self, what: str) -> DeviceStep:
        if self._gpu is None:
            raise RuntimeError(f"{what} is only available in GPU-offload mode (parameters on a GPU)")
        return self._gpu

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate gradients on the device (no transfer);
        the first backward outside it is the accumulation boundary. No-op in CPU mode."""
        if self._gpu is None:
            yield
        else:
            with self._gpu.no_sync():
                yield

    def set_accumulation_boundary(self, flag: bool) -> None:
        """False: the following backward passes only accumulate; True: the next one sends gradients."""
        if self._gpu is not None:
            self._gpu.set_accumulation_boundary(flag)

    def synchronize(self) -> None:
        """Wait until the last step is fully applied and the new weights are on the device."""
        if self._gpu is not None:
            self._gpu.synchronize()

    def reload_params(self) -> None:
        """Re-read the fp32 master weights from the device parameters after changing them in place."""
        self._gpu_engine("reload_params").reload_params()

    def last_step_stats(self, wait: bool = False) -> Optional[dict]:
        """Seconds in D2H, CPU kernel, H2D, NVMe I/O (time the step waited on it) and exposed (training
        thread blocked) of the latest finished step, with bytes moved and whether it was skipped.
        Every mode reports it; without a device the copy figures are 0."""
        if self._gpu is not None:
            return self._gpu.last_step_stats(wait)
        store = getattr(self, "_store", None)
        st = store.last_stats if store is not None else None
        if st is None:
            return None
        out = dict(_HOST_STATS)
        out.update(st)
        out["exposed_s"] = out.pop("step_s", out["exposed_s"])
        return out

    @property
    def steps_during_backward(self) -> bool:
        """True when buckets are stepped during backward (GPU offload, eager mode with RAM state)."""
        return bool(getattr(self._gpu, "eager", False))

    def io_only_pass(self) -> float:
        """Benchmark helper (storage='nvme'): read and write back every bucket without computing;
        returns the seconds it took (the I/O-only time of a full step)."""
        store = getattr(self, "_store", None)
        if store is None:
            raise RuntimeError("io_only_pass() needs storage='nvme'")
        return store.io_pass()

    def export_chrome_trace(self, path: str) -> int:
        """Write the recorded timeline (needs trace=True) as Chrome trace JSON; returns the span count."""
        return self._gpu_engine("export_chrome_trace").export_chrome_trace(path)

    # ------------------------------------------------------------------ what offload.save/load ask (public)
    @property
    def gpu_offload(self) -> bool:
        """True when the parameters live on a device (GPU offload)."""
        return self._gpu is not None

    @property
    def loads_state_itself(self) -> bool:
        """True when the state must be loaded through load_state_dict (NVMe/mmap state, GPU offload),
        not by writing into the tensors of ``opt.state``."""
        return getattr(self, "_store", None) is not None or self._gpu is not None

    def checkpoint_keepalive(self):
        """What a background save must hold so that the state views it reads stay mapped (or None)."""
        return getattr(self, "_store", None)

    @property
    def pending_grad_multiplier(self) -> float:
        """The coefficient clip_grad_norm_ left for the next step (1.0 if none)."""
        return float(getattr(self, "_pending_multiplier", 1.0))

    def set_pending_grad_multiplier(self, value: float) -> None:
        """Restore a pending coefficient (offload.load of a checkpoint saved between clip and step)."""
        self._pending_multiplier = float(value)
