"""step/device_step.py: the optimizer face of device parameters whose state lives in a tier (nvme/mmap).

``offload.AdamW(cuda_params, state="nvme")``, two schedules:
  * step during backward (the default without clipping / overflow check): buckets are stepped as
    their gradients arrive, with the state read ahead in the expected backward order
    (step/backward.py);
  * deferred (``max_grad_norm=``, ``check_overflow=True``, ``step_during_backward=False`` or
    ``overlap=False``): backward leaves the gradients on the device; ``step()`` decides the
    multiplier (1/loss scale, clipping coefficient) or the skip from the gradients' norms, then
    streams every bucket D2H -> kernel -> H2D through the staging ring while the state is read
    ahead from NVMe (step/pipeline.py).
Host memory: the tier's slots + the ring, sized from ``host_budget``. This face is the only part
that reads the optimizer (its groups, pending clip coefficient and GradScaler attributes).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Optional

import torch

from .._dist import local

__all__ = ["DeviceStep"]

_UNSUPPORTED = {"small_param_numel": (0,)}


class DeviceStep:
    def __init__(self, opt, engine, device, *, bucket_mb: float = 32.0, overlap: bool = True,
                 step_during_backward=None, max_grad_norm=None, check_overflow: bool = False,
                 release_grads: bool = False, trace: bool = False, small_param_numel: int = 0):
        given = dict(small_param_numel=small_param_numel)
        for k, ok in _UNSUPPORTED.items():
            if given[k] not in ok:
                raise ValueError(f"{k}={given[k]!r} needs state='ram' (with NVMe/mmap state every parameter's "
                                 "state is in the tier)")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if step_during_backward and (max_grad_norm is not None or check_overflow):
            raise ValueError("step_during_backward=True cannot be combined with max_grad_norm or check_overflow: "
                             "both need every gradient before any bucket may be stepped")
        if step_during_backward is None:
            step_during_backward = max_grad_norm is None and not check_overflow
        self.opt = opt
        self.engine = engine
        self.device = device
        self.eager = bool(overlap) and bool(step_during_backward)
        if (release_grads or trace) and not self.eager:
            raise ValueError(f"{'release_grads' if release_grads else 'trace'}=True with state={engine.mode!r} needs "
                             "the step during backward (no max_grad_norm / check_overflow, overlap=True): the "
                             "staging ring cannot hold every gradient until step()")
        self.feed = None
        if self.eager:
            from .backward import BackwardFeed
            self.feed = BackwardFeed(self, engine, device, release_grads=release_grads, trace=trace)
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
        if self.feed is None:
            yield
            return
        prev = self.feed.boundary
        self.feed.boundary = False
        try:
            yield
        finally:
            self.feed.boundary = prev

    def set_accumulation_boundary(self, flag: bool) -> None:
        if self.feed is not None:
            self.feed.boundary = bool(flag)

    def reload_changed(self) -> None:
        """The user wrote parameters (e.g. model.load_state_dict): their masters follow."""
        changed = {k for k, v in self._snapshot().items() if self._versions.get(k) != v}
        if changed:
            self.engine.reload_masters(changed)
        self._versions = self._snapshot()

    # ------------------------------------------------------------------ norms and the step
    def _grads(self) -> list:
        return [p.grad for ps in self.engine.groups for p in ps if p.grad is not None]

    def _sumsq(self) -> float:
        return self.engine.side.grad_sumsq(self._grads(), self.opt.kernel_threads)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        if self.eager:
            raise RuntimeError(
                "offload GPU mode: clip_grad_norm_ needs every gradient before any bucket is stepped, but this "
                "optimizer steps buckets during backward. Construct it with max_grad_norm=... (clipping inside "
                "step()) or step_during_backward=False.")
        opt = self.opt
        pending = opt.pending_clip_coefficient()   # a coefficient left by an earlier call, if still valid
        total = math.sqrt(self._sumsq()) * pending
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total}), so it cannot be clipped")
        coef = float(max_norm) / (total + 1e-6)
        opt.set_clip_coefficient(pending * coef if coef < 1.0 else pending,
                                 [p for ps in self.engine.groups for p in ps if p.grad is not None])
        return torch.tensor(total, dtype=torch.float32)

    def step(self, grad_multiplier: Optional[float]) -> None:
        t0 = time.perf_counter()
        opt = self.opt
        mult = opt.pending_clip_coefficient() * (1.0 if grad_multiplier is None else float(grad_multiplier))
        opt.set_clip_coefficient(1.0, [])   # a step that happens or is skipped uses the clip coefficient up
        gs = getattr(opt, "grad_scale", None)
        found_inf = getattr(opt, "found_inf", None)
        if gs is not None:
            mult /= float(gs)
        if self.feed is not None:
            return self._step_eager(t0, mult, gs, found_inf)
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
            self.engine.step(opt.param_groups, opt.group_hyper, opt.state,
                             mult, opt.kernel_threads, active=active)
            self._versions = self._snapshot()
            stats = self.engine.last_stats
        self._record(t0, s0, stats, mult, skipped=skip, overlapped=False)

    def _step_eager(self, t0: float, mult: float, gs, found_inf) -> None:
        stats = self.feed.step(mult, gs, found_inf)
        s0 = stats["side0"]
        self._versions = self._snapshot()
        self._record(t0, s0, stats, mult, skipped=stats["skipped"], overlapped=True, pipeline_s=stats["pipeline_s"])

    def _record(self, t0: float, s0: dict, stats: dict, mult: float, **extra) -> None:
        """last_step_stats() of the step that began at t0 (s0: the side's counters then)."""
        side = self.engine.side
        side.collect_times()
        self._nsteps += 1
        self._last = dict(step=self._nsteps, d2h_s=side.stats["d2h_s"] - s0["d2h_s"],
                          kernel_s=stats["kernel_s"], h2d_s=side.stats["h2d_s"] - s0["h2d_s"],
                          nvme_s=stats["nvme_s"], exposed_s=time.perf_counter() - t0,
                          d2h_bytes=side.stats["d2h_bytes"] - s0["d2h_bytes"],
                          h2d_bytes=side.stats["h2d_bytes"] - s0["h2d_bytes"], buckets=stats["buckets"],
                          grad_multiplier=mult, complete=True, **extra)

    # ------------------------------------------------------------------ the rest of the GPU face
    def synchronize(self) -> None:
        if self.feed is not None:
            self.feed.synchronize()
        self.engine.side.synchronize()

    def reload_params(self) -> None:
        self.synchronize()
        self.engine.reload_masters({(gi, i) for gi, ps in enumerate(self.engine.groups) for i in range(len(ps))})
        self._versions = self._snapshot()

    def load_state(self) -> None:
        if self.feed is not None:
            self.feed.extend()   # add_param_group: hooks and buckets of the new group
        self._versions = self._snapshot()

    def last_step_stats(self, wait: bool = False) -> Optional[dict]:
        return None if self._last is None else dict(self._last)

    def export_chrome_trace(self, path: str) -> int:
        trace = self.feed.trace if self.feed is not None else None
        if trace is None:
            raise RuntimeError("construct the optimizer with trace=True to record a timeline")
        return trace.export(path)

    @property
    def buckets(self) -> list:
        return self.engine.layout.buckets

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.engine.side.close()
        if self.owns_device:
            self.owns_device = False
            self.device.close()
