"""base/dist.py: the few torch.distributed facts the optimizer and the checkpoints need.

DTensor (FSDP2 ``fully_shard`` parameters): the kernel works on each rank's local shard, so
everything that takes a pointer goes through :func:`local`, which returns the local tensor that
shares the DTensor's storage (never a copy). State created for a DTensor parameter is wrapped back
into a DTensor with the same mesh and placements (:func:`like`), as torch's own optimizers do, so
``state_dict()`` keeps working with ``torch.distributed.checkpoint``.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch built without distributed
    _DTensor = None

__all__ = ["is_dtensor", "local", "like", "world", "allreduce_sumsq", "layout_key", "global_sumsq",
           "nonfinite_norm", "in_process_group", "multi_rank"]


def is_dtensor(t) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor the kernel may write into: ``t`` itself, or a DTensor's local shard (same
    storage)."""
    if t is not None and is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def like(p: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """Wrap ``local_tensor`` (the local part of something shaped like ``p``) the way ``p`` is
    wrapped, without moving it: ``DTensor.from_local`` copies a host tensor to the mesh's device (a
    CUDA mesh would get a GPU copy of the offloaded state, 12 B/param, and a stale one), so a local
    tensor on another device type is wrapped directly, as FSDP2 wraps its own CPU-offloaded
    shards."""
    if not is_dtensor(p):
        return local_tensor
    mesh = p.device_mesh
    if local_tensor.device.type != mesh.device_type:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        spec = DTensorSpec(mesh, tuple(p.placements),
                           tensor_meta=TensorMeta(p.shape, p.stride(), local_tensor.dtype))
        return _DTensor(local_tensor, spec, requires_grad=False)
    return _DTensor.from_local(local_tensor, mesh, p.placements, run_check=False, shape=p.shape,
                               stride=p.stride())


def world(group=None) -> Tuple[int, int]:
    """(rank, world size) of ``group`` when torch.distributed is initialized, else (0, 1)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def allreduce_sumsq(local_sumsq: dict, fallback: float = 0.0) -> float:
    """Global sum of squares from per-layout partial sums.

    ``local_sumsq`` maps a key to ``(sumsq, dtensor_or_None)``: plain tensors are replicated
    (their sum counts once); for a DTensor the partial sum is all-reduced over every mesh
    dimension on which it is sharded (one scalar per distinct layout, usually one in total).
    """
    import torch.distributed as dist
    total = fallback
    for sumsq, ref in local_sumsq.values():
        if ref is None:
            total += sumsq
            continue
        mesh = ref.device_mesh
        # on the mesh's device type: an NCCL process group reduces CUDA tensors only
        t = torch.tensor([sumsq], dtype=torch.float64, device=mesh.device_type)
        for dim, placement in enumerate(ref.placements):
            if placement.is_partial():
                raise RuntimeError("clip_grad_norm_: a gradient is a Partial DTensor (not yet "
                                   "reduced); reduce the gradients before clipping")
            if placement.is_shard():
                dist.all_reduce(t, group=mesh.get_group(dim))
        total += float(t.item())
    return total


def layout_key(t) -> Optional[tuple]:
    """Key grouping DTensors whose local norms reduce over the same process groups."""
    if not is_dtensor(t):
        return None
    return (id(t.device_mesh), tuple(str(pl) for pl in t.placements))


def nonfinite_norm(total: float) -> RuntimeError:
    """clip_grad_norm_(error_if_nonfinite=True) on a non-finite global norm: torch's message, and
    what to do."""
    return RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total}), so "
                        "it cannot be clipped: find the inf/NaN in the loss or gradients "
                        "(torch.amp.GradScaler skips such steps; offload's "
                        "check_overflow=True does too)")


def global_sumsq(grads: list, local_sumsq) -> float:
    """Sum of squares of ``grads`` over the whole model: ``local_sumsq(tensors)`` of each group of
    local tensors, all-reduced across ranks for DTensor (FSDP2) shards
    (:func:`allreduce_sumsq`)."""
    if not any(is_dtensor(g) for g in grads):
        return local_sumsq(grads) if grads else 0.0
    parts: dict = {}
    for g in grads:
        parts.setdefault(layout_key(g), []).append(g)
    return allreduce_sumsq({k: (local_sumsq([local(g) for g in gs]), gs[0] if k else None)
                            for k, gs in parts.items()})


def in_process_group() -> bool:
    """torch.distributed is initialized (any world size)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def multi_rank() -> bool:
    """torch.distributed is initialized with more than one rank."""
    return world()[1] > 1


PARTITION_NORM = ("{what} under torch's ZeroRedundancyOptimizer: each rank's offload optimizer "
                  "holds only its partition of the parameters, so the norm it computes is its "
                  "partition's, not the model's, and every rank would clip by another coefficient "
                  "(or skip other steps). Clip the whole model before step() instead: "
                  "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) "
                  "(docs/distributed.md)")


def zero_partition(depth: int = 16) -> bool:
    """Is this optimizer being built by torch's ZeroRedundancyOptimizer, for this rank's partition
    of the parameters? (Its ``_init_local_optimizer`` is on the call stack: at construction and
    when a param group is added.)"""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None:
        return False
    cls = zero.ZeroRedundancyOptimizer
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if isinstance(f.f_locals.get("self"), cls):
            return True
        f = f.f_back
    return False

