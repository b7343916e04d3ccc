"""params/host.py: HostParams, parameters and gradients in host memory (CPU tensors, FSDP2 local
shards).

The kernel reads gradients straight from ``p.grad`` (no copy). An fp32 parameter is its own
master (updated in place); a bf16/fp16 parameter's master is a state section and the kernel
writes the rounded weight into the parameter in the same pass. The per-step check of parameters
and gradients is cached per row (params/hostrows.py); ``ptrs`` reads the addresses it recorded.
"""
from __future__ import annotations

import torch

from ..base.dist import local
from ..native.adam import DTYPE_CODES, OUT_USER_PARAM
from .base import LOW_PRECISION, bump_stepped
from .side import ParamSide

__all__ = ["HostParams"]


class HostParams(ParamSide):
    """The parameter side of CPU tensors (params/side.py: what each method does)."""

    def __init__(self, groups, dtypes=None):
        super().__init__(groups)      # (dtypes: the engine's; the rows record their own)
        # the cached per-row check (HostRows), made on the first collect
        self.rows = None

    def collect(self, groups, local_groups, dtypes, numels, own, mode: str) -> tuple:
        """Validate this step's parameters and gradients: (active masks, gradients) per group."""
        if self.rows is None:
            from .hostrows import HostRows
            self.rows = HostRows()
        return self.rows.collect(groups, local_groups, dtypes, numels, own, mode)

    def revalidated(self) -> list:
        return getattr(self.rows, "revalidated", [])

    def row_records(self):
        return self.rows

    def user_writes(self, tracker, ready) -> set:
        """bf16/fp16 parameters written since their last step: the kernel takes the elements that
        differ from round(master) into the master first (engine/engine.py _resync)."""
        return tracker.written(ready)

    def ptrs(self, b, pieces, staged=None):
        """Per piece: (param address or 0, grad address, grad dtype code, out address or 0, out
        dtype code)."""
        if self.rows is not None and self.grads is not None:
            fast = self.rows.ptrs(b, pieces, self.grads[b.group])
            if fast is not None:
                return fast
        out = []
        params = self.groups[b.group]
        for pc in pieces:
            p = local(params[pc.param])
            g = self.grads[b.group][pc.param]
            isz = p.element_size()
            ga = g.data_ptr() + pc.start * g.element_size()
            if p.dtype in LOW_PRECISION:
                # the parameter itself is the output: elements the user wrote are adopted
                # (OUT_USER_PARAM)
                out.append((0, ga, DTYPE_CODES[g.dtype], p.data_ptr() + pc.start * isz,
                            OUT_USER_PARAM[p.dtype]))
            else:
                out.append((p.data_ptr() + pc.start * isz, ga, DTYPE_CODES[g.dtype], 0, 0))
        return out

    def stepped(self, active: list) -> None:
        """The kernel wrote the parameters ``active`` (per group, bool masks) through their
        addresses: their version counters go up as after an in-place torch op (that of the
        parameter object a forward saves: a sharded parameter's DTensor), and the cached records of
        bf16/fp16 rows follow, so that the next step does not take its own write for the user's."""
        bump_stepped(self.groups, active)
        if self.rows is not None:
            self.rows.bumped(active)

    def read_master(self, gi: int, i: int, start: int, n: int, dst: torch.Tensor,
                    changed_only: bool = False, after=None) -> None:
        # (host bf16/fp16 parameters: the kernel adopts user writes element by element anyway)
        dst.copy_(local(self.groups[gi][i]).detach().reshape(-1)[start:start + n])

    def grad_sumsq(self, grads, threads: int) -> float:
        from ..native.adam import grad_sumsq
        return grad_sumsq([local(g) for g in grads], threads) if grads else 0.0
