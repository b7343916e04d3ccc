"""state/: WHERE THE OPTIMIZER STATE LIVES. One tier per storage, all behind the interface of
tier.py.

``ram`` (one aligned arena, never pinned), ``nvme`` (a private O_DIRECT file + a small ring of host
slots), ``mmap`` (a shared mapping of the same file). Tiers know buckets (offload/state/layout.py)
and bytes; they never see parameters, gradients or the optimizer. ``make_tier`` (here, not in
tier.py, so that the tiers import tier.py and nothing imports back) builds one by name.
"""
from .tier import Block, StateTier, StoreFailedError

__all__ = ["Block", "StateTier", "StoreFailedError", "make_tier"]


def make_tier(storage: str, **kw) -> StateTier:
    if storage == "ram":
        from .ram import RamTier
        return RamTier()
    if storage == "nvme":
        from .nvme import NvmeTier
        # its slots are sized by the engine
        return NvmeTier(**{k: v for k, v in kw.items() if k != "budget"})
    if storage == "mmap":
        from .mmap import MmapTier
        return MmapTier(**{k: v for k, v in kw.items() if k in ("nvme_dir", "keep", "budget")})
    raise ValueError(f"storage must be 'ram', 'nvme' or 'mmap', got {storage!r}")
