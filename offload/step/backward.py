"""step/backward.py: BackwardFeed, the CPU worker that steps the buckets of device parameters.

``offload.AdamW(cuda_params, storage=...)`` with ``overlap=True`` (any tier). With
``step_during_backward`` (the default without clipping / overflow check) a post-accumulate-grad
hook marks each parameter ready and a bucket whose parameters are all ready is queued at once;
otherwise (``eager=False``) ``step()`` queues every bucket after deciding the multiplier. The
one CPU worker thread, per bucket,
  * keeps up to ``depth`` state reads ahead in the *expected backward order* (reverse layout order
    at the first step, the order observed in the previous step afterwards; a bucket that arrives
    out of that order is read on demand: slower, never wrong);
  * issues the gradients' D2H into a staging slot as soon as one is free (up to the ring size ahead),
  * acquires the bucket's state, runs the kernel, writes the state back (asynchronously) and
    issues the H2D of the new weights.
So NVMe reads, D2H, the kernel, write-back and H2D overlap each other and backward. ``step()``
queues the buckets that never completed (parameters without a hooked gradient) and returns; the
worker finishes the step (write-backs drained, state committed) while forward runs, and each
module waits only for the uploads of its own buckets (step/uploads.py). Host memory is the tier's
slots plus the staging ring (offload/params/device.py), whatever the model size.

Bitwise equal to every other mode: the same rows and step counts reach the same kernel. Step
counts advance when a parameter's first bucket is queued; hyperparameters are read then (as the
RAM-state GPU scheduler does). Anything that fails after a bucket was stepped marks the tier failed.
"""
from __future__ import annotations

import functools
import math
import queue
import threading
import time
import weakref
from collections import deque
from typing import Optional

import numpy as np
import torch

from ..base.dist import local
from ..params.base import check_grad
from .bucket import step_bucket
from .feedstep import FeedStep
from .frameworks import accelerate_accumulating
from .hooks import weak_hook
from .owners import ForwardObserver
from .uploads import Upload, UploadWaits
from .worker import _WAIT_S, _loop, _stop_worker, _unchanged

__all__ = ["BackwardFeed"]


class BackwardFeed(FeedStep):
    def __init__(self, face, engine, device, *, eager: bool = True, release_grads: bool = False, trace=None):
        self.face = face            # DeviceStep: the optimizer's hyperparameters and state dict
        self.engine = engine
        self.side = engine.side
        self.tier = engine.tier
        self.device = device
        self.eager = bool(eager)    # buckets queued during backward (else all of them in step())
        self.release_grads = bool(release_grads)
        self.trace = trace
        self.boundary = True
        self.uploads = UploadWaits(device, lambda pid: self.buckets_of.get(self.key_of.get(pid)),
                                   self._raise_if_failed, trace, self._unwritten)
        self._race_reported: set = set()   # parameters whose racing write was reported (this step)
        self.error: Optional[BaseException] = None
        self._reported = False
        self._hooks: list = []
        self._hooked = 0
        self._nb = -1
        self.order: list = []
        self._hook_params()
        self._maps()
        self._reset()
        self.seen: list = []         # buckets in the order the first forward used them (upload order)
        self.forward = ForwardObserver()
        # until the first step(): the order the first forward uses the buckets in (deferred schedule),
        # and the modules whose state_dict() must wait for uploads (uploads.note)
        self._observer = torch.nn.modules.module.register_module_forward_pre_hook(weak_hook(self, "observe"))
        self._q: "queue.Queue" = queue.Queue()
        self._worker = threading.Thread(target=_loop, args=(weakref.ref(self), self._q),
                                        name="offload-backward-step", daemon=True)
        self._worker.start()
        self._finalizer = weakref.finalize(self, _stop_worker, self._q, self._worker)

    # ------------------------------------------------------------------ shape
    def _hook_params(self) -> None:
        """Hooks on every parameter (also the groups added by add_param_group)."""
        groups = self.engine.groups
        self.key_of = {id(p): (gi, i) for gi, ps in enumerate(groups) for i, p in enumerate(ps)}
        for gi in range(self._hooked, len(groups)):
            for i, p in enumerate(groups[gi]):
                if not p.requires_grad:
                    continue   # frozen: if it gets a gradient later, step() sends it
                # accumulating into p.grad in place: not while the last step's D2H may still read it
                self._hooks.append(p.register_hook(weak_hook(self, "_before_accumulate")))
                if self.eager:
                    self._hooks.append(p.register_post_accumulate_grad_hook(weak_hook(self, "_on_grad", gi, i)))
        self._hooked = len(groups)

    def _maps(self) -> None:
        """Per bucket: its parameters; per parameter: its buckets; the expected order grows with the layout."""
        buckets = self.engine.layout.buckets
        if len(buckets) == self._nb:
            return
        self.params_of = [sorted({pc.param for pc in b.pieces}) for b in buckets]
        self.buckets_of: dict = {}
        for b, ps in zip(buckets, self.params_of):
            for i in ps:
                self.buckets_of.setdefault((b.group, i), []).append(b.index)
        known = set(self.order)
        self.order = self.order + [b.index for b in reversed(buckets) if b.index not in known]
        if self._nb >= 0:   # mid-cycle growth (a frozen parameter's first gradient): new buckets wait
            self.missing += [len(ps) for ps in self.params_of[self._nb:]]
        self._nb = len(buckets)
        eng = self.engine   # parameters with no state yet (frozen at construction): a gradient grows the layout
        self.unlaid = [(gi, i) for gi, ps in enumerate(eng.groups) for i in range(len(ps))
                       if eng.numels[gi][i] and (gi, i) not in self.buckets_of and (gi, i) not in eng.excluded]

    def extend(self) -> None:
        self._hook_params()
        self._maps()

    def _reset(self) -> None:
        self.in_cycle = False
        self.sent: dict = {}                 # (gi, i) -> (weakref to the grad, or None with release_grads; version)
        self.unsent: dict = {}               # (gi, i) -> its buckets whose D2H is not issued yet
        self._hypers: dict = {}              # group -> hyperparameters read at its first bucket this step
        self.missing = [len(ps) for ps in self.params_of]
        self.dispatched: list = []   # queue order
        self.done = set()            # queued (training thread)
        self.stepped = set()         # stepped (worker)
        self.grads = [[None] * len(g) for g in self.engine.groups]
        self.advanced = [np.zeros(len(g), dtype=bool) for g in self.engine.groups]
        self.ups: list = []          # Upload of each queued bucket, in queue order
        self.ahead = None            # set by the worker when a step finished: the next step's expected order

    # ------------------------------------------------------------------ backward (training / autograd thread)
    def _begin(self) -> None:
        self._raise_if_failed()
        self.wait_idle()
        self.uploads.wait_all()   # (a parameter no module's forward used)
        self._reset()
        eng = self.engine
        eng.begin(self.face.port.state())
        self.face.reload_changed()
        self.side.grads = self.grads
        tel = self.tier.telemetry
        self._t = dict(io=tel["read_wait_s"] + tel["write_wait_s"], kernel=eng.telemetry["kernel_s"],
                       side=dict(self.side.stats), first=None)
        self.in_cycle = True

    def _before_accumulate(self, grad) -> None:
        """Tensor hook before a gradient accumulates: a step still in flight may read p.grad (D2H); and
        the compute stream waits for the uploads no forward waited for (modules that did not run), so
        that writes after backward are ordered after them."""
        if self.uploads.pending:
            self.wait_idle()
            self.uploads.wait_all()

    def _on_grad(self, gi: int, i: int, p) -> None:
        if not self.boundary or accelerate_accumulating():
            return
        if not self.in_cycle:
            self._begin()
        self._raise_if_failed()   # (failed in this cycle: StoreFailedError, not the 'second backward' below)
        key = (gi, i)
        if key not in self.buckets_of:
            return   # no state laid out (frozen at construction, or empty): step() handles it
        if key in self.sent:
            if self.dispatched:
                raise RuntimeError(
                    "offload: a second backward reached parameters whose gradients were already sent to the CPU "
                    "and stepped (step_during_backward mode). For gradient accumulation wrap the earlier backward "
                    "passes in `with optimizer.no_sync():` (or call optimizer.set_accumulation_boundary(False)). "
                    "With reentrant activation checkpointing that reuses a parameter in several segments, "
                    "construct the optimizer with step_during_backward=False.")
            first = False
        else:
            first = True
        self._capture(gi, i, p)
        if first:
            for bi in self.buckets_of[key]:
                self.missing[bi] -= 1
                if self.missing[bi] == 0:
                    self._dispatch(bi, 1.0)

    def _capture(self, gi: int, i: int, p) -> None:
        eng = self.engine
        g = p.grad
        check_grad(p, g, gi, i, eng.dtypes[gi][i], eng.numels[gi][i], eng.mode, True)
        self.grads[gi][i] = local(g)   # held until the D2H of its last bucket is issued (_sent_down)
        self.unsent[(gi, i)] = len(self.buckets_of[(gi, i)])
        # the gradient itself is not held here: it is freed once copied down (and, with release_grads, at once)
        self.sent[(gi, i)] = (None if self.release_grads else weakref.ref(g), g._version)
        if self.release_grads:
            p.grad = None

    def hyper(self, gi: int) -> dict:
        h = self.face.port.hyper(gi)
        for k in ("lr", "eps", "weight_decay", "beta1", "beta2"):
            if not math.isfinite(h[k]):
                raise ValueError(f"group {gi}: {k} = {h[k]} is not finite")
        return h

    def _dispatch(self, bi: int, mult: float, hypers: Optional[dict] = None) -> None:
        eng = self.engine
        b = eng.layout.buckets[bi]
        sent = self.sent
        act = [pc for pc in b.pieces if (b.group, pc.param) in sent]
        if not act:
            return
        if hypers is None:   # (during backward: once per group and step, not per bucket)
            hypers = self._hypers
            if b.group not in hypers:
                hypers[b.group] = self.hyper(b.group)
        h = hypers[b.group]
        adv, steps = self.advanced[b.group], eng.registry.steps[b.group].numpy()
        for pc in act:
            if not adv[pc.param]:
                adv[pc.param] = True
                steps[pc.param] += 1
        if not self.dispatched:
            self._t["first"] = time.perf_counter()   # the optimizer's part of the step starts here
        self.dispatched.append(bi)
        self.done.add(bi)
        up = Upload(bi)
        self.ups.append(up)
        gr = self.grads[b.group]
        reads = [(b.group, pc.param, gr[pc.param], gr[pc.param]._version) for pc in act]   # see _unchanged
        self._q.put(("step", b, act, eng.registry.has_state(b), h, mult, self.device.record(), reads, up))

    # ------------------------------------------------------------------ the worker
    def work(self, q, pending: deque, staged: deque) -> bool:
        """One turn of the worker thread (step/worker.py): True when it is to stop. An exception outside
        a bucket's own handling (the read-ahead between jobs) fails the step instead of ending the thread."""
        try:
            return self._work(q, pending, staged)
        except BaseException as e:
            self._failed(e)
            return False

    def _work(self, q, pending: deque, staged: deque) -> bool:
        while True:
            try:
                pending.append(q.get_nowait())
            except queue.Empty:
                break
        nslots = self.side.nslots
        while pending and pending[0] is not None and pending[0][0] == "step" and len(staged) < nslots:
            job = pending.popleft()
            if self.error is not None:
                job[-1].issued.set()
                continue
            try:
                _, b, act, _, _, _, after, reads, _ = job
                _unchanged(reads)
                with self.engine.lock:
                    staged.append((job, self.side.arrive(b, act, after)))
                self._sent_down(b.group, act)
            except BaseException as e:
                self._failed(e)
        if staged:
            job, st = staged.popleft()
            if self.error is None:
                try:
                    self._step_bucket(job, st)
                except BaseException as e:
                    self._failed(e)
            job[-1].issued.set()
            return False
        if pending:
            item = pending.popleft()
            if item is None:
                return True
            if item[0] == "barrier":
                item[1].set()
            elif item[0] == "finish" and self.error is None:
                try:
                    item[1]()
                except BaseException as e:
                    self._failed(e)
        if not pending and not staged and self.error is None:
            self._read_ahead(blocking=False)
        return False

    def _sent_down(self, gi: int, pieces) -> None:
        """The D2H of these pieces was issued: a gradient whose last bucket this was is no longer held
        (the device keeps it alive until the copy read it: record_stream on CUDA), so it is freed as the
        step goes (release_grads; torch's zero_grad during the next forward) instead of at its end."""
        for pc in pieces:
            key = (gi, pc.param)
            left = self.unsent.get(key, 0) - 1
            if left > 0:
                self.unsent[key] = left
            elif self.unsent.pop(key, None) is not None:
                self.grads[gi][pc.param] = None

    def recover(self) -> None:
        """After a complete load_state_dict (which recovered the tier): a failed step's error goes, and the
        next backward or step() starts a fresh cycle."""
        if self.error is not None:
            self.wait_idle()
            self.error, self._reported = None, False
            self.uploads.abandon()
            self._reset()

    def _failed(self, e: BaseException, reported: bool = False) -> None:
        if self.error is None:
            self.error = e
            self._reported = reported
            try:
                self.tier.fail(e)
            except BaseException:
                pass

    def _read_ahead(self, blocking: bool) -> None:
        """Keep ``depth`` reads in flight for the next buckets of the expected order."""
        tier, eng = self.tier, self.engine
        if tier.kind != "nvme" or tier.closed:
            return
        lock = eng.lock
        if not lock.acquire(blocking=blocking):
            return
        try:
            if tier.failed is not None:
                return
            buckets = eng.layout.buckets
            # queued buckets first (the worker may lag behind backward), then the expected order
            ahead = self.ahead
            if ahead is not None:   # between a finished step and the next backward
                wanted = [bi for bi in ahead if bi < len(buckets)][:eng.depth]
            else:
                wanted = [bi for bi in list(self.dispatched) + [bi for bi in self.order if bi not in self.done]
                          if bi not in self.stepped and bi < len(buckets)][:eng.depth]
            tier.keep_reads(set(wanted))   # a mispredicted read-ahead only holds a slot: give it up
            for bi in wanted:
                b = buckets[bi]
                if not tier.prefetched(b):
                    tier.prefetch(b, eng.registry.has_state(b))
                    if not tier.prefetched(b):
                        break   # no free slot now
        finally:
            lock.release()

    def _step_bucket(self, job, st) -> None:
        _, b, act, read, hyper, mult, after, reads, up = job
        eng, side, tier = self.engine, self.side, self.tier
        with eng.lock:
            self.stepped.add(b.index)
            blk = tier.acquire(b, read)   # read on demand if it was not read ahead
            self._read_ahead(blocking=True)   # the next reads run during this kernel
            t0, t1 = step_bucket(b, act, blk, functools.partial(side.ptrs, b, act, st),   # ptrs: waits for the D2H
                                 registry=eng.registry, read_master=functools.partial(side.read_master, after=after),
                                 hyper=hyper, mult=mult, threads=self.face.kernel_threads(), timing=eng.telemetry,
                                 between=functools.partial(_unchanged, reads))
            tier.release(b, blk)
            up.ev = side.publish(b, act, st, after)
        if self.trace is not None:
            self.trace.span(f"adam b{b.index}", "cpu step", (t0, t1))

    def wait_idle(self) -> None:
        """Every queued bucket stepped and its upload issued."""
        done = threading.Event()
        self._q.put(("barrier", done))
        if not done.wait(_WAIT_S):
            raise TimeoutError(f"offload: the CPU worker did not finish within {_WAIT_S} s")

    # ------------------------------------------------------------------ lifecycle
    def synchronize(self) -> None:
        """Wait for the worker; a failure not reported yet is raised (later uses of the state then raise
        StoreFailedError through the tier; close() still works)."""
        self.wait_idle()
        if self.error is not None and self._reported:
            self.uploads.abandon()   # reported already: later uses raise StoreFailedError
            return
        self._raise_if_failed()
        self.uploads.wait_all()

    def close(self) -> None:
        self.uploads.close()
        if self._observer is not None:
            self._observer.remove()
            self._observer = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._q.put(None)
            self._worker.join(timeout=10)
            self._worker = None
