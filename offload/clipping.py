"""clipping.py: gradient clipping folded into the next step, a mixin of offload.Adam/AdamW.

``clip_grad_norm_`` computes the global L2 norm (all-reduced across ranks for FSDP2 shards) and
records ``min(1, max_norm / (norm + 1e-6))`` as a coefficient the next step applies inside the
kernel, tied (weakly) to the gradients it was computed from: new gradients discard it, gradients
modified in place make the step raise. ``set_clip_coefficient`` / ``pending_clip_coefficient`` are
the public face the GPU-offload path and the checkpoint use.
"""
from __future__ import annotations

import math
import weakref

import torch

from .native import adam as _kernels
from . import fallback
from .base.dist import global_sumsq, nonfinite_norm
from .native.rows import get_version

__all__ = ["ClippingMixin"]


class ClippingMixin:
    """Needs from the optimizer: ``param_groups``, ``_pending_multiplier``, ``_plans``, ``_router``,
    ``_threads`` and ``_gpu`` (the GPU-offload face, or None)."""

    def _pending_coefficient(self) -> float:
        """The clip coefficient left by clip_grad_norm_, if the gradients it was computed from are
        still the ones about to be used; 1.0 if they were replaced (zero_grad/backward: stale)."""
        mult, rec = self._pending_multiplier, self._plans.get("clip")
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
                f"the gradient of parameter {i} (in optimizer order) was {'modified' if moved else 'replaced'} after "
                "clip_grad_norm_, whose coefficient offload applies inside the next step instead of scaling the "
                "gradients in place (torch would now use clipped + new values): call opt.clip_grad_norm_ after the "
                "last backward of the step, or opt.zero_grad() to discard the pending coefficient")
        return mult

    def _clear_pending(self) -> None:
        self.set_clip_coefficient(1.0, [])

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Global L2 gradient norm of all parameters, with clipping folded into the next step.

        Like ``torch.nn.utils.clip_grad_norm_`` it returns the total norm, but instead of
        rescaling the gradients in a separate pass it records the coefficient
        ``min(1, max_norm / (norm + 1e-6))`` and the next :meth:`step` applies it inside the Adam
        kernel (one pass over memory instead of three). The gradients themselves are not modified.

        The coefficient belongs to these gradients: ``zero_grad()`` or new gradients (a step that
        GradScaler skipped, a skipped batch) discard it; modifying these gradients in place before
        the step (another backward accumulating into them) makes the step raise, since torch would
        have accumulated onto clipped values. A second call clips what the first call left.
        """
        if self._gpu is not None:
            return self._gpu.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        pending = self._pending_coefficient()
        groups, fbg = self._router.split(self.param_groups)
        params = [p for g in groups for p in g["params"] if p.grad is not None]
        fbp = list({id(p): p for _, ps in fbg for p in ps
                    if p.grad is not None}.values())  # (offload/fallback.py; a repeated parameter counted once)
        grads, fbgrads = [p.grad for p in params], [p.grad for p in fbp]
        sumsq = self._grad_sumsq(grads) + (fallback.grad_sumsq(fbgrads) if fbgrads else 0.0)
        total = math.sqrt(sumsq) * pending  # the norm of what the step would use
        params, grads = params + fbp, grads + fbgrads
        if error_if_nonfinite and not math.isfinite(total):
            raise nonfinite_norm(total)
        coef = float(max_norm) / (total + 1e-6)
        self.set_clip_coefficient(pending * coef if coef < 1.0 else pending, params)
        return torch.tensor(total, dtype=torch.float32)

    def pending_clip_coefficient(self) -> float:
        """The coefficient a clip_grad_norm_ left for the next step, if its gradients are still the
        ones about to be used (1.0 if they were replaced; RuntimeError if modified in place)."""
        return self._pending_coefficient()

    def set_clip_coefficient(self, mult: float, params: list) -> None:
        """Record ``mult`` as the coefficient the next step applies, tied to the current gradients of
        ``params`` (weakly: zero_grad frees them), as clip_grad_norm_ does (also the GPU path's)."""
        self._pending_multiplier = mult
        if mult != 1.0:
            grads = [p.grad for p in params]
            self._plans["clip"] = (params, list(map(weakref.ref, grads)), list(map(get_version, grads)))
        else:
            self._plans.pop("clip", None)

    def _grad_sumsq(self, grads: list) -> float:
        """Sum of squares of all gradients; for DTensor (FSDP2) shards, all-reduced across ranks."""
        return global_sumsq(grads, lambda gs: _kernels.grad_sumsq(gs, self._threads or 0))
