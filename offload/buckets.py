"""buckets.py: parameters -> buckets with host arenas, for the GPU-offload scheduler.

A bucket is a run of consecutive parameters of one param group (registration order, which for
``model.parameters()`` is forward order for the usual models) of about ``bucket_bytes`` of
parameter storage. Each bucket owns, on the host (pinned on CUDA):
  * one fp32 arena holding master weights, exp_avg, exp_avg_sq (and max_exp_avg_sq for amsgrad),
  * a byte arena of gradient staging (gradients land here in their own dtype: bf16 stays 2 B),
  * a byte arena of weight staging (the kernel writes the new weights here in the parameter dtype),
  * one fp32 slot for the bucket's squared gradient norm (computed on the device),
and a prebuilt native task table whose rows point into those arenas.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from ._kernels import (COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_STEP, COL_V, COL_VMAX,
                       DTYPE_CODES, TASK_COLS, _ptr)
from .buffers import round_up
from .device import Device

__all__ = ["Slot", "Bucket", "build_buckets"]

_ALIGN = 64  # bytes: every tensor view starts on a cache line


class Slot:
    """One parameter inside a bucket."""

    __slots__ = ("param", "group", "index", "bucket", "pos", "numel", "off", "boff", "dtype")

    def __init__(self, param, group, index, bucket, pos, off, boff):
        self.param = param
        self.group = group          # param group index
        self.index = index          # index inside the group
        self.bucket = bucket        # Bucket
        self.pos = pos              # index inside the bucket
        self.numel = param.numel()
        self.off = off              # element offset in the fp32 arenas
        self.boff = boff            # byte offset in the staging arenas
        self.dtype = param.dtype


class Bucket:
    def __init__(self, index: int, group: int, params: Sequence[torch.Tensor], first_index: int,
                 device: Device, amsgrad: bool):
        self.index = index
        self.group = group
        self.slots: List[Slot] = []
        off = boff = 0
        for k, p in enumerate(params):
            self.slots.append(Slot(p, group, first_index + k, self, k, off, boff))
            off += round_up(p.numel(), _ALIGN // 4)
            boff += round_up(p.numel() * p.element_size(), _ALIGN)
        self.numel = off
        self.nbytes = boff
        n = off
        nstate = 4 if amsgrad else 3
        self.arena = device.host_empty(nstate * n, torch.float32)
        self.master = self.arena[0:n]
        self.exp_avg = self.arena[n:2 * n]
        self.exp_avg_sq = self.arena[2 * n:3 * n]
        self.max_exp_avg_sq = self.arena[3 * n:4 * n] if amsgrad else None
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        if amsgrad:
            self.max_exp_avg_sq.zero_()
        self.grad_stage = device.host_empty(max(boff, 1), torch.uint8)
        self.out_stage = device.host_empty(max(boff, 1), torch.uint8)
        self.sumsq = device.host_empty(1, torch.float32)
        self.steps = torch.zeros(len(self.slots), dtype=torch.float32)
        self.table = np.zeros((len(self.slots), TASK_COLS), dtype=np.int64)
        for s in self.slots:
            row = self.table[s.pos]
            row[COL_P] = _ptr(self.master_view(s))
            row[COL_M] = _ptr(self.view(self.exp_avg, s))
            row[COL_V] = _ptr(self.view(self.exp_avg_sq, s))
            row[COL_VMAX] = _ptr(self.view(self.max_exp_avg_sq, s)) if amsgrad else 0
            row[COL_G] = _ptr(self.grad_view(s))
            row[COL_OUT] = _ptr(self.out_view(s))
            row[COL_N] = s.numel
            row[COL_GD] = DTYPE_CODES[s.dtype]
            row[COL_OD] = DTYPE_CODES[s.dtype]

    # views of one parameter's slice, shaped like the parameter
    def view(self, arena: Optional[torch.Tensor], s: Slot) -> Optional[torch.Tensor]:
        if arena is None:
            return None
        return arena[s.off:s.off + s.numel].view(s.param.shape)

    def master_view(self, s: Slot) -> torch.Tensor:
        return self.view(self.master, s)

    def _bytes_view(self, arena: torch.Tensor, s: Slot) -> torch.Tensor:
        nb = s.numel * s.param.element_size()
        return arena[s.boff:s.boff + nb].view(s.dtype).view(s.param.shape)

    def grad_view(self, s: Slot) -> torch.Tensor:
        return self._bytes_view(self.grad_stage, s)

    def out_view(self, s: Slot) -> torch.Tensor:
        return self._bytes_view(self.out_stage, s)

    def task_table(self, positions: Sequence[int]) -> np.ndarray:
        """Rows of the given slots with their step counts advanced by one (the caller commits)."""
        idx = np.asarray(positions, dtype=np.int64)
        t = self.table[idx] if len(idx) != len(self.slots) else self.table.copy()
        t[:, COL_STEP] = self.steps.numpy()[idx].astype(np.int64) + 1
        return t

    def param_bytes(self) -> int:
        return sum(s.numel * s.param.element_size() for s in self.slots)


def build_buckets(groups: Sequence[Sequence[torch.Tensor]], bucket_bytes: int, device: Device,
                  amsgrad_per_group: Sequence[bool]) -> List[Bucket]:
    """Split every group's parameters, in order, into buckets of at most ``bucket_bytes`` of
    parameter storage (a parameter larger than that gets a bucket of its own)."""
    buckets: List[Bucket] = []
    for gi, params in enumerate(groups):
        start, cur, size = 0, [], 0
        for i, p in enumerate(params):
            nb = p.numel() * p.element_size()
            if cur and size + nb > bucket_bytes:
                buckets.append(Bucket(len(buckets), gi, cur, start, device, amsgrad_per_group[gi]))
                start, cur, size = i, [], 0
            cur.append(p)
            size += nb
        if cur:
            buckets.append(Bucket(len(buckets), gi, cur, start, device, amsgrad_per_group[gi]))
    return buckets
