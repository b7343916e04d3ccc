"""optim/clipping.py: gradient clipping folded into the next step: ``Clip``, the part of
offload.Adam/AdamW that holds the pending clip coefficient (the optimizer's ``_clip``).

``Clip.clip_grad_norm_`` computes the global L2 norm (all-reduced across ranks for FSDP2 shards)
and records ``min(1, max_norm / (norm + 1e-6))`` as a coefficient the next step applies inside the
kernel, tied (weakly) to the gradients it was computed from: new gradients discard it, gradients
modified in place make the step raise. The optimizer's ``clip_grad_norm_`` (its docstring is
``CLIP_GRAD_NORM_DOC``), ``set_clip_coefficient`` and ``pending_clip_coefficient`` delegate here
(the last two are what the GPU-offload path and the checkpoint use); ``Clip.multiplier`` is what
the next host step scales the gradients by.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ..native import adam as native_adam
from . import fallback
from ..base.dist import PARTITION_NORM, global_sumsq, nonfinite_norm, zero_partition
from ..native.rows import get_version

__all__ = ["CLIP_GRAD_NORM_DOC", "Clip", "grad_sumsq"]

# the docstring of offload.Adam/AdamW.clip_grad_norm_ (optim/adam.py), indented as a method's
CLIP_GRAD_NORM_DOC = (
    """Global L2 gradient norm of all parameters, with clipping folded into the next step.

        Like ``torch.nn.utils.clip_grad_norm_`` it returns the total norm, but instead of
        rescaling the gradients in a separate pass it records the coefficient
        ``min(1, max_norm / (norm + 1e-6))`` and the next :meth:`step` applies it inside the Adam
        kernel (one pass over memory instead of three). The gradients themselves are not modified.

        The coefficient belongs to these gradients: ``zero_grad()`` or new gradients (a step that
        GradScaler skipped, a skipped batch) discard it; modifying these gradients in place before
        the step (another backward accumulating into them) makes the step raise, since torch would
        have accumulated onto clipped values. A second call clips what the first call left.
        """)


class Clip:
    """The coefficient the next step applies (``mult``) and the gradients it was computed from."""

    def __init__(self, mult: float = 1.0) -> None:
        self.mult = mult
        # (params, weak refs to their gradients, gradient versions)
        self._record: Optional[tuple] = None
        # built by ZeroRedundancyOptimizer: a partition's norm is no norm
        self.partition = zero_partition()

    def whole_model(self) -> None:
        """Refuse a norm of this optimizer's parameters when they are a ZeroRedundancyOptimizer
        partition."""
        if self.__dict__.get("partition"):
            raise RuntimeError(PARTITION_NORM.format(what="clip_grad_norm_"))

    def forget(self) -> None:
        """Drop the tie to the gradients, keep the coefficient (a param group added, a state
        loaded)."""
        self._record = None

    def coefficient(self) -> float:
        """The clip coefficient left by clip_grad_norm_, if the gradients it was computed from are
        still the ones about to be used; 1.0 if they were replaced (zero_grad/backward: stale)."""
        mult, rec = self.mult, self._record
        if rec is None:
            return mult
        params, refs, vers = rec
        grads = [p.grad for p in params]
        same = [g is not None and g is r() for g, r in zip(grads, refs)]
        if not any(same):  # every gradient is new (or gone): the clipped ones were discarded
            return 1.0
        moved = [i for i, s in enumerate(same) if s and grads[i]._version != vers[i]]
        if moved or not all(same):
            i = moved[0] if moved else same.index(False)
            raise RuntimeError(
                f"the gradient of parameter {i} (in optimizer order) was "
                f"{'modified' if moved else 'replaced'} after clip_grad_norm_, whose coefficient "
                "offload applies inside the next step instead of scaling the gradients in place "
                "(torch would now use clipped + new values): call opt.clip_grad_norm_ after the "
                "last backward of the step, or opt.zero_grad() to discard the pending coefficient")
        return mult

    def multiplier(self, grad_multiplier: Optional[float]) -> float:
        """What the next step scales every gradient by: the coefficient times the step's
        ``grad_multiplier``."""
        mult = self.coefficient() * (1.0 if grad_multiplier is None else float(grad_multiplier))
        if not math.isfinite(mult):
            raise ValueError(f"grad_multiplier must be finite, got {mult}")
        return mult

    def set(self, mult: float, params: list) -> None:
        """Record ``mult`` as the coefficient the next step applies, tied to the current gradients
        of ``params`` (weakly: zero_grad frees them)."""
        self.mult = mult
        if mult != 1.0:
            grads = [p.grad for p in params]
            self._record = (params, list(map(weakref.ref, grads)), list(map(get_version, grads)))
        else:
            self._record = None

    def clear(self) -> None:
        self.set(1.0, [])

    def clip_grad_norm_(self, groups: list, router, threads: int, max_norm: float,
                        norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """The host path of the optimizer's clip_grad_norm_ over ``groups`` (its param_groups),
        split by ``router`` (offload/optim/fallback.py) into the kernel's parameters and those
        torch's code steps."""
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        pending = self.coefficient()
        native, fbg = router.split(groups)
        params = [p for g in native for p in g["params"] if p.grad is not None]
        fbp = list({id(p): p for _, ps in fbg for p in ps
                    # (offload/optim/fallback.py; a repeated parameter counted once)
                    if p.grad is not None}.values())
        grads, fbgrads = [p.grad for p in params], [p.grad for p in fbp]
        sumsq = grad_sumsq(grads, threads) + (fallback.grad_sumsq(fbgrads) if fbgrads else 0.0)
        total = math.sqrt(sumsq) * pending  # the norm of what the step would use
        params, grads = params + fbp, grads + fbgrads
        if error_if_nonfinite and not math.isfinite(total):
            raise nonfinite_norm(total)
        coef = float(max_norm) / (total + 1e-6)
        self.set(pending * coef if coef < 1.0 else pending, params)
        return torch.tensor(total, dtype=torch.float32)


def grad_sumsq(grads: list, threads: int) -> float:
    """Sum of squares of all gradients; for DTensor (FSDP2) shards, all-reduced across ranks."""
    return global_sumsq(grads, lambda gs: native_adam.grad_sumsq(gs, threads))
