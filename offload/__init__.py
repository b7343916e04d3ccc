"""offload: optimizer-state offload for PyTorch with a vectorized native Adam kernel.

Public API:
- ``Adam``, ``AdamW``: drop-in ``torch.optim`` optimizers. State in host RAM (default), in a file on
  NVMe (``state="nvme"``) or mapped (``state="mmap"``); CUDA parameters switch to GPU offload.
- ``save``, ``load``, ``save_async``: streaming, atomic, checksummed checkpoints (safetensors).
- ``plan``: the memory planner (bytes per place before training).
- ``build_info()``; the validated kernel entry points in ``offload.kernels``.
"""
from __future__ import annotations

from ._version import __version__
from . import _C
from . import kernels
from .optim import Adam, AdamW
from .failstop import OptimizerFailedError
from .store import StoreFailedError
from .guards import SharedMemoryError
from .checkpoint import CheckpointError, load, save, save_async
from .planner import MemoryPlan, plan

__all__ = ["Adam", "AdamW", "build_info", "kernels", "__version__", "OptimizerFailedError", "StoreFailedError",
           "SharedMemoryError",
           "save", "load", "save_async", "CheckpointError", "plan", "MemoryPlan"]


def build_info() -> dict:
    """Version of the package and of the compiled core, chosen/available ISAs, thread count."""
    return {
        "version": __version__,
        "native_version": _C.__version__,
        "isa": _C.get_isa(),
        "available_isas": list(_C.available_isas()),
        "threads": _C.get_num_threads(),
        "affinity_cpus": _C.affinity_cpu_count(),
    }
