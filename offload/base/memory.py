"""base/memory.py: 4 KiB-aligned host memory for NVMe transfers.

``HostArena`` is one aligned allocation (O_DIRECT needs aligned buffer addresses) cut into
equal slots; the NVMe tier reuses its slots for every bucket, so host memory stays fixed
whatever the model size. It is ordinary pageable memory: the GPU never copies from it (only the
device side's staging ring is pinned, through ``offload.device``).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["ALIGN", "aligned_empty", "HostArena", "round_up"]

ALIGN = 4096


def round_up(x: int, a: int) -> int:
    """Smallest multiple of ``a`` that is >= ``x``."""
    return (x + a - 1) // a * a


def aligned_empty(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """Uninitialised uint8 CPU tensor of ``nbytes`` whose address is a multiple of ``align``.

    The memory is not touched, so pages count towards RSS only once they are written. It is
    numpy-owned: its storage cannot be resized (freed) by a caller while a kernel writes it.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = torch.from_numpy(np.empty(nbytes + align, dtype=np.uint8))
    off = (-raw.data_ptr()) % align
    return raw[off:off + nbytes]  # the view keeps ``raw`` alive


class HostArena:
    """``slots`` aligned buffers of ``slot_bytes`` each (``slot_bytes`` a multiple of 4 KiB)."""

    pinned = False   # never page-locked (see the module docstring)

    def __init__(self, slots: int, slot_bytes: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN}, "
                             f"got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.memory = aligned_empty(slots * slot_bytes)
        self.slots = [self.memory[i * slot_bytes:(i + 1) * slot_bytes] for i in range(slots)]

    @property
    def nbytes(self) -> int:
        return self.memory.numel()
