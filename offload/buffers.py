"""buffers.py: 4 KiB-aligned host memory for NVMe transfers.

``HostArena`` is one aligned allocation (O_DIRECT needs aligned buffer addresses) cut into
equal slots; the state store reuses its slots for every bucket, so host memory stays fixed
whatever the model size. When CUDA is available the arena is page-locked once with
``cudaHostRegister`` so GPU copies from it are DMA transfers (guarded: without CUDA, or if the
call fails, the arena is ordinary pageable memory and ``pinned`` says so).
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["ALIGN", "aligned_empty", "HostArena", "round_up"]

ALIGN = 4096


def round_up(x: int, a: int) -> int:
    """Smallest multiple of ``a`` that is >= ``x``."""
    return (x + a - 1) // a * a


def aligned_empty(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """Uninitialised uint8 CPU tensor of ``nbytes`` whose address is a multiple of ``align``.

    The memory is not touched, so pages count towards RSS only once they are written.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off:off + nbytes]  # the view keeps ``raw`` alive


def _cuda_register(t: torch.Tensor) -> bool:
    try:
        if not torch.cuda.is_available() or t.numel() == 0:
            return False
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        return int(getattr(rc, "value", rc)) == 0
    except Exception as e:  # pragma: no cover - needs CUDA
        warnings.warn(f"cudaHostRegister of the {t.numel()}-byte I/O arena failed ({e}); using pageable memory",
                      RuntimeWarning)
        return False


def _cuda_unregister(t: torch.Tensor) -> None:
    try:  # pragma: no cover - needs CUDA
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:
        pass


class HostArena:
    """``slots`` aligned buffers of ``slot_bytes`` each (``slot_bytes`` a multiple of 4 KiB)."""

    def __init__(self, slots: int, slot_bytes: int, pin: bool = True):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN}, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.memory = aligned_empty(slots * slot_bytes)
        self.slots = [self.memory[i * slot_bytes:(i + 1) * slot_bytes] for i in range(slots)]
        self.pinned = _cuda_register(self.memory) if pin else False

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def close(self) -> None:
        if getattr(self, "pinned", False):
            _cuda_unregister(self.memory)
            self.pinned = False

    def __del__(self):
        self.close()
