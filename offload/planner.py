"""planner.py: ``offload.plan()``, the memory planner: bytes per place before training starts.

It counts, for a model (or a parameter count) and a configuration, what each place will hold:
GPU weights and gradients, host weights/gradients (CPU mode), host optimizer state, pinned staging
buffers, NVMe state files and the host buffers that stream them; then compares each total with
what the machine has (host RAM from /proc/meminfo, GPU memory from CUDA, free disk space).

Every state figure comes from the engine's own layout code (offload/state/layout.py) and budget
split (offload/state/tier.py), so it is what ``offload.Adam/AdamW`` allocate in every mode: the RAM
arena (fp32 exp_avg, exp_avg_sq [, max_exp_avg_sq] and a master for bf16/fp16, each padded to 64
bytes, + one fp32 step counter per tensor), GPU mode's pinned bucket arenas and staging, the
NVMe/mmap state file, the NVMe slots and the pinned staging ring of device parameters with NVMe
state. Frozen ``nn.Parameter`` s (``requires_grad=False``) get no state. Tests check the figures
against real optimizers.

``moments="bf16"|"8bit"`` (docs/moments.md): tensors of at least ``moments_min_size``
elements keep compressed moments (the layout's compressed sections: bf16 m, v, or int8 m + uint8 v
+ one fp32 scale per 256-element block each); the state then lives in the engine's RAM tier
(4 KiB-aligned buckets, never pinned) or shrinks the NVMe/mmap file.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Union

import torch

from .base.dtypes import LOW_PRECISION as _LOW
from .moments.format import moment_format
from .state.layout import ALIGN, Shape, build_layout, split_buckets
from .state.tier import check_budget, check_depth, check_staging_slots, split_budget
from .base.units import human

__all__ = ["plan", "MemoryPlan"]

STEP_BYTES = 4  # one fp32 step counter per parameter tensor


def host_memory() -> dict:
    """MemTotal / MemAvailable in bytes from /proc/meminfo ({} where unavailable)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


@dataclass
class Row:
    place: str   # 'gpu' | 'host' | 'nvme'
    what: str
    bytes: int


@dataclass
class MemoryPlan:
    """The result of :func:`plan`: ``rows`` (place, what, bytes), totals, capacities, verdicts."""
    config: dict
    rows: List[Row]
    capacity: dict = field(default_factory=dict)   # place -> bytes available (None: unknown)
    warnings: List[str] = field(default_factory=list)
    # nvme: {dir, bytes, free} per directory of nvme_path
    drives: List[dict] = field(default_factory=list)
    # the predicted step (plan(..., bandwidths=...)), offload/steptime.py
    step_time: Optional["StepTime"] = None
    suggestion: Optional[str] = None         # the first setup that fits, when this one does not

    def total(self, place: str) -> int:
        return sum(r.bytes for r in self.rows if r.place == place)

    def bytes_of(self, place: str, what_prefix: str) -> int:
        return sum(r.bytes for r in self.rows if r.place == place
                   and r.what.startswith(what_prefix))

    @property
    def host_state_bytes(self) -> int:
        """Optimizer state held in host RAM (what the optimizer's state tensors add up to)."""
        return self.bytes_of("host", "optimizer state")

    def fits(self) -> dict:
        """place -> True/False/None (None: capacity unknown)."""
        out = {}
        for place in ("gpu", "host", "nvme"):
            need = self.total(place)
            if need == 0 and place not in self.capacity:
                continue
            cap = self.capacity.get(place)
            out[place] = None if cap is None else need <= cap
        return out

    def to_dict(self) -> dict:
        return {"config": self.config, "rows": [r.__dict__ for r in self.rows],
                "totals": {p: self.total(p) for p in ("gpu", "host", "nvme")},
                "capacity": self.capacity, "fits": self.fits(), "warnings": self.warnings,
                "drives": self.drives,
                "step_time": self.step_time.to_dict() if self.step_time else None,
                "suggestion": self.suggestion}

    def __str__(self) -> str:
        c = self.config
        sharded = f", {c['sharding']} x{c['world_size']}" if c["world_size"] > 1 else ""
        lines = [f"offload memory plan: {c['params']:,} parameters in {c['tensors']} tensors, "
                 f"param dtype {c['param_dtype']}, grads {c['grad_dtype']}, device {c['device']}, "
                 "state in "
                 f"{c['state']}{', amsgrad' if c['amsgrad'] else ''}{sharded} "
                 "(per rank)",
                 f"{'place':<6} {'what':<58} {'bytes':>12}"]
        for r in self.rows:
            lines.append(f"{r.place:<6} {r.what:<58} {human(r.bytes, 2):>12}")
        for d in self.drives:
            lines.append(f"{'drive':<6} {d['dir']:<58} {human(d['bytes'], 2):>12}  of "
                         f"{human(d['free'], 2)} available")
        fits = self.fits()
        for place, ok in fits.items():
            cap = self.capacity.get(place)
            verdict = "unknown capacity" if ok is None else ("fits" if ok else "DOES NOT FIT")
            lines.append(f"total {place:<5} {human(self.total(place), 2):>12}  of "
                         f"{human(cap, 2):>12} available: {verdict}")
        lines += [f"note: {w}" for w in self.warnings]
        if self.suggestion:
            lines.append(f"suggestion: {self.suggestion}")
        if self.step_time is not None:
            lines.append(str(self.step_time))
        return "\n".join(lines)


def plan(model_or_params: Union[torch.nn.Module, Iterable, int], *, device: Optional[str] = None,
         param_dtype=None, grad_dtype=None, storage: Optional[str] = None, amsgrad: bool = False,
         world_size: int = 1, sharding: str = "none", bucket_bytes: int = 32 << 20, depth: int = 2,
         host_budget="2GiB", staging_slots: int = 3,
         nvme_dir=None, activation_bytes: Optional[int] = None,
         verbose: bool = False, moments: str = "fp32", moments_min_size: int = 4096,
         bandwidths=None, threads: Optional[int] = None, suggest: bool = True,
         backward_s: Optional[float] = None, forward_s: Optional[float] = None, gpu_state="auto",
         state: Optional[str] = None, nvme_path=None) -> MemoryPlan:
    """Bytes each place will hold for this configuration, and whether it fits this machine.

    ``device``: where forward/backward run ('cpu' or 'cuda'; default: cuda if available).
    ``param_dtype``/``grad_dtype``: override the model's dtypes ('bf16', torch.bfloat16, ...).
    ``storage``: 'ram', 'nvme' or 'mmap', as given to the optimizer (default: 'nvme' when
    ``nvme_dir`` is given, else 'ram'; ``host_budget``, ``depth``: as given to the optimizer's
    store).
    ``sharding``: 'none', 'zero1' (state split across ``world_size``
    ranks) or 'fsdp' (weights, gradients and state split). ``activation_bytes``: your estimate,
    added to the GPU (or host, in CPU mode) total if given. ``verbose``: print the report.
    ``moments``/``moments_min_size``: as given to the optimizer (compressed Adam moments).
    ``nvme_dir``: as given to the optimizer (one directory, a list, or comma-separated): with
    several, ``drives`` holds each one's state file bytes (buckets round-robin, ``depth`` per
    drive). ``state``, ``nvme_path``: deprecated aliases of ``storage`` and ``nvme_dir``
    (DeprecationWarning). ``model_or_params`` may also be the path of a local Hugging Face
    ``config.json`` (or its folder): the model is built on the meta device (needs transformers;
    nothing is downloaded or allocated).
    ``bandwidths``: predict the step time (``step_time``, offload/steptime.py) from ``"measure"``
    (a few seconds here: kernel, the state directory, PCIe), saved ``bench kernel``/``bench io``
    JSON (a path, a list or comma-separated), or an ``offload.bandwidth.Bandwidths``/dict of
    bytes/s; ``threads``: the optimizer's ``threads=``. ``suggest``: name the first setup that fits
    when this one does not (``suggestion``). ``backward_s`` (with ``bandwidths`` and parameters on
    a GPU): the measured backward, to predict the iteration (``forward_s`` + backward + what of the
    CPU step stays exposed) with the state ``gpu_state`` lets stay on the GPU, as the optimizer's
    ``gpu_state=`` ("auto": the GPU's free memory less this plan's GPU bytes and a margin) and with
    none. Every argument is checked before anything is computed (offload/plan_args.py): a value the
    planner cannot use raises ValueError (TypeError for one of the wrong kind) naming it, in one
    line.
    """
    from . import plan_args as A
    from .state.choice import resolve_storage
    if nvme_path is not None:
        import warnings
        warnings.warn("plan(nvme_path=...) is deprecated: the argument is now called nvme_dir, as "
                      "the optimizer's",
                      DeprecationWarning, stacklevel=2)
        nvme_dir = nvme_dir if nvme_dir is not None else nvme_path
    # every argument, refused by name in one line before anything is computed
    state = A.storage(resolve_storage(storage, state, nvme_dir, stacklevel=3), nvme_dir)
    device = A.device(device)
    param_dtype = A.dtype(param_dtype, "param_dtype")
    grad_dtype = A.dtype(grad_dtype, "grad_dtype")
    for name, value in (("amsgrad", amsgrad), ("verbose", verbose), ("suggest", suggest)):
        A.flag(value, name)
    A.at_least(world_size, "world_size", 1)
    backward_s, forward_s = A.seconds(backward_s, "backward_s"), A.seconds(forward_s, "forward_s")
    gpu_state = A.gpu_state(gpu_state)
    if sharding not in ("none", "zero1", "fsdp"):
        raise ValueError(f"sharding must be 'none', 'zero1' or 'fsdp', got {sharding!r}")
    A.at_least(bucket_bytes, "bucket_bytes", 1)
    check_depth(depth)
    check_staging_slots(staging_slots)
    budget = A.budget(host_budget)
    dirs = A.dirs(nvme_dir) if state != "ram" else [None]
    activation_bytes = A.activation(activation_bytes)
    A.moments(moments, moments_min_size, amsgrad)
    fmt = moment_format(moments)
    bandwidths = A.bandwidths(bandwidths)
    A.threads(threads)
    if isinstance(model_or_params, (str, os.PathLike)):
        from .plan_inputs import hf_config_model
        model_or_params = hf_config_model(model_or_params)
    inv = A.inventory(model_or_params, param_dtype)
    shard = world_size if sharding != "none" else 1
    wshard = world_size if sharding == "fsdp" else 1

    def per_rank(n: int, k: int) -> int:
        return -(-n // k)

    numel = sum(n for n, _, _ in inv)
    weights = sum(per_rank(n, wshard) * dt.itemsize for n, dt, _ in inv)
    grads = sum(per_rank(n, wshard) * (grad_dtype or dt).itemsize for n, dt, _ in inv)
    dtypes = {dt for _, dt, _ in inv}
    wnames, gnames = _dtype_names(dtypes, None), _dtype_names(dtypes, grad_dtype)
    steps = STEP_BYTES * (len(inv) if shard == 1 else -(-len(inv) // shard))
    state_what = ("optimizer state: fp32 exp_avg, "
                  f"exp_avg_sq{', max_exp_avg_sq' if amsgrad else ''}")
    on_gpu = device == "cuda"
    # the engine's own layout (offload/state/layout.py) over this rank's shards: what it allocates,
    # exactly
    ranked = ((per_rank(n, shard), dt, active) for n, dt, active in inv)
    shapes = [Shape(0, i, k, dt.itemsize, master=on_gpu or dt in _LOW, active=active,
                    moments=fmt.for_size(k, moments_min_size))   # fp32 for smaller tensors
              for i, (k, dt, active) in enumerate(ranked)]
    per_drive = depth
    depth = min(64, depth * len(dirs)) if state == "nvme" else depth   # as the engine does
    nstage = staging_slots if on_gpu else 0
    state_cap, stage_cap = split_budget(state, budget, depth, nstage)
    check_budget(state, state_cap, depth, nstage, host_budget)
    if on_gpu:
        stage_cap = min(stage_cap or bucket_bytes, bucket_bytes)
    if state_cap is not None:   # the buckets of tensors cut into pieces, counted before laid out
        pieces = split_buckets(shapes, amsgrad=[amsgrad], max_state_bytes=state_cap)
        A.check_buckets(pieces, budget, host_budget, state_cap)
    lay = build_layout(shapes, amsgrad=[amsgrad], max_state_bytes=state_cap,
                       max_param_bytes=stage_cap, stagger=state == "ram")
    master = sum(b.cap * 4 for b in lay.buckets if b.master)
    engine_ram = state == "ram" and fmt.compressed   # compressed moments in the RAM tier

    rows: List[Row] = []
    warnings: List[str] = []
    compute = "gpu" if on_gpu else "host"
    rows.append(Row(compute, f"weights ({wnames})", weights))
    rows.append(Row(compute, f"gradients ({gnames})", grads))
    if activation_bytes:
        rows.append(Row(compute, "activations (your estimate)", activation_bytes))
    rows.append(Row("host", "optimizer state: step counters", steps))
    if engine_ram:
        _compressed_rows(rows, lay, fmt, moments_min_size, "host", "optimizer state")
        if on_gpu:
            ring = 2 * staging_slots * max(64, lay.max_stage_bytes)
            rows.append(Row("host", f"pinned staging ring ({staging_slots} slots of "
                                    "grads + weights)", ring))
    elif state == "ram" and on_gpu:
        # the engine's RAM tier: one arena of the layout (never pinned) + the ring
        rows.append(Row("host", state_what + " (not pinned)", max(ALIGN, lay.nbytes) - master))
        rows.append(Row("host", "optimizer state: fp32 master weights (not pinned)", master))
        ring = 2 * staging_slots * max(64, lay.max_stage_bytes)
        rows.append(Row("host", f"pinned staging ring ({staging_slots} slots of grads + weights)",
                        ring))
    elif state == "ram":   # the RAM tier: one arena of the layout
        rows.append(Row("host", state_what, lay.nbytes - master))
        if master:
            rows.append(Row("host", "optimizer state: fp32 master weights (bf16/fp16 params)",
                            master))
    else:
        if fmt.compressed:
            _compressed_rows(rows, lay, fmt, moments_min_size, "nvme",
                             f"optimizer state file ({state})")
        else:
            rows.append(Row("nvme",
                            f"optimizer state file ({state}: m, v" + (", vmax" if amsgrad else "")
                            + (", fp32 master" if master else "") + "; 4 KiB-aligned buckets)",
                            max(ALIGN, lay.nbytes)))
        if state == "nvme":
            slot = max(ALIGN, lay.max_bucket_bytes)
            rows.append(Row("host", f"NVMe bucket buffers ({depth + 2} x {human(slot, 2)}, "
                                    f"host_budget {human(budget, 2)})", (depth + 2) * slot))
        if on_gpu:
            ring = 2 * staging_slots * max(64, lay.max_stage_bytes)
            rows.append(Row("host", f"pinned staging ring ({staging_slots} slots of "
                                    "grads + weights)", ring))

    cap: dict = {}
    mem = host_memory()
    cap["host"] = mem.get("MemAvailable")
    if device == "cuda" or any(r.place == "gpu" for r in rows):
        cap["gpu"] = None
        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info()
            cap["gpu"] = free
        else:
            warnings.append("no CUDA device here: GPU capacity unknown")
    drives = []
    if state != "ram":
        frees = {}
        on_drive = [0] * len(dirs)   # buckets round-robin over the drives
        for b in lay.buckets:
            on_drive[b.index % len(dirs)] += b.nbytes
        for i, d in enumerate(dirs):
            path = d or os.getcwd()
            try:
                free, dev = shutil.disk_usage(path).free, os.stat(path).st_dev
                frees[dev] = free
            except OSError as e:
                free = None
                frees[("?", i)] = None
                warnings.append(f"nvme_dir {path}: {e.strerror or e}: its free space is unknown")
            if len(dirs) > 1:
                mine = max(ALIGN, on_drive[i])
                drives.append(dict(dir=path, bytes=mine, free=free))
                if free is not None and mine > free:
                    warnings.append(f"drive {path} needs {human(mine, 2)} but has "
                                    f"{human(free, 2)} available")
        # each filesystem once
        cap["nvme"] = None if None in frees.values() else sum(frees.values())
    warnings.append("offloading optimizer state does not make weights, gradients and activations "
                    f"fit: those stay on the {'GPU' if device == 'cuda' else 'compute device'} "
                    f"({human(weights + grads, 2)} "
                    f"here{'' if activation_bytes else ' + activations, not counted'})")
    if device == "cuda" and sharding == "fsdp":
        warnings.append("FSDP also needs room for the largest all-gathered (unsharded) "
                        "layer, not counted")
    mp = MemoryPlan(config=dict(params=numel, tensors=len(inv), param_dtype=wnames,
                                grad_dtype=gnames, device=device, state=state,
                                amsgrad=amsgrad, world_size=world_size, sharding=sharding,
                                moments=moments,
                                bucket_bytes=bucket_bytes, depth=depth, depth_per_drive=per_drive,
                                drives=len(dirs),
                                state_params=sum(s.numel for s in shapes if s.active)),
                    rows=rows, capacity=cap, warnings=warnings, drives=drives)
    for place, ok in mp.fits().items():
        if ok is False:
            mp.warnings.insert(0, f"{place} needs {human(mp.total(place), 2)} but has "
                                  f"{human(cap[place], 2)} available")
    if bandwidths is not None:
        from . import steptime
        from .plan_inputs import bandwidths_of
        bw = bandwidths_of(bandwidths, inv, moments, amsgrad, threads,
                           dirs if state == "nvme" else None,
                         lay.max_bucket_bytes, per_drive, on_gpu, lay.nbytes)
        stages = steptime.stages_of(lay, state=state, on_gpu=on_gpu, amsgrad=amsgrad,
                                    grad_itemsize=grad_dtype.itemsize if grad_dtype else None)
        mp.step_time = steptime.predict(stages, bw, state=state)
        if on_gpu and backward_s is not None and mp.step_time is not None:
            room = None if cap.get("gpu") is None else \
                max(0, cap["gpu"] - mp.total("gpu") - max(cap["gpu"] // 10, 2 << 30))
            if gpu_state == "auto" and room is None:
                mp.step_time.notes.append("GPU capacity unknown: the split is predicted for "
                                          "gpu_state=0; give gpu_state a size")
            budget = (room or 0) if gpu_state == "auto" else gpu_state
            mp.step_time.split = steptime.split(stages, lay, bw, backward_s=backward_s,
                                                forward_s=forward_s or 0.0, budget=budget)
    if suggest and False in mp.fits().values():
        args = dict(device=device, param_dtype=param_dtype, grad_dtype=grad_dtype,
                    world_size=world_size,
                    sharding=sharding, bucket_bytes=bucket_bytes, depth=per_drive,
                    host_budget=host_budget,
                    staging_slots=staging_slots, nvme_dir=nvme_dir,
                    activation_bytes=activation_bytes, moments_min_size=moments_min_size)
        from .plan_inputs import suggest_setup
        mp.suggestion = suggest_setup(plan, model_or_params, args, (state, moments), mp)
    if verbose:
        print(mp)
    return mp


def _compressed_rows(rows: list, lay, fmt, min_size: int, place: str, prefix: str) -> None:
    """State rows of a layout with compressed-moment buckets (format ``fmt``); they add up to
    ``lay.nbytes`` (what the RAM tier allocates / the state file holds)."""
    def moments(b):   # the bucket's state without its fp32 master
        return b.state_bytes - (b.cap * 4 if b.master else 0)
    comp = sum(moments(b) for b in lay.buckets if b.moments is fmt)
    plain = sum(moments(b) for b in lay.buckets if b.moments is not fmt)
    master = sum(b.cap * 4 for b in lay.buckets if b.master)
    scales = ", per-block fp32 scales" if any(s.per_block for s in fmt.sections) else ""
    rows.append(Row(place, f"{prefix}: {fmt.name} exp_avg, exp_avg_sq{scales}", comp))
    if plain:
        rows.append(Row(place, f"{prefix}: fp32 exp_avg, exp_avg_sq (tensors < "
                               f"{min_size} elements)", plain))
    if master:
        rows.append(Row(place, f"{prefix}: fp32 master weights", master))
    rows.append(Row(place, f"{prefix}: 4 KiB bucket alignment",
                    max(ALIGN, lay.nbytes) - comp - plain - master))


def _dtype_names(dtypes, override) -> str:
    names = sorted({str(override or dt).replace("torch.", "") for dt in dtypes})
    return "/".join(names)
