"""step/device_step.py: the optimizer face of device parameters whose state lives in a tier (nvme/mmap).

``offload.AdamW(cuda_params, state="nvme")``: backward leaves the gradients on the device; ``step()``
decides the multiplier (1/loss scale, clipping coefficient) or the skip (GradScaler / check_overflow)
from the gradients' norms, then streams every bucket D2H -> kernel -> H2D through the staging ring
while the state is read ahead from NVMe (step/pipeline.py). Host memory: the tier's slots + the
ring, sized from ``host_budget``. This face is the only part that reads the optimizer (its groups,
pending clip coefficient and GradScaler attributes), like offload/pipeline.py does for RAM state.
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from typing import Optional

import torch

from .._dist import local

__all__ = ["DeviceStep"]

_UNSUPPORTED = {"step_during_backward": (None, False), "release_grads": (False,), "trace": (False,),
                "small_param_numel": (0,)}


class DeviceStep:
    def __init__(self, opt, engine, device, *, bucket_mb: float = 32.0, overlap: bool = True,
                 step_during_backward=None, max_grad_norm=None, check_overflow: bool = False,
                 release_grads: bool = False, trace: bool = False, small_param_numel: int = 0):
        given = dict(step_during_backward=step_during_backward, release_grads=release_grads, trace=trace,
                     small_param_numel=small_param_numel)
        for k, ok in _UNSUPPORTED.items():
            if given[k] not in ok:
                raise ValueError(f"{k}={given[k]!r} needs state='ram' (with NVMe/mmap state, step() streams "
                                 "every bucket D2H -> kernel -> H2D after backward)")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self.opt = opt
        self.engine = engine
        self.device = device
        self.eager = False
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.check_overflow = bool(check_overflow)
        self.owns_device = False
        self._nsteps = 0
        self._last: Optional[dict] = None
        self._versions = self._snapshot()

    def _snapshot(self) -> dict:
        return {(gi, i): (local(p)._version, local(p).data_ptr())
                for gi, ps in enumerate(self.engine.groups) for i, p in enumerate(ps)}

    # ------------------------------------------------------------------ accumulation (nothing moves in backward)
    @contextlib.contextmanager
    def no_sync(self):
        yield

    def set_accumulation_boundary(self, flag: bool) -> None:
        pass

    # ------------------------------------------------------------------ norms and the step
    def _grads(self) -> list:
        return [p.grad for ps in self.engine.groups for p in ps if p.grad is not None]

    def _sumsq(self) -> float:
        return self.engine.side.grad_sumsq(self._grads(), self.opt._threads or 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        opt = self.opt
        pending = opt._pending_coefficient()   # a coefficient left by an earlier call, if still valid
        total = math.sqrt(self._sumsq()) * pending
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total}), so it cannot be clipped")
        coef = float(max_norm) / (total + 1e-6)
        opt._pending_multiplier = pending * coef if coef < 1.0 else pending
        if opt._pending_multiplier != 1.0:   # tied to these gradients, as in optim.clip_grad_norm_
            from .._plan import get_version
            params = [p for ps in self.engine.groups for p in ps if p.grad is not None]
            grads = [p.grad for p in params]
            opt._plans["clip"] = (params, list(map(weakref.ref, grads)), list(map(get_version, grads)))
        else:
            opt._plans.pop("clip", None)
        return torch.tensor(total, dtype=torch.float32)

    def step(self, grad_multiplier: Optional[float]) -> None:
        t0 = time.perf_counter()
        opt = self.opt
        mult = opt._pending_coefficient() * (1.0 if grad_multiplier is None else float(grad_multiplier))
        opt._clear_pending()   # a step that happens or is skipped uses the clip coefficient up
        gs = getattr(opt, "grad_scale", None)
        found_inf = getattr(opt, "found_inf", None)
        if gs is not None:
            mult /= float(gs)
        active = self.engine._collect(opt.param_groups)   # validation first: nothing changes on error
        skip = found_inf is not None and float(found_inf) > 0
        if not skip and (self.max_grad_norm is not None or self.check_overflow):
            total = self._sumsq()
            if self.check_overflow and not math.isfinite(total):
                skip = True
            if self.max_grad_norm is not None and not skip:
                coef = self.max_grad_norm / (math.sqrt(total) * abs(mult) + 1e-6)
                if coef < 1.0:
                    mult *= coef
        if not math.isfinite(mult) and not skip:
            raise ValueError(f"grad_multiplier must be finite, got {mult}")
        side = self.engine.side
        s0 = dict(side.stats)
        stats = dict(kernel_s=0.0, nvme_s=0.0, buckets=0)
        if not skip:
            changed = {k for k, v in self._snapshot().items() if self._versions.get(k) != v}
            if changed:   # the user wrote parameters (e.g. model.load_state_dict): masters follow
                self.engine.reload_masters(changed)
            self.engine.step(opt.param_groups, lambda gi: opt._group_hyper(opt.param_groups[gi]), opt.state,
                             mult, opt._threads or 0, active=active)
            self._versions = self._snapshot()
            stats = self.engine.last_stats
        side.collect_times()
        self._nsteps += 1
        dt = time.perf_counter() - t0
        self._last = dict(step=self._nsteps, d2h_s=side.stats["d2h_s"] - s0["d2h_s"],
                          kernel_s=stats["kernel_s"], h2d_s=side.stats["h2d_s"] - s0["h2d_s"],
                          nvme_s=stats["nvme_s"], exposed_s=dt,
                          d2h_bytes=side.stats["d2h_bytes"] - s0["d2h_bytes"],
                          h2d_bytes=side.stats["h2d_bytes"] - s0["h2d_bytes"], buckets=stats["buckets"],
                          skipped=skip, grad_multiplier=mult, overlapped=False, complete=True)

    # ------------------------------------------------------------------ the rest of the GPU face
    def synchronize(self) -> None:
        self.engine.side.synchronize()

    def reload_params(self) -> None:
        self.synchronize()
        self.engine.reload_masters({(gi, i) for gi, ps in enumerate(self.engine.groups) for i in range(len(ps))})
        self._versions = self._snapshot()

    def load_state(self) -> None:
        self._versions = self._snapshot()

    def last_step_stats(self, wait: bool = False) -> Optional[dict]:
        return None if self._last is None else dict(self._last)

    def export_chrome_trace(self, path: str) -> int:
        raise RuntimeError("trace=True needs state='ram'")

    @property
    def buckets(self) -> list:
        return self.engine.layout.buckets

    def close(self) -> None:
        self.engine.side.close()
        if self.owns_device:
            self.owns_device = False
            self.device.close()
