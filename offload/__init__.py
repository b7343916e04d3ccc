"""offload: optimizer-state offload for PyTorch with a vectorized native Adam kernel.

Public API:
- ``Adam``, ``AdamW``: drop-in ``torch.optim`` optimizers. State in host RAM (default), in a file
  on NVMe (``storage="nvme"``) or mapped (``storage="mmap"``); CUDA parameters switch to GPU
  offload.
- ``save``, ``load``, ``save_async``: streaming, atomic, checksummed checkpoints (safetensors).
- ``plan``: the memory planner (bytes per place before training).
- ``build_info()``; the validated kernel entry points in ``offload.kernels``.
- ``doctor()``: the environment report a bug report needs (also ``python -m offload``).

Notable decisions (parameters stepped by torch's code, buffered instead of direct I/O, the state
tier chosen) are logged at INFO on the ``offload`` logger, silent unless the application configures
logging (``logging.basicConfig(level=logging.INFO)``).
"""
from __future__ import annotations

import logging as _logging

from ._version import __version__
from . import native
from . import kernels
from .optim.adam import Adam, AdamW
from .base.failstop import OptimizerFailedError
from .store import StoreFailedError
from .params.guards import SharedMemoryError
from .checkpoint import CheckpointError, load, save, save_async
from .planner import MemoryPlan, plan
from .doctor import format_report as _format_report, report as _report

# silent unless the application configures logging
_logging.getLogger("offload").addHandler(_logging.NullHandler())

__all__ = ["Adam", "AdamW", "build_info", "kernels", "__version__", "OptimizerFailedError",
           "StoreFailedError", "SharedMemoryError",
           "save", "load", "save_async", "CheckpointError", "plan", "MemoryPlan", "doctor"]


def build_info() -> dict:
    """Version of the package and of the compiled core, chosen/available ISAs, thread count."""
    return {"version": __version__, **native.info()}


def doctor(dir=None, *, print_report: bool = False, speed_test: bool = True) -> dict:
    """Versions, CPU, memory, CUDA and the filesystem of ``dir`` (default: the temporary
    directory), as a dict (keys: ``offload.doctor.KEYS``; printed as text with
    ``print_report=True``). The same as ``python -m offload``; ``speed_test=False`` skips the ~2 s
    write+read test of ``dir``."""
    rep = _report(build_info(), dir, speed_test=speed_test)
    if print_report:
        print(_format_report(rep))
    return rep
