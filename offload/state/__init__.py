"""state/: WHERE THE OPTIMIZER STATE LIVES. One tier per kind, all behind the interface of tier.py.

``ram`` (one aligned arena, never pinned), ``nvme`` (a private O_DIRECT file + a small ring of host
slots), ``mmap`` (a shared mapping of the same file). Tiers know buckets (offload/layout.py) and
bytes; they never see parameters, gradients or the optimizer.
"""
from .tier import Block, StateTier, StoreFailedError, make_tier

__all__ = ["Block", "StateTier", "StoreFailedError", "make_tier"]
