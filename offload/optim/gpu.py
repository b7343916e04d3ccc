"""optim/gpu.py: the GPU-offload setup of ``offload.Adam``/``offload.AdamW`` and what its GPU-offload methods run.

``split_params`` decides the mode from where the parameters are (or an explicit ``offload_device=``),
``make_state_engine`` builds the one state engine (offload/engine/engine.py), any tier, and
``start_engine`` the device face (offload/schedule/device_step.py) over it (``restart``: over an
engine built again). ``need``, ``no_sync``,
``last_step_stats``, ``io_only_pass``, ``settled``, ``check_open`` and ``close`` are the bodies of
optimizer methods around the device face (accumulation boundary, telemetry, ``opt.state``, cleanup
and the refusals after it); they take the device face and the engine as arguments, so the
optimizer class (optim/adam.py) only delegates. ``start_engine`` logs the setup chosen (parameter
side, state tier, moment format) as one INFO line on the ``offload`` logger.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Optional

import torch

from ..base.dist import PARTITION_NORM, zero_partition
from ..device import Device, resolve_device
from ..schedule.smallparams import small_params
from ..schedule.device_step import DeviceStep
from ..engine.port import port_of
from ..moments.format import moment_format
from ..schedule.feedstep import WriteRaceError

__all__ = ["STATE_DOC", "check_open", "close", "describe", "io_only_pass", "last_step_stats",
           "make_state_engine", "need", "no_sync", "quiesce_for_rebuild", "restart", "settled",
           "split_params", "start_engine"]

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
    """Materialize ``params`` and return (params, Device or None for the CPU mode, whether the device was
    made here rather than passed in: then the device face closes it)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    # a group's "params" may be a generator (model.parameters()): materialize it once, here,
    # or _flat() below would consume it and the optimizer would get an empty group
    params = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
              if isinstance(g, dict) else g for g in params]
    device = resolve_device(offload_device, _flat(params))
    if device is None and gpu_options:
        raise TypeError(f"{sorted(gpu_options)} only apply to GPU offload (parameters on a GPU or offload_device=...)")
    for name in ("max_grad_norm", "check_overflow"):
        if gpu_options.get(name) not in (None, False) and zero_partition():
            raise ValueError(PARTITION_NORM.format(what=f"{name}={gpu_options[name]!r}"))
    return params, device, device is not None and device is not offload_device


def make_state_engine(param_groups: list, state: str, *, nvme_dir, host_budget, keep: bool, nvme_options,
                      device: Optional[Device], gpu_options: dict):
    """The state engine (offload/engine/engine.py): host parameters with NVMe/mmap state or compressed
    moments, or device parameters with any tier (their small parameters excluded: stepped on the device)."""
    from ..engine.engine import StateEngine
    opts = dict(nvme_options or {})
    if device is not None:
        mb = gpu_options.get("bucket_mb", 32.0)
        if isinstance(mb, bool) or not (isinstance(mb, (int, float)) and mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {mb!r}")
        if int(float(mb) * 2 ** 20) < 1:   # (0 bytes would read as no limit: one bucket for everything)
            raise ValueError(f"bucket_mb={mb!r} is under one byte: bucket_mb counts MiB (2**20 bytes)")
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
    fmt = ("fp32 Adam moments" if not moment_format(moments).compressed else
           f"{moments} Adam moments (fp32 for tensors under {getattr(opt, 'moments_min_size', 4096)} elements)")
    return f"offload.{type(opt).__name__} with {n} parameter{'s' if n != 1 else ''}: {side}; {where}; {fmt}"


def start_engine(opt, device: Optional[Device], gpu_options: dict, store=None, owns_device: bool = False):
    """The device face (None without a device) over ``store``; ``owns_device``: it closes the device."""
    if device is None:
        log.info(describe(opt, None, store))
        return None
    engine = DeviceStep(port_of(opt), store, device, **gpu_options)   # buckets stream through a staging ring
    engine.owns_device = owns_device
    log.info(describe(opt, device, store, engine))
    return engine


def quiesce_for_rebuild(face: Optional[DeviceStep]) -> None:
    """Before the state engine is built again for edited param groups: the device face idle (its
    quiesce); refused between a backward and its step(), whose gradients went to the CPU for the
    groups as they were."""
    if face is None:
        return
    if face.feed is not None and face.feed.in_cycle:
        raise RuntimeError(
            "a param group's 'params' list or amsgrad was changed after backward() and before "
            "step(): with parameters on a device their gradients go to the CPU during backward, "
            "for the groups as they were. Change param groups between step() and the next "
            "forward (undo the change to take this step)")
    face.quiesce()


def restart(face: Optional[DeviceStep], opt, engine, gpu_options: dict) -> Optional[DeviceStep]:
    """The device face over ``engine``, a state engine built again for edited param groups, in
    place of ``face`` (None without a device): its hooks, CPU worker and staging ring go; the
    device stays."""
    if face is None:
        return None
    owns, face.owns_device = face.owns_device, False
    face.close()
    return start_engine(opt, face.device, gpu_options, engine, owns)


def need(gpu: Optional[DeviceStep], what: str) -> DeviceStep:
    """The device face ``gpu``; RuntimeError naming ``what`` without one (CPU mode)."""
    if gpu is None:
        raise RuntimeError(f"{what} is only available in GPU-offload mode (parameters on a GPU)")
    return gpu


@contextlib.contextmanager
def no_sync(gpu: Optional[DeviceStep]):
    """The optimizer's no_sync: the device face's, or nothing in CPU mode."""
    if gpu is None:
        yield
    else:
        with gpu.no_sync():
            yield


def last_step_stats(gpu: Optional[DeviceStep], store, wait: bool) -> Optional[dict]:
    """The optimizer's last_step_stats: the device face's, else the engine's figures in the same keys."""
    if gpu is not None:
        return gpu.last_step_stats(wait)
    st = store.last_stats if store is not None else None
    if st is None:
        return None
    out = dict(_HOST_STATS)
    out.update(st)
    out["exposed_s"] = out.pop("step_s", out["exposed_s"])
    return out


def io_only_pass(store) -> float:
    """The optimizer's io_only_pass: the engine's I/O-only pass over every bucket."""
    if store is None:
        raise RuntimeError("io_only_pass() needs storage='nvme'")
    return store.io_pass()


STATE_DOC = """torch's ``opt.state``. With device parameters the overlapped schedules run the CPU
part of a step after ``step()`` returns (with ``delay_updates=1``, during the whole next forward and
backward): reading ``opt.state`` waits for it, and with NVMe state gives up the next step's state
read ahead, so that what it shows, and what is written into it in place, is the state after the
last ``step()``, as with torch's (docs/gpu.md). A tensor taken from it before a ``step()`` is
written by that step's CPU part while it runs: take it from ``opt.state`` again after the
``step()``."""


def settled(gpu: Optional[DeviceStep], value):
    """``value`` (``opt.state``), once the device face's CPU step still running is done and (NVMe)
    no state is read ahead (schedule/backward.py ``settle``); at once without a device."""
    feed = getattr(gpu, "feed", None)
    if feed is not None and not gpu.closed:
        feed.settle()
    return value


def check_open(gpu: Optional[DeviceStep]) -> None:
    """RuntimeError if the device face was closed (optimizers without one: their tier decides)."""
    if gpu is not None:
        gpu.check_open()


def close(gpu: Optional[DeviceStep], store) -> None:
    """The optimizer's close: the last step lands, the device face closes, then the state engine."""
    try:
        if gpu is not None and not gpu.closed:
            try:
                gpu.synchronize()   # the last step lands first
            except WriteRaceError as e:   # reported, not raised: close() is cleanup
                warnings.warn(str(e), RuntimeWarning, stacklevel=3)
            finally:
                gpu.close()
    finally:
        if store is not None:
            store.close()
