"""checkpoint/adapter.py: the optimizer-side extension point of the checkpoint.

The checkpoint uses torch's optimizer API (``param_groups``, ``state`` / ``state_dict()``:
offload's returns views of the NVMe/mmap state file and synchronizes the device schedule;
``load_state_dict()``) and, for the rest, one port object: :class:`CheckpointPort`, which an
optimizer offers as ``checkpoint_port()`` (offload.Adam/AdamW do: offload/optim/adam.py); any other
optimizer (torch.optim's) gets the port of state in plain tensors, with the ``checkpoint_tensors``
/ ``checkpoint_state`` it defines (:func:`port`). What is not the optimizer's own API is read in
ONE small function each:

- :func:`readopt`         ``opt.__setstate__`` (offload re-reads its state pointers there)
- :func:`resolve` / :func:`sync_wrapper`  torch's ZeroRedundancyOptimizer
                          (``_partition_parameters``, ``_sync_param_groups``)

An optimizer whose state is not in plain tensors may define ``checkpoint_tensors(create_from)``
returning :class:`StateTensor` objects (see docs/checkpoints.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import torch

from ..base.dist import local

# families whose state layout (moments shaped like the parameter) the loader checks strictly
ADAM_KINDS = ("Adam", "AdamW")


@dataclass(frozen=True)
class CheckpointPort:
    """What offload.save / offload.load use of an optimizer beyond torch's API, in one place."""
    # what a background save holds: the state views stay mapped
    keepalive: Callable[[], Any]
    # state loaded through load_state_dict, not into opt.state
    loads_itself: Callable[[], bool]
    on_device: Callable[[], bool]            # parameters on a device (GPU offload)
    # the clip coefficient left for the next step (1.0: none)
    pending: Callable[[], float]
    # restore it (a checkpoint saved between clip and step)
    set_pending: Callable[[float], None]
    # StateTensors of state not in plain tensors (create_from)
    tensors: Optional[Callable] = None
    scalars: Optional[Callable[[], dict]] = None   # state_dict()['state'] without those tensors


def port(opt) -> CheckpointPort:
    """The optimizer's port: its ``checkpoint_port()``, else that of state in plain tensors, with
    the ``checkpoint_tensors(create_from)`` / ``checkpoint_state()`` the optimizer defines."""
    own = getattr(opt, "checkpoint_port", None)
    if callable(own):
        return own()
    return CheckpointPort(keepalive=lambda: None, loads_itself=lambda: False,
                          on_device=lambda: False,
                          pending=lambda: 1.0, set_pending=lambda value: None,
                          tensors=getattr(opt, "checkpoint_tensors", None),
                          scalars=getattr(opt, "checkpoint_state", None))


@dataclass
class StateTensor:
    """One state tensor as the checkpoint sees it.

    ``read_chunks(n)`` yields contiguous CPU tensors whose bytes, concatenated, are the tensor's
    bytes (each at most ``n`` bytes); ``write_chunks(n)`` is a generator yielding writable CPU
    tensors that the loader fills in order. Neither needs the whole tensor in memory at once.
    """
    name: str
    param: int           # index of the parameter (torch state_dict numbering)
    key: str             # state key, e.g. 'exp_avg'
    dtype: torch.dtype
    shape: tuple
    read_chunks: Callable[[int], Iterator[torch.Tensor]]
    write_chunks: Callable[[int], Iterator[torch.Tensor]]
    keep: Any = field(default=None, repr=False)  # what must stay alive while the bytes are read

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


def _byte_chunks(t: torch.Tensor, n: int) -> Iterator[torch.Tensor]:
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
    for b in range(0, flat.numel(), n):
        yield flat[b:b + n]


def tensor_ref(name: str, pidx: int, key: str, t: torch.Tensor) -> StateTensor:
    lt = local(t)
    if lt.device.type != "cpu" or not lt.is_contiguous():
        def read(n, lt=lt):
            return _byte_chunks(lt.detach().to("cpu").contiguous(), n)

        def write(n, lt=lt):
            tmp = torch.empty(lt.shape, dtype=lt.dtype)
            yield from _byte_chunks(tmp, n)
            lt.copy_(tmp)
    else:
        def read(n, lt=lt):
            return _byte_chunks(lt.detach(), n)

        def write(n, lt=lt):
            yield from _byte_chunks(lt.detach(), n)
    return StateTensor(name, pidx, key, lt.dtype, tuple(lt.shape), read, write)


def params(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def kind(opt) -> str:
    """The optimizer's family: the first class of its MRO defined by torch.optim or offload (so
    offload.AdamW and torch.optim.AdamW are both 'AdamW'; a user subclass keeps its base's)."""
    for cls in type(opt).__mro__:
        mod = cls.__module__ or ""
        ours = any(mod == m or mod.startswith(m + ".") for m in ("torch.optim", "offload"))
        if ours and not cls.__name__.startswith("_") and cls is not torch.optim.Optimizer:
            return cls.__name__
    return type(opt).__qualname__


def resolve(optimizer, group):
    """(the optimizer holding this rank's state, process group). ZeroRedundancyOptimizer: its
    shard."""
    inner = getattr(optimizer, "optim", None)
    if inner is not None and hasattr(optimizer, "_partition_parameters"):
        return inner, (group if group is not None else getattr(optimizer, "process_group", None))
    return optimizer, group


def sync_wrapper(optimizer, opt) -> None:
    """ZeroRedundancyOptimizer copies its own groups' hyperparameters into the shard's at every
    step: give it the loaded ones (groups correspond by index)."""
    if opt is not optimizer and hasattr(optimizer, "_sync_param_groups"):
        optimizer._sync_param_groups(opt.param_groups, optimizer.param_groups)


def keepalive(opt):
    """What a background save must hold so that the views it reads stay mapped after ``del
    opt``."""
    return port(opt).keepalive()


def loads_itself(opt) -> bool:
    """State the optimizer must load through load_state_dict (NVMe/mmap store or device
    parameters)."""
    return bool(port(opt).loads_itself())


def in_gpu_mode(opt) -> bool:
    return bool(port(opt).on_device())


def pending_multiplier(opt) -> float:
    return float(port(opt).pending())


def set_pending_multiplier(opt, value: float) -> None:
    port(opt).set_pending(value)


def readopt(opt) -> None:
    """Let the optimizer re-adopt its (modified in place) state: offload re-reads pointers and
    step counters here; torch optimizers only fill in defaults."""
    opt.__setstate__({"state": opt.state, "param_groups": opt.param_groups})


def saved_state(opt) -> tuple:
    """(per-parameter state dicts by index, StateTensors) of the optimizer, through public API:
    ``checkpoint_tensors`` if defined, else ``state_dict()`` (tensors are references or views)."""
    pt = port(opt)
    # the tensors come from the hook: take the rest without reading any moment
    if pt.tensors is not None:
        sd_state = pt.scalars() if callable(pt.scalars) else opt.state_dict()["state"]
        return sd_state, list(pt.tensors(None))
    sd_state = opt.state_dict()["state"]
    refs = []
    for pidx in range(len(params(opt))):
        st = sd_state.get(pidx) or {}
        for key in sorted(st):
            v = st[key]
            if key != "step" and isinstance(v, torch.Tensor):
                refs.append(tensor_ref(f"state.{pidx}.{key}", pidx, key, v))
    keep = keepalive(opt)
    for r in refs:
        r.keep = keep
    return sd_state, refs


def destinations(opt, plan_tensors: list, like_fn) -> List[StateTensor]:
    """RAM state: the StateTensors to load into, allocating missing/mismatching ones (the
    optimizer is being modified: call only after everything was validated)."""
    hook = port(opt).tensors
    if hook is not None:  # create_from: what the loader will write (validated), torch dtypes
        return list(hook({"tensors": [dict(param=t.param, key=t.key, shape=list(t.shape),
                                           dtype=t.dtype) for t in plan_tensors]}))
    ps = params(opt)
    refs = []
    for t in plan_tensors:
        p = ps[t.param]
        st = opt.state[p]
        cur = st.get(t.key)
        if not (isinstance(cur, torch.Tensor) and local(cur).dtype == t.dtype
                and tuple(local(cur).shape) == tuple(t.shape) and local(cur).is_contiguous()):
            lt = torch.empty(tuple(t.shape), dtype=t.dtype)
            st[t.key] = like_fn(p, lt) if tuple(local(p).shape) == tuple(t.shape) else lt
        refs.append(tensor_ref(t.name, t.param, t.key, st[t.key]))
    return refs
