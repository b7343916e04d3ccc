"""pipeline.py: the GPU-offload scheduler behind ``offload.AdamW`` when parameters live on a GPU.

Parameters stay on the device; fp32 master weights and Adam moments live per bucket in host
arenas (offload/buckets.py). One training iteration, in overlapped mode:

  backward   a post-accumulate-grad hook marks each parameter ready; when a bucket is complete
             its gradients are copied down on the D2H stream (after an event on the compute
             stream), together with the bucket's squared norm computed on the device.
             Eager mode (no clipping / overflow check configured): the bucket is queued to the
             CPU worker, which steps it as soon as its copy event fired, while backward goes on.
  step()     flushes buckets that never completed (parameters without gradient this time, or
             gradients changed after their copy), decides the grad multiplier (1/loss scale,
             clipping coefficient - from the per-bucket norms, only scalars cross) or skips the
             step (non-finite gradients with an overflow check), queues the remaining CPU steps
             and the uploads in forward order, and returns without synchronizing the device.
  worker     steps a bucket (native kernel, GIL released), the kernel writing the new weights in
             the parameter dtype straight into the bucket's upload staging; then issues the H2D
             copy of that bucket on the H2D stream.
  forward    a forward pre-hook makes the compute stream wait only for the bucket (in upload
             order) that the module about to run needs.

Non-overlapped mode (``overlap=False``) does all of it inside ``step()`` and synchronizes.
All transfers go through an ``offload.device.Device``; nothing here touches CUDA directly.
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ._kernels import step_table
from .buckets import Bucket, Slot, build_buckets
from .device import Device, Event
from .smallparams import DeviceSideAdam
from .telemetry import StepStats, Trace

__all__ = ["GpuOffloadEngine", "GPU_OPTIONS"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
GPU_OPTIONS = ("bucket_mb", "overlap", "step_during_backward", "max_grad_norm", "check_overflow",
               "release_grads", "trace", "small_param_numel")
_HOST_WAIT_S = 300.0  # a hang is a bug: fail loudly instead


class _WorkerError(RuntimeError):
    pass


def _weak_hook(engine: "GpuOffloadEngine", method: str, *bound):
    """A hook that reaches the engine through a weak reference. Tensor hooks are held from C++,
    where the garbage collector cannot see them: a strong reference would keep the engine, its
    host arenas and its threads alive forever."""
    ref = weakref.ref(engine)

    def hook(*args):
        eng = ref()
        if eng is not None:
            getattr(eng, method)(*bound, *args)
        # a tensor hook returning None leaves the gradient unchanged
    return hook


def _worker_loop(engine_ref, jobs: "queue.Queue") -> None:
    """The CPU worker: runs the engine's jobs in order until told to stop or the engine is gone."""
    while True:
        job = jobs.get()
        if job is None:
            return
        engine = engine_ref()
        if engine is None:
            return
        engine._run_job(job)
        del engine


class GpuOffloadEngine:
    """Owns buckets, hooks, the CPU worker and the per-step bookkeeping of one optimizer."""

    def __init__(self, opt, device: Device, *, bucket_mb: float = 32.0, overlap: bool = True,
                 step_during_backward: Optional[bool] = None, max_grad_norm: Optional[float] = None,
                 check_overflow: bool = False, release_grads: bool = False, trace: bool = False,
                 small_param_numel: int = 0):
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if not (isinstance(small_param_numel, int) and small_param_numel >= 0):
            raise ValueError(f"small_param_numel must be an int >= 0, got {small_param_numel!r}")
        if step_during_backward and (max_grad_norm is not None or check_overflow):
            raise ValueError("step_during_backward=True cannot be combined with max_grad_norm or check_overflow: "
                             "both need every gradient before any bucket may be stepped")
        self.opt = opt
        self.device = device
        self.overlap = bool(overlap)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.check_overflow = bool(check_overflow)
        self.release_grads = bool(release_grads)
        if step_during_backward is None:
            step_during_backward = max_grad_norm is None and not check_overflow
        self.eager = self.overlap and bool(step_during_backward)
        # parameters of at most small_param_numel elements stay on the device (offload/smallparams.py)
        groups = [[p for p in g["params"] if p.numel() > small_param_numel] for g in opt.param_groups]
        self.small = DeviceSideAdam(opt, {gi: [p for p in g["params"] if p.numel() <= small_param_numel]
                                          for gi, g in enumerate(opt.param_groups)},
                                    opt.group_hyper(0)["decoupled"])
        self.buckets: List[Bucket] = build_buckets(groups, int(bucket_mb * 2 ** 20), device,
                                                   [bool(g["amsgrad"]) for g in opt.param_groups])
        self.slot_of: Dict[int, Slot] = {id(s.param): s for b in self.buckets for s in b.slots}
        for b in self.buckets:
            b.rank = b.index                 # upload order; refined from the first forward
            b.step_done = threading.Event()  # CPU step of the latest queued cycle finished
            b.step_done.set()
            b.h2d_issued = threading.Event()
            b.h2d_issued.set()
            b.h2d_ev: Optional[Event] = None
            b.last_d2h_ev: Optional[Event] = None   # survives cycle resets
            b.norm_buf = device.host_empty(2 * len(b.slots), torch.float32)
            b.pver = [None] * len(b.slots)   # (version, data_ptr) of each parameter its master matches
        self.stats = StepStats(overlapped=self.overlap)
        self._reset_cycle()
        self._init_masters()
        self._last_stats: Optional[StepStats] = None
        self.trace = Trace() if trace else None
        self._nsteps = 0
        self._boundary = True
        self._upload_seq: List[Bucket] = []
        self._wait_ptr = 0
        self._fwd_handle = None
        self._error: Optional[BaseException] = None
        self._hooks = []
        self._events: list = []           # (kind, bucket, event, stats) whose time is not counted yet
        self._ev_lock = threading.Lock()
        self._done_stats: List[StepStats] = []
        self._seq_stats: Optional[StepStats] = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._worker = None
        if self.overlap:
            for s in self.slot_of.values():
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    _weak_hook(self, "_on_grad_ready", s.bucket.index, s.pos)))
                self._hooks.append(s.param.register_hook(
                    _weak_hook(self, "_before_accumulate", s.bucket.index, s.pos)))
            self._order_seen: Dict[int, int] = {}
            self._order_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                _weak_hook(self, "_observe_order"))
            # the thread holds only a weak reference, so an engine nobody uses any more is collected
            self._worker = threading.Thread(target=_worker_loop, args=(weakref.ref(self), self._jobs),
                                            name="offload-cpu-step", daemon=True)
            self._worker.start()
            self._finalizer = weakref.finalize(self, self._jobs.put, None)

    # ================================================================== setup / state
    def _init_masters(self, slots: Optional[Sequence[Slot]] = None) -> None:
        """Read fp32 masters from the device parameters; remember which parameter version they match.

        Our own uploads write through ``param.data`` and leave the version counter alone, so a
        changed version (or storage) later means the user wrote the parameter (e.g.
        ``model.load_state_dict`` after the optimizer was built): the master is then re-read.
        """
        if slots is None:
            slots = [s for b in self.buckets for s in b.slots]
        after = self.device.record()   # whatever wrote the parameters on the compute stream comes first
        evs = [self.device.copy_to_host([(s.bucket.master_view(s), s.param.detach())], after) for s in slots]
        for s in slots:
            s.bucket.pver[s.pos] = (s.param._version, s.param.data_ptr())
        for ev in evs:
            ev.synchronize()
        self.device.check()

    def _refresh_changed_masters(self, b: Bucket, positions: Sequence[int]) -> None:
        changed = [b.slots[i] for i in positions
                   if b.pver[i] != (b.slots[i].param._version, b.slots[i].param.data_ptr())]
        if changed:
            self._init_masters(changed)

    def _register_state(self, s: Slot) -> None:
        b = s.bucket
        st = self.opt.state[s.param]
        st["step"] = b.steps[s.pos]
        st["exp_avg"] = b.view(b.exp_avg, s)
        st["exp_avg_sq"] = b.view(b.exp_avg_sq, s)
        if b.max_exp_avg_sq is not None:
            st["max_exp_avg_sq"] = b.view(b.max_exp_avg_sq, s)
        if s.dtype in _LOW_PRECISION:
            st["master_param"] = b.master_view(s)

    def load_state(self) -> None:
        """After ``load_state_dict``: copy loaded tensors into the arenas and re-point the state."""
        self.synchronize()
        for b in self.buckets:
            for s in b.slots:
                st = self.opt.state.get(s.param)
                if not st:
                    b.steps[s.pos] = 0.0
                    for arena in (b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq):
                        if arena is not None:
                            b.view(arena, s).zero_()
                    self._init_masters([s])
                    self.opt.state.pop(s.param, None)
                    continue
                step = st.get("step", 0.0)
                b.steps[s.pos] = float(step.item() if isinstance(step, torch.Tensor) else step)
                b.view(b.exp_avg, s).copy_(st["exp_avg"])
                b.view(b.exp_avg_sq, s).copy_(st["exp_avg_sq"])
                if b.max_exp_avg_sq is not None:
                    src = st.get("max_exp_avg_sq")
                    b.view(b.max_exp_avg_sq, s).copy_(src if src is not None else torch.zeros(()))
                if "master_param" in st:
                    b.master_view(s).copy_(st["master_param"])
                    b.pver[s.pos] = (s.param._version, s.param.data_ptr())
                else:
                    self._init_masters([s])
                self._register_state(s)
        if self.small:
            self.small.load()

    def reload_params(self) -> None:
        """Re-read master weights from the device parameters (after changing them in place)."""
        self.synchronize()
        self._init_masters()

    # ================================================================== accumulation API
    def set_accumulation_boundary(self, flag: bool) -> None:
        self._boundary = bool(flag)

    @contextlib.contextmanager
    def no_sync(self):
        prev = self._boundary
        self._boundary = False
        try:
            yield
        finally:
            self._boundary = prev

    # ================================================================== cycle bookkeeping
    def _reset_cycle(self) -> None:
        for b in self.buckets:
            b.ready = set()
            b.copied: Dict[int, tuple] = {}   # pos -> (grad object or None, version)
            b.d2h_ev = None
            b.queued = False
            b.norm_parts = []                 # [(positions, offset)] into norm_buf
            b.cycle_d2h = []                  # this cycle's D2H events of the bucket
            b.norm_cursor = 0
        self._in_cycle = False

    def _begin_cycle(self) -> None:
        if self._in_cycle:
            return
        self._await_uploads(None)
        self._in_cycle = True

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise _WorkerError(f"offload CPU worker failed: {err!r}") from err

    def _blocked(self, seconds: float, stats: Optional[StepStats] = None) -> None:
        (stats or self.stats).add(exposed_s=seconds)

    # ================================================================== backward: D2H
    def _on_grad_ready(self, bi: int, pos: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of the parameter at ``pos`` of bucket ``bi``."""
        if not self._boundary:
            return
        self._raise_if_failed()
        self._begin_cycle()
        b = self.buckets[bi]
        if pos in b.ready or pos in b.copied:
            self._second_backward(b)
        b.ready.add(pos)
        if len(b.ready) == len(b.slots):
            self._launch(b, sorted(b.ready))
            if self.eager:
                self._queue_step(b, self.opt.group_hyper(b.group), 1.0)

    def _before_accumulate(self, bi: int, pos: int, grad: torch.Tensor) -> None:
        # a gradient is about to be accumulated into p.grad while an earlier copy of it may still
        # be in flight (a second backward before step()): the compute stream waits for that copy
        ev = self.buckets[bi].last_d2h_ev
        if ev is not None and not ev.query():
            self._blocked(self.device.wait(ev))

    def _second_backward(self, b: Bucket) -> None:
        if any(x.queued for x in self.buckets) or self.eager and any(x.copied for x in self.buckets):
            raise RuntimeError(
                "offload: a second backward reached parameters whose gradients were already sent to the CPU "
                "and stepped (step_during_backward mode). For gradient accumulation wrap the earlier backward "
                "passes in `with optimizer.no_sync():` (or call optimizer.set_accumulation_boundary(False)).")
        if self.release_grads and any(x.copied for x in self.buckets):
            raise RuntimeError(
                "offload: with release_grads=True a second backward before step() would lose the released "
                "gradients; wrap the earlier backward passes in `with optimizer.no_sync():`")
        self._reset_cycle()   # previous copies are stale: the gradients are accumulating again
        self._in_cycle = True

    def _launch(self, b: Bucket, positions: Sequence[int]) -> None:
        """Copy the gradients of ``positions`` down, with their squared norms (computed on the device)."""
        if not b.step_done.is_set():   # the previous CPU step still reads this bucket's staging
            t0 = time.perf_counter()
            self._wait_host(b.step_done, "CPU step")
            self._blocked(time.perf_counter() - t0)
        slots = [b.slots[i] for i in positions]
        grads = []
        for s in slots:
            g = s.param.grad
            if g.shape != s.param.shape or g.dtype != s.dtype:
                raise RuntimeError(f"gradient of parameter {s.index} of group {s.group} has shape {tuple(g.shape)} "
                                   f"and dtype {g.dtype}; expected {tuple(s.param.shape)} and {s.dtype}")
            grads.append(g if g.is_contiguous() else g.contiguous())
        k = len(positions)
        if b.norm_cursor + k > b.norm_buf.numel():   # re-sent more often than planned: grow (rare)
            if b.d2h_ev is not None:
                b.d2h_ev.synchronize()
            old = b.norm_buf
            b.norm_buf = self.device.host_empty(2 * (b.norm_cursor + k), torch.float32)
            b.norm_buf[:b.norm_cursor].copy_(old[:b.norm_cursor])
        pairs = [(b.grad_view(s), g) for s, g in zip(slots, grads)]
        if not self.eager:   # squared norms for clipping / overflow: computed on the device, k scalars cross
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)   # fp32 even for bf16/fp16 grads
            sq = torch.stack(norms).square()
            off = b.norm_cursor
            b.norm_parts.append((list(positions), off))
            b.norm_cursor += k
            pairs.append((b.norm_buf[off:off + k], sq))
        after = self.device.record()
        ev = self.device.copy_to_host(pairs, after)
        b.d2h_ev = b.last_d2h_ev = ev
        b.cycle_d2h.append(ev)
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        self.stats.add(d2h_bytes=nbytes)
        with self._ev_lock:
            self._events.append(("d2h", b, ev, self.stats))
        for s, g in zip(slots, grads):
            b.copied[s.pos] = (None if self.release_grads else s.param.grad, s.param.grad._version)
            if self.release_grads:
                s.param.grad = None

    # ================================================================== CPU worker
    def _queue_step(self, b: Bucket, hyper: dict, mult: float) -> None:
        positions = sorted(b.copied)
        if not positions:
            return
        self._refresh_changed_masters(b, positions)
        for i in positions:
            s = b.slots[i]
            if s.param not in self.opt.state or "exp_avg" not in self.opt.state[s.param]:
                self._register_state(s)
        b.queued = True
        b.step_done.clear()
        if self.overlap:
            self._jobs.put(("step", b, positions, hyper, mult, b.d2h_ev, self.stats))
        else:
            self._run_step(b, positions, hyper, mult, b.d2h_ev, self.stats)

    def _run_step(self, b: Bucket, positions, hyper, mult, d2h_ev, stats: StepStats) -> None:
        try:
            d2h_ev.synchronize()
            if b.h2d_ev is not None:     # the previous upload may still read the staging we write
                b.h2d_ev.synchronize()
            table = b.task_table(positions)
            t0 = time.perf_counter()
            step_table(table, hyper, mult, self.opt.kernel_threads)
            t1 = time.perf_counter()
            idx = np.asarray(positions, dtype=np.int64)
            b.steps.numpy()[idx] += 1
            stats.add(kernel_s=t1 - t0, buckets=1)
            if self.trace is not None:
                self.trace.span(f"adam b{b.index}", "cpu step", (t0, t1))
        finally:
            b.step_done.set()

    def _run_upload(self, b: Bucket, positions, after: Event, stats: StepStats) -> None:
        try:
            # through .data: our own write must not look like a user's write (version counter)
            pairs = [(b.slots[i].param.data, b.out_view(b.slots[i])) for i in positions]
            b.h2d_ev = self.device.copy_to_device(pairs, after)
            stats.add(h2d_bytes=sum(d.numel() * d.element_size() for d, _ in pairs))
            with self._ev_lock:
                self._events.append(("h2d", b, b.h2d_ev, stats))
        finally:
            b.h2d_issued.set()

    def _run_job(self, job: tuple) -> None:
        try:
            if self._error is not None:
                raise RuntimeError("skipped after an earlier failure")
            if job[0] == "step":
                self._run_step(*job[1:])
            elif job[0] == "upload":
                self._run_upload(*job[1:])
            elif job[0] == "barrier":
                job[1].set()
        except BaseException as e:  # surfaced on the training thread; nobody may wait forever
            if self._error is None:
                self._error = e
            if job[0] == "barrier":
                job[1].set()
            elif job[0] == "step":
                job[1].step_done.set()
            elif job[0] == "upload":
                job[1].h2d_issued.set()

    def _wait_host(self, ev: threading.Event, what: str) -> None:
        if not ev.wait(_HOST_WAIT_S):
            self._raise_if_failed()
            raise TimeoutError(f"offload: {what} did not finish within {_HOST_WAIT_S} s")
        self._raise_if_failed()

    # ================================================================== step
    def _flush(self) -> None:
        """Copy every gradient not sent yet (or changed since it was sent)."""
        gs = getattr(self.opt, "grad_scale", None)
        unscaled_in_place = hasattr(self.opt, "found_inf") and gs is None
        for b in self.buckets:
            todo = []
            for s in b.slots:
                g = s.param.grad
                if g is None:
                    continue
                prev = b.copied.get(s.pos)
                if prev is None or unscaled_in_place or prev[0] is not g or prev[1] != g._version:
                    todo.append(s.pos)
            if not todo:
                continue
            if b.queued:
                raise RuntimeError(
                    "offload: gradients changed after they were sent to the CPU and stepped during backward "
                    "(e.g. torch.nn.utils.clip_grad_norm_ or GradScaler.unscale_ on the device gradients). "
                    "Use optimizer.clip_grad_norm_ / max_grad_norm= and check_overflow=True (which turn off "
                    "stepping during backward), or pass step_during_backward=False.")
            if any(i in b.copied for i in todo):
                # a gradient changed after it was sent: send the whole bucket again (norms too) and
                # never use the earlier copies
                if any(b.slots[i].param.grad is None for i in b.copied):
                    raise RuntimeError("offload: a gradient changed after it was sent and released "
                                       "(release_grads=True); it cannot be sent again")
                todo = sorted(set(todo) | set(b.copied))
                for ev in b.cycle_d2h:
                    self.device.discard(ev)
                b.cycle_d2h = []
                b.norm_parts, b.norm_cursor = [], 0
            self._begin_cycle()
            self._launch(b, todo)

    def _total_sumsq(self) -> float:
        total = self.small.sumsq() if self.small else 0.0
        for b in self.buckets:
            if not b.copied:
                continue
            b.d2h_ev.synchronize()
            vals = {}
            for positions, off in b.norm_parts:
                v = b.norm_buf[off:off + len(positions)].tolist()
                vals.update(zip(positions, v))
            total += math.fsum(vals[p] for p in b.copied)
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        if float(norm_type) != 2.0:
            raise ValueError("offload's fused clipping supports norm_type=2.0 only")
        if self.eager:
            raise RuntimeError(
                "offload GPU mode: clip_grad_norm_ needs every gradient before any bucket is stepped, but this "
                "optimizer steps buckets during backward. Construct it with max_grad_norm=... (clipping inside "
                "step()) or step_during_backward=False.")
        t0 = time.perf_counter()
        self._flush()
        total = math.sqrt(self._total_sumsq())
        self._blocked(time.perf_counter() - t0)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total}), so it cannot be clipped")
        coef = float(max_norm) / (total + 1e-6)
        if coef < 1.0:
            self.opt._pending_multiplier *= coef
        return torch.tensor(total, dtype=torch.float32)

    def step(self, grad_multiplier: Optional[float]) -> None:
        self._raise_if_failed()
        t_start = time.perf_counter()
        mult = self.opt._pending_multiplier * (1.0 if grad_multiplier is None else float(grad_multiplier))
        self.opt._pending_multiplier = 1.0
        gs = getattr(self.opt, "grad_scale", None)
        found_inf = getattr(self.opt, "found_inf", None)
        if self.release_grads and found_inf is not None:
            raise RuntimeError("offload: release_grads=True cannot be combined with torch.amp.GradScaler (it reads "
                               "the device gradients after backward); use release_grads=False")
        if gs is not None:
            mult /= float(gs)
        if (gs is not None or found_inf is not None) and self.eager and any(b.queued for b in self.buckets):
            raise RuntimeError("offload: torch.amp.GradScaler needs check_overflow=True (or step_during_backward="
                               "False): buckets were already stepped during backward without the loss scale")
        if self.eager and mult != 1.0:
            raise RuntimeError(f"offload: step(grad_multiplier={mult}) needs step_during_backward=False: buckets "
                               "are stepped during backward, before the multiplier is known")
        self._flush()
        stats = self.stats
        skip = False
        if found_inf is not None and float(found_inf) > 0:
            skip = True
        if not self.eager:
            need_norm = self.max_grad_norm is not None or self.check_overflow
            if need_norm and not skip:
                total = self._total_sumsq()
                if self.check_overflow and not math.isfinite(total):
                    skip = True
                if self.max_grad_norm is not None and not skip:
                    # norm of the gradients as the kernel will see them (after 1/loss scale)
                    norm = math.sqrt(total) * abs(mult)
                    coef = self.max_grad_norm / (norm + 1e-6)
                    if coef < 1.0:
                        mult *= coef
        if not math.isfinite(mult) and not skip:
            raise ValueError(f"grad_multiplier must be finite, got {mult}")
        stats.grad_multiplier = mult
        stats.skipped = skip
        for b in self.buckets:   # the device gradients may be zeroed in place after step(): not while read
            if b.copied and not self.release_grads:
                stall = self.device.timed_wait(b.d2h_ev)
                with self._ev_lock:
                    self._events.append(("exposed", b, stall, stats))
        bwd = self.device.record()
        seq: List[Bucket] = []
        if not skip and self.small:
            self.small.step(mult)
        if not skip:
            order = sorted(self.buckets, key=lambda x: x.rank)
            for b in order:
                if b.copied and not b.queued:
                    self._queue_step(b, self.opt.group_hyper(b.group), mult)
            for b in order:
                if b.queued:
                    positions = sorted(b.copied)
                    b.h2d_issued.clear()
                    seq.append(b)
                    if self.overlap:
                        self._jobs.put(("upload", b, positions, bwd, stats))
                    else:
                        self._run_upload(b, positions, bwd, stats)
        self._nsteps += 1
        stats.step = self._nsteps
        self._reset_cycle()
        self.stats = StepStats(overlapped=self.overlap)   # the next cycle's
        self._upload_seq, self._wait_ptr, self._seq_stats = seq, 0, stats
        self._done_stats.append(stats)
        self._collect_copy_times()   # keeps the event list short even if nobody reads the stats
        if len(self._done_stats) > 8:
            self._last_stats_candidates()
        if self.overlap:
            if getattr(self, "_order_handle", None) is not None:
                self._apply_observed_order()
            if seq and self._fwd_handle is None:
                self._fwd_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                    _weak_hook(self, "_before_forward"))
            if not seq:
                stats.complete = True
        else:
            self._await_uploads(None)
            self.device.synchronize()
        t_end = time.perf_counter()
        self._blocked(t_end - t_start, stats)
        if self.trace is not None:
            self.trace.span(f"step() {stats.step}", "training thread", (t_start, t_end))

    # ================================================================== forward: H2D waits
    def _observe_order(self, module, args) -> None:
        for p in module._parameters.values():
            if p is not None and id(p) in self.slot_of and id(p) not in self._order_seen:
                self._order_seen[id(p)] = len(self._order_seen)

    def _apply_observed_order(self) -> None:
        self._order_handle.remove()
        self._order_handle = None
        seen = self._order_seen
        if seen:
            big = len(seen) + len(self.slot_of)
            key = {b.index: min((seen.get(id(s.param), big) for s in b.slots), default=big) for b in self.buckets}
            for r, b in enumerate(sorted(self.buckets, key=lambda x: (key[x.index], x.index))):
                b.rank = r
            self._upload_seq.sort(key=lambda x: x.rank)

    def _before_forward(self, module, args) -> None:
        need = -1
        for p in module._parameters.values():
            s = self.slot_of.get(id(p)) if p is not None else None
            if s is not None and s.bucket.rank > need:
                need = s.bucket.rank
        if need >= 0:
            self._await_uploads(need)

    def _await_uploads(self, upto_rank: Optional[int], count: bool = True) -> None:
        """Compute stream waits for the uploads of every bucket with rank <= upto_rank (None: all)."""
        seq = self._upload_seq
        last = None
        while self._wait_ptr < len(seq) and (upto_rank is None or seq[self._wait_ptr].rank <= upto_rank):
            last = seq[self._wait_ptr]
            self._wait_ptr += 1
        if last is not None:
            t0 = time.perf_counter()
            self._wait_host(last.h2d_issued, "upload")
            t1 = time.perf_counter()
            blocked = t1 - t0
            if self.trace is not None and count:
                self.trace.span(f"wait weights b{last.index}", "training thread", (t0, t1))
            stall = self.device.timed_wait(last.h2d_ev)
            if count and self._seq_stats is not None:
                self._blocked(blocked, self._seq_stats)
                with self._ev_lock:
                    self._events.append(("exposed", last, stall, self._seq_stats))
        if self._wait_ptr >= len(seq):
            if self._seq_stats is not None:
                self._seq_stats.complete = True
            if self._fwd_handle is not None:
                self._fwd_handle.remove()
                self._fwd_handle = None

    # ================================================================== sync / stats
    def synchronize(self) -> None:
        """Block until every queued step and copy is done and the weights are on the device."""
        if self._worker is not None:
            done = threading.Event()
            self._jobs.put(("barrier", done))
            self._wait_host(done, "CPU worker")
        self._await_uploads(None, count=False)
        self.device.synchronize()
        self._raise_if_failed()

    def _collect_copy_times(self) -> None:
        with self._ev_lock:
            events, self._events = self._events, []
        keep = []
        for kind, b, ev, st in events:
            if ev.query():
                st.add(**{f"{kind}_s": ev.seconds()})
                if self.trace is not None and kind != "exposed":
                    self.trace.span(f"{kind} b{b.index}", kind, ev.span())
            else:
                keep.append((kind, b, ev, st))
        with self._ev_lock:
            self._events = keep + self._events

    def last_step_stats(self, wait: bool = False) -> Optional[dict]:
        """Timing of the latest step whose weights are back on the device (``wait=True``: finish the
        latest step first; its exposed time then does not include the next forward's waits)."""
        if wait:
            self.synchronize()
        self._collect_copy_times()
        self._last_stats_candidates()
        return None if self._last_stats is None else self._last_stats.as_dict()

    def _last_stats_candidates(self) -> None:
        with self._ev_lock:
            pending = {id(st) for _, _, _, st in self._events}
        done = [st for st in self._done_stats if st.complete and id(st) not in pending]
        if done:
            self._last_stats = done[-1]
            keep_from = self._done_stats.index(done[-1]) + 1
            self._done_stats = self._done_stats[keep_from:]

    def export_chrome_trace(self, path: str) -> int:
        if self.trace is None:
            raise RuntimeError("construct the optimizer with trace=True to record a timeline")
        self._collect_copy_times()
        return self.trace.export(path)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for name in ("_fwd_handle", "_order_handle"):
            h = getattr(self, name, None)
            if h is not None:
                h.remove()
                setattr(self, name, None)
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=10)
            self._worker = None
        if getattr(self, "owns_device", False):
            self.owns_device = False
            self.device.close()
