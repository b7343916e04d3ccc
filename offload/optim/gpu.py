"""optim/gpu.py: how ``offload.Adam``/``offload.AdamW`` are set up for where their parameters are.

``split_params`` decides the mode from where the parameters are (or an explicit
``offload_device=``), ``make_state_engine`` builds the one state engine (offload/engine/engine.py),
any tier, with the parameter side of that mode (params/__init__.py side_maker; schedule/delayed.py
held_side for ``delay_updates=1``); the optimizer's face over it comes from optim/faces.py.
``describe`` is the INFO line on the ``offload`` logger naming the setup chosen (parameter side,
state tier, moment format); ``STATE_DOC`` is the docstring of the optimizer's ``state``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..base.dist import PARTITION_NORM, zero_partition
from ..device import Device, resolve_device
from ..moments.format import moment_format
from ..params import side_maker
from ..schedule.delayed import held_side
from ..schedule.smallparams import small_params

__all__ = ["STATE_DOC", "describe", "make_state_engine", "split_params"]


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
    """Materialize ``params`` and return (params, Device or None for the CPU mode, whether the
    device was made here rather than passed in: then the device face closes it)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    # a group's "params" may be a generator (model.parameters()): materialize it once, here,
    # or _flat() below would consume it and the optimizer would get an empty group
    params = [dict(g,
                   params=[g["params"]] if isinstance(g["params"], torch.Tensor)
                   else list(g["params"]))
              if isinstance(g, dict) else g for g in params]
    device = resolve_device(offload_device, _flat(params))
    if device is None and gpu_options:
        raise TypeError(f"{sorted(gpu_options)} only apply to GPU offload (parameters on a GPU or "
                        "offload_device=...)")
    for name in ("max_grad_norm", "check_overflow"):
        if gpu_options.get(name) not in (None, False) and zero_partition():
            raise ValueError(PARTITION_NORM.format(what=f"{name}={gpu_options[name]!r}"))
    return params, device, device is not None and device is not offload_device


def make_state_engine(param_groups: list, state: str, *, nvme_dir, host_budget, keep: bool,
                      nvme_options, device: Optional[Device], gpu_options: dict, resident=()):
    """The state engine (offload/engine/engine.py): host parameters with NVMe/mmap state or
    compressed moments, or device parameters with any tier (their small parameters and
    ``resident``, those whose state stays on the device, excluded: stepped there,
    schedule/resident.py)."""
    from ..engine.engine import StateEngine
    opts = dict(nvme_options or {})
    held = held_side(gpu_options.get("delay_updates", 0), gpu_options.get("delay_extrapolate"))
    side = side_maker(device, opts.pop("staging_slots", 3), held)   # (params/__init__.py)
    if device is not None:
        mb = gpu_options.get("bucket_mb", 32.0)
        if isinstance(mb, bool) or not (isinstance(mb, (int, float)) and mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {mb!r}")
        # (0 bytes would read as no limit: one bucket for everything)
        if int(float(mb) * 2 ** 20) < 1:
            raise ValueError(f"bucket_mb={mb!r} is under one byte: bucket_mb counts "
                             "MiB (2**20 bytes)")
        opts.setdefault("bucket_bytes", int(float(mb) * 2 ** 20))
        opts["exclude"] = small_params(param_groups, gpu_options.get("small_param_numel", 0)) | {
            (gi, i) for gi, g in enumerate(param_groups) for i, p in enumerate(g["params"])
            if any(p is q for q in resident)}
    amsgrad = [bool(g.get("amsgrad", False)) for g in param_groups]
    return StateEngine([g["params"] for g in param_groups], amsgrad, mode=state, nvme_dir=nvme_dir,
                       host_budget=host_budget, keep=keep, side=side, **opts)


def describe(opt, side: str, engine) -> str:
    """One line: where the parameters are stepped (``side``, optim/faces.py), where the state
    lives, the moment format."""
    n = sum(len(g["params"]) for g in opt.param_groups)
    tier = getattr(engine, "tier", None)
    mode = getattr(engine, "mode", "ram")
    if mode == "nvme" and tier is not None:
        direct = tier.telemetry.get("direct")
        where = (f"optimizer state in the file {tier.where()} "
                 f"({'direct' if direct else 'buffered'} I/O, {len(getattr(tier, 'slots', ()))} "
                 f"host buffers of {tier.arena.slot_bytes / 2**20:.1f} MiB)"
                 if getattr(tier, "arena", None) is not None
                 else f"optimizer state in the file {tier.where()}")
    elif mode == "mmap" and tier is not None:
        where = f"optimizer state in the memory-mapped file {tier.where()}"
    else:
        where = "optimizer state in host RAM"
    moments = getattr(opt, "moments", "fp32")
    fmt = ("fp32 Adam moments" if not moment_format(moments).compressed else
           f"{moments} Adam moments (fp32 for tensors under "
           f"{getattr(opt, 'moments_min_size', 4096)} elements)")
    return (f"offload.{type(opt).__name__} with {n} parameter{'s' if n != 1 else ''}: "
            f"{side}; {where}; {fmt}")


STATE_DOC = """torch's ``opt.state``. With device parameters the overlapped schedules run the CPU
part of a step after ``step()`` returns (with ``delay_updates=1``, during the whole next forward
and backward): reading ``opt.state`` waits for it, and with NVMe state gives up the next step's
state read ahead, so that what it shows, and what is written into it in place, is the state after
the last ``step()``, as with torch's (docs/gpu.md). A tensor taken from it before a ``step()`` is
written by that step's CPU part while it runs: take it from ``opt.state`` again after the
``step()``."""
