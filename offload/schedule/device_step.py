"""schedule/device_step.py: the device schedule of device parameters (GPU offload), state in any
tier.

``offload.AdamW(cuda_params, storage="ram"|"nvme"|"mmap")``, three schedules:
  * step during backward (the default without clipping / overflow check): buckets are stepped as
    their gradients arrive by the CPU worker, with the state read ahead in the expected backward
    order (schedule/backward.py);
  * deferred (``max_grad_norm=``, ``check_overflow=True``, ``step_during_backward=False``):
    backward leaves the gradients on the device; ``step()`` decides the multiplier (1/loss scale,
    clipping coefficient) or the skip from the gradients' norms, then queues every bucket to the
    same worker (D2H -> kernel -> H2D through the staging ring) and returns;
  * ``overlap=False``: all of it inside ``step()`` (engine/pipeline.py), which then synchronizes.
In both overlapped schedules the next forward waits per bucket for the new weights
(schedule/uploads.py); with ``delay_updates=1`` (deferred) for those of the step before
(schedule/delayed.py). Parameters of at most ``small_param_numel`` elements stay on the device,
stepped by torch there (offload/schedule/smallparams.py; nothing in the tier). Host memory: the
tier + the pinned staging ring. This schedule is the only part that reads the optimizer (groups,
clip coefficient, GradScaler attributes).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Optional

import numpy as np
import torch

from ..base.dist import global_sumsq, in_process_group, is_dtensor, local, multi_rank, nonfinite_norm
from ..native.adam import affinity_cpus
from ..params.base import check_device_params
from ..params.fingerprint import fingerprints
from .resident import ResidentAdam, on_device
from .split import effective
from .stepstats import StepStats
from ..base.trace import Trace
from .delayed import DelayedUpdates, prepare
from .uploads import compiled_code_in_use

__all__ = ["DeviceStep"]

log = logging.getLogger("offload")


def _mark(p) -> tuple:
    """What a write to a parameter changes: its version counter (in place) or its data pointer
    (.data = ...)."""
    lp = local(p)
    return (lp._version, lp.data_ptr())


class DeviceStep:
    def __init__(self, port, engine, device, *, bucket_mb: float = 32.0, overlap: bool = True,
                 step_during_backward=None, max_grad_norm=None, check_overflow: bool = False,
                 release_grads: bool = False, trace: bool = False, small_param_numel: int = 0,
                 gpu_state=None, resident: Optional[ResidentAdam] = None, **delay):
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        delay, step_during_backward = prepare(overlap, step_during_backward, small_param_numel,
                                              engine, **delay)
        if step_during_backward and (max_grad_norm is not None or check_overflow):
            raise ValueError("step_during_backward=True cannot be combined with max_grad_norm or check_overflow: "
                             "both need every gradient before any bucket may be stepped")
        if step_during_backward and overlap and multi_rank():
            raise ValueError("step_during_backward=True cannot be used with several "
                             "torch.distributed ranks: a gradient is ready on its rank before DDP "
                             "(or another wrapper) has averaged it across ranks, so the step "
                             "would use this rank's gradient only. Leave step_during_backward "
                             "unset (the default steps after backward when several ranks run)")
        if step_during_backward is None:   # (DDP rewrites gradients after they are ready, even on one rank)
            step_during_backward = max_grad_norm is None and not check_overflow and not in_process_group()
        self.gpu_state = effective(gpu_state, delay is not None, engine.mode)   # (optim/faces.py uses it)
        self.port = port
        self.engine = engine
        self.device = device
        self.overlap = bool(overlap)
        self.eager = self.overlap and bool(step_during_backward)
        self.release_grads = bool(release_grads)
        self.trace = Trace() if trace else None
        engine.side.trace = self.trace
        # stepped on the device: parameters of at most small_param_numel elements
        # (schedule/smallparams.py) and those whose state stays there (schedule/resident.py;
        # gpu_state=: optim/faces.py decides)
        self.resident, self.on_device = on_device(port, engine.excluded, small_param_numel, resident)
        self.feed = None
        if self.overlap:
            from .backward import BackwardFeed
            self.feed = BackwardFeed(self, engine, device, eager=self.eager,
                                     release_grads=release_grads, trace=self.trace)
        self.delayed = None if delay is None else DelayedUpdates(self.feed, engine.side, device, after=delay)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.check_overflow = bool(check_overflow)
        self.owns_device = False
        self.stats = StepStats(engine, self.feed, self.trace)
        self._versions = self._snapshot()
        self._prints = None   # (keys, fingerprints, side.publishes then): see _take_prints
        self._dtensors = None   # any DTensor parameter (FSDP2): known at the first step
        self._warned_compile = False
        self.closed = False

    def kernel_threads(self) -> int:
        """Threads of the CPU kernel: the optimizer's ``threads``, else every CPU of this process
        but the device's ``launch_threads`` (on CUDA two, for the training thread and autograd's
        device thread, which launch GPU work while the kernel runs; 0 means every CPU)."""
        threads = self.port.threads()
        if threads or not self.device.launch_threads:
            return threads
        return max(1, affinity_cpus() - self.device.launch_threads)

    def moved_since_step(self, gi: int, i: int) -> bool:
        """Has parameter (gi, i) been written in place (version) or re-pointed (data pointer) since
        the snapshot of the last step() (False when there is none, e.g. right after a load)?"""
        was = self._versions.get((gi, i))
        return was is not None and _mark(self.engine.groups[gi][i]) != was

    def _snapshot(self) -> dict:
        return {(gi, i): _mark(p) for gi, ps in enumerate(self.engine.groups) for i, p in enumerate(ps)}

    # ------------------------------------------------------------------ writes through p.data
    def _take_prints(self) -> None:
        """Fingerprints of the device parameters with offloaded state, once our last upload landed
        (synchronize): a write through ``p.data`` moves no version counter, and without them the
        next step would overwrite it with round(master) (params/fingerprint.py). Fingerprints still
        current (no upload of ours since) are kept: a second synchronize() (or state_dict(),
        save(), ...) after a write must not make that write look like our own weights."""
        if self._prints is not None and self._prints[2] == self.engine.side.publishes:
            return
        layout = getattr(self.engine, "layout", None)
        laid_out = layout.of_param if layout is not None else {}   # parameters with state here (not frozen, not small)
        keys = [(gi, i) for gi, ps in enumerate(self.engine.groups) for i in range(len(ps)) if laid_out.get((gi, i))]
        ps = [local(self.engine.groups[gi][i]) for gi, i in keys]
        if not ps or len({p.device for p in ps}) != 1:
            self._prints = None
            return
        try:
            self._prints = (keys, fingerprints(ps), self.engine.side.publishes)
        except (RuntimeError, ValueError, TypeError):   # a parameter the sums cannot read: its version still counts
            self._prints = None

    def _written(self) -> set:
        """(gi, i) of the parameters whose bytes changed since the fingerprints, if those are still
        current (no upload of ours since); the fingerprints are used up either way."""
        prints, self._prints = self._prints, None
        if prints is None:
            return set()
        keys, before, at = prints
        if at != self.engine.side.publishes:
            return set()
        try:
            now = fingerprints([local(self.engine.groups[gi][i]) for gi, i in keys])
        except (IndexError, RuntimeError, ValueError, TypeError):   # a parameter gone or moved (.data = other device)
            return set()
        if now.shape != before.shape or now.device != before.device:
            return set()
        differs = torch.ne(now, before).cpu()   # one host sync
        return {k for k, d in zip(keys, differs.tolist()) if d}

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

    def check_params(self) -> None:
        """Before anything reads or writes the parameters (masters re-read, new weights
        uploaded): every one with state here still has the dtype, size and contiguous memory its
        state and staging are laid out for (a model cast after the optimizer was built is
        refused, by name)."""
        eng = self.engine
        check_device_params(eng.groups, eng.registry.ready, eng.dtypes, eng.numels, eng.mode)

    def check_open(self) -> None:
        """RuntimeError once close() ran: the worker, the hooks and the state are gone."""
        if self.closed:
            raise RuntimeError(
                "offload: the optimizer was closed: close() stopped its CPU worker, removed its "
                "hooks and released its state, so it no longer steps, synchronizes, saves or "
                "loads. Build a new optimizer to train on (and load into it a state_dict() or "
                "offload.save checkpoint taken before close())")

    def reload_changed(self) -> None:
        """The user wrote parameters (e.g. model.load_state_dict, p.data.mul_ after synchronize()):
        their masters follow (refused while a delay_updates=1 update is pending: delayed.py)."""
        snap = self._snapshot()
        changed = {k for k, v in snap.items() if self._versions.get(k) != v} | self._written()
        if changed and (self.delayed is None or self.delayed.adoptable(changed)):
            self.engine.reload_masters(changed)
        self._versions = snap   # (reloading reads the parameters, it does not write them)

    # ------------------------------------------------------------------ norms and the step
    def _grads(self) -> list:
        return [p.grad for ps in self.engine.groups for p in ps if p.grad is not None]

    def _sumsq(self) -> float:
        """The squared global gradient norm: over every rank's shard for FSDP2 (DTensor) parameters."""
        side, threads = self.engine.side, self.kernel_threads()
        return global_sumsq(self._grads(), lambda gs: side.grad_sumsq(gs, threads))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        self.check_open()
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        if self.eager:
            raise RuntimeError(
                "offload GPU mode: clip_grad_norm_ needs every gradient before any bucket is "
                "stepped, but this optimizer steps buckets during backward. Construct it with "
                "max_grad_norm=... (clipping inside step()) or step_during_backward=False.")
        port = self.port
        pending = port.pending()   # a coefficient left by an earlier call, if still valid
        total = math.sqrt(self._sumsq()) * pending
        if error_if_nonfinite and not math.isfinite(total):
            raise nonfinite_norm(total)
        coef = float(max_norm) / (total + 1e-6)
        port.set_pending(pending * coef if coef < 1.0 else pending,
                         [p for ps in self.engine.groups for p in ps if p.grad is not None])
        return torch.tensor(total, dtype=torch.float32)

    def step(self, grad_multiplier: Optional[float]) -> None:
        t0 = time.perf_counter()
        self.check_open()
        (self.feed or self.engine.tier).check_usable()   # failed: refused before any check, any small parameter
        mult = self.port.pending() * (1.0 if grad_multiplier is None else float(grad_multiplier))
        self._step(t0, mult)
        self.port.set_pending(1.0, [])   # used up by a step that ran or was skipped; one that raised keeps it

    def _step(self, t0: float, mult: float) -> None:
        port = self.port
        if self.feed is None:   # (the overlapped schedules: when the step's cycle begins)
            self.check_params()
        if self.on_device:   # stepped first: every group's hyperparameters are checked before that
            for gi in range(len(port.groups())):
                port.hyper(gi)
        gs, found_inf = port.amp()
        if gs is not None:
            mult /= float(gs)
        if self.feed is not None and self.eager:
            return self._queued(t0, self.feed.step(mult, gs, found_inf, before=self._on_device_step(mult)), mult)
        skip = found_inf is not None and float(found_inf) > 0
        if self.feed is None:
            active = self.engine.collect(port.groups(), state=port.state())   # checks first
        # (GradScaler checked for inf/NaN already when it hands found_inf over: no second pass for that)
        if not skip and (self.max_grad_norm is not None or (self.check_overflow and found_inf is None)):
            total = self._sumsq()
            if self.check_overflow and not math.isfinite(total):
                skip = True
            if self.max_grad_norm is not None and not skip:
                coef = self.max_grad_norm / (math.sqrt(total) * abs(mult) + 1e-6)
                if coef < 1.0:
                    mult *= coef
        if self.feed is not None:
            step = self.feed.step if self.delayed is None else self.delayed.wrap(self.feed.step)
            return self._queued(t0, step(mult, gs, found_inf, skip=skip, before=self._on_device_step(mult)), mult)
        if not math.isfinite(mult) and not skip:
            raise ValueError(f"grad_multiplier must be finite, got {mult}")
        for gi, i in self.engine.excluded:   # (small parameters, state on the device: stepped there)
            active[gi][i] = False
        side = self.engine.side
        s0 = dict(side.stats)
        stats = dict(kernel_s=0.0, nvme_s=0.0, buckets=0)
        if not skip:
            self.engine.adopt(port.state())   # opt.state's edits taken and checked first
            self._on_device_step(mult)()
            self.reload_changed()   # the user wrote parameters (e.g. model.load_state_dict): masters follow
            self.engine.step(port.groups(), port.hyper, port.state(),
                             mult, self.kernel_threads(), active=active)
            self._versions = self._snapshot()
            stats = self.engine.last_stats
            if self.release_grads:
                for gi, a in enumerate(active):
                    for i in np.flatnonzero(a):
                        self.engine.groups[gi][i].grad = None
        self.synchronize()
        self.stats.record(t0, s0, stats, mult, skipped=skip, overlapped=False, done=True)

    def _on_device_step(self, mult: float):
        def run():
            if self.on_device:
                self.on_device.step(mult)
        return run

    def _queued(self, t0: float, rec: dict, mult: float) -> None:
        self._versions = self._snapshot()
        if self.engine.holds_moment_copies():
            # a caller holds decoded compressed moments (moments/handouts.py): they are refreshed
            # when the step's last bucket is done; waiting for it here keeps that refresh from
            # racing with the caller's next write into them (the step is then not overlapped with
            # the next forward)
            self.feed.wait_idle()
        compiled = compiled_code_in_use()
        if compiled or self._shared_weights():
            # a compiled forward would not wait for its buckets (schedule/uploads.py); collectives read the
            # weights on streams that are ordered only after the current one (FSDP2's all-gathers,
            # ZeroRedundancyOptimizer's broadcast right after step()): every upload first
            if compiled and not self._warned_compile:
                self._warned_compile = True
                log.info("torch.compile has compiled code in this process: step() waits for every "
                         "upload, so the next forward does not overlap the rest of the CPU step "
                         "(docs/gpu.md, Limits)")
            self.feed.uploads.wait_all()
            rec["waited_all"] = True
        self.stats.record(t0, rec["side0"], rec, mult, overlapped=True)

    def _shared_weights(self) -> bool:
        """Are the weights read by collectives after step()? (FSDP2 shards, or several ranks.)"""
        if self._dtensors is None:
            self._dtensors = any(is_dtensor(p) for ps in self.engine.groups for p in ps)
        return self._dtensors or multi_rank()

    # ------------------------------------------------------------------ the rest of the schedule
    def synchronize(self) -> None:
        self.check_open()
        if self.feed is not None:
            (self.delayed or self.feed).synchronize()   # delay_updates: completes the pending update
        self.engine.side.synchronize()
        self._take_prints()   # the weights are final until our next upload: see _written

    def reload_params(self) -> None:
        self.synchronize()
        self.check_params()
        self.engine.reload_masters({(gi, i) for gi, ps in enumerate(self.engine.groups) for i in range(len(ps))})
        self._versions = self._snapshot()

    def quiesce(self) -> None:
        """Before the engine changes shape (add_param_group): the worker idle, every upload landed,
        and what the user wrote into parameters since the last step adopted (masters follow), since
        load_state() below starts the write tracking afresh."""
        self.check_open()
        if self.feed is not None:
            (self.delayed or self.feed).synchronize()
        self.engine.side.synchronize()
        self.check_params()
        self.reload_changed()
        self._take_prints()   # (consumed above) a write after a failed add_param_group is still seen

    def load_state(self, loaded: bool = False) -> None:
        """After add_param_group / load_state_dict: the write tracking starts from the weights as
        they are now (versions and fingerprints), so that a write after this call is still seen.
        ``loaded`` (load_state_dict): at the next step every parameter is compared with round(its
        loaded master) and taken where it differs, as the host kernel does at each step: a write
        made before the load is kept, and the usual resume (model.load_state_dict of the same
        checkpoint, before or after) changes nothing. Not at load time: the parameters may be
        loaded after the optimizer."""
        if self.feed is not None:
            self.feed.extend()   # add_param_group: hooks and buckets of the new group
            if loaded:
                (self.delayed or self.feed).recover()   # a worker failure is cleared by the load, as the tier's is
        if self.on_device:
            self.on_device.load()
        self._versions = {} if loaded else self._snapshot()   # {}: every parameter counts as changed
        self._prints = None
        self._dtensors = None   # (a group of DTensors may have been added)
        self._take_prints()

    def last_step_stats(self, wait: bool = False) -> Optional[dict]:
        """Timing of the latest step whose weights are back on the device (``wait=True``: finish
        the latest step first; after close() there is nothing left to finish)."""
        if wait and not self.closed:
            self.synchronize()
        self.stats.settle()
        return None if self.stats.last is None else dict(self.stats.last)

    def export_chrome_trace(self, path: str) -> int:
        trace = self.trace
        if trace is None:
            raise RuntimeError("construct the optimizer with trace=True to record a timeline")
        self.engine.side.collect_times()
        return trace.export(path)

    def zero_grad(self, set_to_none: bool) -> None:
        """Before the optimizer's zero_grad: buckets stepped during a backward whose step the
        gradients were for are given up (the optimizer fails, schedule/backward.py); zeroing in
        place first waits for the last step's copies of the gradients (none after close())."""
        if self.feed is not None and not self.closed:
            self.feed.discard()
        if not set_to_none and not self.closed:
            self.synchronize()

    def close(self) -> None:
        self.closed = True
        if self.feed is not None:
            self.feed.close()
        self.engine.side.close()
        if self.owns_device:
            self.owns_device = False
            self.device.close()
