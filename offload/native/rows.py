"""native/rows.py: the native per-step row checks (csrc/rows.cpp) and what they are given.

``collect_rows`` compares every host parameter and gradient with its record (used by
offload/params/hostrows.py); ``state_rows`` says which ``opt.state`` entries are no longer the
recorded objects (used by offload/engine/torchstate.py). Here too: the getters and constants of
torch ``collect_rows`` calls (``ROW_FNS``), the columns of the per-row record it compares against,
and how a validated parameter is recorded. Tests of the native check use it too.
"""
from __future__ import annotations

import operator

import torch

from . import _C

__all__ = ["collect_rows", "state_rows", "ROW_FNS", "M_PPTR", "M_GPTR", "M_CODE", "M_DIM",
           "M_SIZE0", "M_NUMEL", "M_PVER", "M_LOWP", "M_COLS",
           "no_grad_ref", "record_param", "get_version"]

collect_rows = _C.collect_rows  # the native entries themselves: no wrapper on the per-step path
state_rows = _C.state_rows

# what the native fast path (_C.collect_rows, csrc/rows.cpp) reads of each param/grad: the getset
# descriptors and unbound methods of torch's tensor base class (direct C calls, no attribute
# lookup), then the constants it compares with; the order is fixed by csrc/rows.cpp
_TensorBase = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
_TB = _TensorBase.__dict__
ROW_FNS = (_TB["grad"], _TB["data_ptr"], _TB["dtype"], _TB["stride"], _TB["is_neg"],
           _TB["is_conj"], _TB["_version"],
           _TB["shape"], _TB["is_cpu"], _TB["layout"], _TB["storage_offset"],
           _TB["untyped_storage"],
           torch._C.StorageBase.nbytes, torch.Tensor, torch.nn.Parameter, torch.strided,
           torch.float32, torch.bfloat16, torch.float16, _TensorBase)


def no_grad_ref():  # stands in for a weakref of a row that has no validated gradient yet
    return None


get_version = operator.attrgetter("_version")


# columns of GroupRows.meta (offload/params/hostrows.py), the per-row record csrc/rows.cpp
# (collect_rows) compares against
M_PPTR, M_GPTR, M_CODE, M_DIM, M_SIZE0, M_NUMEL, M_PVER, M_LOWP = range(8)
M_COLS = 8


def record_param(plan, i: int, lp: torch.Tensor, code: int) -> None:
    """Record validated parameter ``lp`` (a plain contiguous CPU tensor) in row i of
    ``plan.meta``."""
    m = plan.meta[i]
    m[M_PPTR], m[M_CODE], m[M_DIM] = lp.data_ptr(), code, lp.dim()
    m[M_SIZE0], m[M_NUMEL] = (lp.shape[0] if lp.dim() else 0), lp.numel()
    plan.layouts[i] = (lp.shape, lp.stride())
