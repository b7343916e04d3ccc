"""schedule/backward.py: BackwardFeed, the overlapped schedule that feeds the buckets of device parameters
to a CPU worker: it composes the worker (schedule/worker.py Worker: thread, per-bucket step, read-ahead) and
its ``step()`` on the training thread (schedule/feedstep.py FeedStep), and holds the step's bookkeeping.

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
module waits only for the uploads of its own buckets (schedule/uploads.py). Host memory is the tier's
slots plus the staging ring (offload/params/device.py), whatever the model size.

Bitwise equal to every other mode: the same rows and step counts reach the same kernel. Step
counts advance when a parameter's first bucket is queued; hyperparameters are read then (as the
RAM-state GPU scheduler does). Anything that fails after a bucket was stepped marks the tier failed.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from .backwardwatch import BackwardWatch, unfinished
from .feedstep import FeedStep
from .frameworks import accelerate_accumulating
from .hooks import weak_hook
from .uploads import UploadWaits
from .worker import Worker

__all__ = ["BackwardFeed", "HELD_BUCKETS"]

# release_grads: backward waits while more queued buckets than this still hold their gradients (copies
# down not issued yet); see BackwardFeed._hold_back
HELD_BUCKETS = 2


class BackwardFeed:
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
        self.stepper = FeedStep(self)   # step() on the training thread; observes the first forward
        self.uploads = UploadWaits(device, lambda pid: self.buckets_of.get(self.key_of.get(pid)),
                                   self.raise_if_failed, trace, self.stepper.unwritten)
        self.error: Optional[BaseException] = None
        self.reported = False
        self.watch = BackwardWatch()   # backward passes that handed gradients over, not completed
        # (a module's state_dict / load_state_dict pre-hook: after a backward that raised part-way)
        self.uploads.settle = weak_hook(self, "settle_backward")
        self._hooks: list = []
        self._hooked = 0
        self._nb = -1
        self.order: list = []
        self._down_cv = threading.Condition()   # the worker issued a bucket's copies down (_sent_down)
        self._hook_params()
        self.maps()
        self._reset()
        self.worker = Worker(engine, threads=face.kernel_threads, failure=lambda: self.error, failed=self.fail,
                             sent_down=self._sent_down, stepping=lambda bi: self.stepped.add(bi),
                             wanted=self._wanted, trace=trace)

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

    def maps(self) -> None:
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
        self.maps()

    def _reset(self) -> None:
        self.in_cycle = False
        self.sent: dict = {}                 # (gi, i) -> (weakref to the grad, or None with release_grads; version)
        self.unsent: dict = {}               # (gi, i) -> its buckets whose D2H is not issued yet
        self.hypers: dict = {}               # group -> its hyperparameters, read as the step began
        self.missing = [len(ps) for ps in self.params_of]
        self.dispatched: list = []   # queue order
        self.down = 0                # buckets of this cycle whose copies down were issued (worker)
        self.done = set()            # queued (training thread)
        self.stepped = set()         # stepped (worker)
        self.grads = [[None] * len(g) for g in self.engine.groups]
        self.advanced = [np.zeros(len(g), dtype=bool) for g in self.engine.groups]
        self.ups: list = []          # Upload of each queued bucket, in queue order
        self.ahead = None            # set by the worker when a step finished: the next step's expected order

    # ------------------------------------------------------------------ backward (training / autograd thread)
    def begin_cycle(self, in_backward: bool = False) -> None:
        """The first gradient (or step()) of a step: the last one done, opt.state edits and
        parameter writes adopted; the counters at its start marked. What can be checked before
        the first bucket is stepped is checked first: the parameters, and ``in_backward`` (buckets
        are stepped as their gradients arrive) the hyperparameters of every group, read here for
        the whole step."""
        self.raise_if_failed()
        eng = self.engine
        eng.check_groups(self.face.port.groups(), amsgrad=True)   # (edited: laid out again first)
        self.wait_idle()
        self.uploads.wait_all()   # (a parameter no module's forward used)
        self.face.check_params()
        n = len(self.engine.groups) if in_backward else 0
        hypers = {gi: self.face.port.hyper(gi) for gi in range(n)}   # (validated, finite)
        if self.engine.reserve(self.unlaid):   # frozen at construction, unfrozen since: laid out before
            self.maps()                         # any bucket is stepped (a full drive refuses, unchanged)
        self._reset()
        self.hypers = hypers
        eng.begin(self.face.port.state())
        if self.face.on_device:   # (stepped at step(), after the buckets this backward steps)
            self.face.on_device.check()
        self.face.reload_changed()
        self.side.grads = self.grads
        self.mark()
        self.in_cycle = True

    def mark(self) -> None:
        """``marks``: the counters at the start of a step (feedstep.py reports the differences)."""
        tel = self.tier.telemetry
        self.marks = dict(io=tel["read_wait_s"] + tel["write_wait_s"], first=None,
                          kernel=self.engine.telemetry["kernel_s"], side=dict(self.side.stats))

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
        self.watch.entered()
        try:
            self._take(gi, i, p)
        except BaseException as e:
            if self.in_cycle and self.dispatched and self.error is None:
                self.fail(e, True)   # buckets of this step were stepped: it can no longer complete
                self.give_up_uploads()
            raise

    def _take(self, gi: int, i: int, p) -> None:
        if not self.in_cycle:
            self.begin_cycle(in_backward=True)
        self.raise_if_failed()   # (failed in this cycle: StoreFailedError, not the 'second backward' below)
        key = (gi, i)
        if key not in self.buckets_of:
            return   # no state laid out (frozen at construction, or empty): step() handles it
        if key in self.sent:
            if self.dispatched:
                if self.watch.others():   # an earlier backward is open: it raised part-way
                    # (or this one runs inside it: a reentrant activation checkpoint)
                    self.fail(RuntimeError(unfinished(
                        "a backward raised part-way", len(self.dispatched),
                        " (or a reentrant activation checkpoint's backward reached a parameter it "
                        "had stepped: construct the optimizer with step_during_backward=False)")))
                    self.raise_if_failed()
                raise RuntimeError(
                    "offload: a second backward reached parameters whose gradients were already sent to the CPU "
                    "and stepped (step_during_backward mode). For gradient accumulation wrap the earlier backward "
                    "passes in `with optimizer.no_sync():` (or call optimizer.set_accumulation_boundary(False)). "
                    "With reentrant activation checkpointing that reuses a parameter in several segments, "
                    "construct the optimizer with step_during_backward=False.")
            first = False
        else:
            first = True
        self.stepper.capture(gi, i, p)
        if first:
            for bi in self.buckets_of[key]:
                self.missing[bi] -= 1
                if self.missing[bi] == 0:
                    self.stepper.dispatch(bi, 1.0)
            if self.release_grads:
                self._hold_back()

    def _hold_back(self) -> None:
        """release_grads: wait while more than HELD_BUCKETS queued buckets still hold their gradients.
        A gradient is allocated when its backward is enqueued, and on a GPU backward is enqueued far
        ahead of the copies: without this wait every gradient exists before the first one is freed,
        and the peak is that of release_grads=False. Waiting here holds the rest of backward back,
        so the gradients alive at once stay a few buckets' worth."""
        with self._down_cv:
            while len(self.dispatched) - self.down > HELD_BUCKETS and self.error is None:
                self._down_cv.wait(0.05)

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
        with self._down_cv:
            self.down += 1
            self._down_cv.notify_all()

    def raise_if_failed(self) -> None:
        """Report the worker's failure: StoreFailedError naming it, every time until a load. The first
        report gives up the uploads (give_up_uploads), so that no forward or model.load_state_dict
        waits for them again (and raises again) and none lands after the user restored the weights."""
        if self.error is not None:
            if not self.reported or self.uploads.pending:
                self.give_up_uploads()
            self.reported = True
            self.tier.fail(self.error)   # (kept if the tier has its own first failure)
            self.tier.check_usable()     # StoreFailedError naming the first failure

    def check_usable(self) -> None:
        """StoreFailedError if the worker or the tier failed (a step failed part-way, a backward
        that stepped buckets raised) and no state was loaded since."""
        self.settle_backward()
        self.raise_if_failed()
        self.tier.check_usable()

    def give_up_uploads(self) -> None:
        """The worker failed: it finishes what is queued (it steps and uploads nothing more), the compute
        stream waits for the uploads it issued before the failure (those of a step still in backward
        too: a failure raised by a gradient hook), and none is waited for again."""
        self.wait_idle()
        self.uploads.abandon(self.ups)

    def settle_backward(self, discarded: bool = False) -> None:
        """Outside backward: buckets stepped during a backward that then raised part-way (or,
        ``discarded``, whose gradients zero_grad() discards) hold part of a step that nothing can
        complete: the optimizer fails, naming it (docs/failures.md). With nothing stepped yet, a
        discarded step starts afresh."""
        aborted = self.watch.aborted()
        if not self.in_cycle or self.error is not None or not (aborted or discarded):
            return
        if not self.dispatched:
            if discarded:
                self._reset()   # (nothing was stepped: as if the backward had not run)
            return
        why = ("a backward raised part-way" if aborted else
               "zero_grad() discarded the gradients of a step")
        self.fail(RuntimeError(unfinished(why, len(self.dispatched))), True)
        self.give_up_uploads()

    def discard(self) -> None:
        """zero_grad(): the gradients go (settle_backward)."""
        self.settle_backward(discarded=True)

    def recover(self) -> None:
        """After a complete load_state_dict (which recovered the tier): a failed step's error goes, and the
        next backward or step() starts a fresh cycle."""
        self.watch.open.clear()
        if self.error is not None:
            self.wait_idle()
            self.error, self.reported = None, False
            self.uploads.abandon(self.ups)
            self._reset()

    def fail(self, e: BaseException, reported: bool = False) -> None:
        if self.error is None:
            self.error = e
            self.reported = reported
            try:
                self.tier.fail(e)
            except BaseException:
                pass

    def _wanted(self, depth: int) -> list:
        """The next ``depth`` buckets the worker reads ahead: queued ones first (the worker may lag behind
        backward), then the expected order; between a finished step and the next backward, ``ahead``."""
        n = len(self.engine.layout.buckets)
        ahead = self.ahead
        if ahead is not None:
            return [bi for bi in ahead if bi < n][:depth]
        return [bi for bi in list(self.dispatched) + [bi for bi in self.order if bi not in self.done]
                if bi not in self.stepped and bi < n][:depth]

    def wait_idle(self) -> None:
        """Every queued bucket stepped and its upload issued."""
        self.worker.wait_idle()

    def settle(self) -> None:
        """The user is about to read or write ``opt.state`` (optim/adam.py ``state``): as torch's,
        it shows the state after the last step() and takes in-place writes for the next one. So a
        CPU step still running is waited for, and (NVMe) a read-ahead of the next step's state is
        given up (Worker.park). Not on the worker itself, which commits a step into opt.state."""
        self.worker.park()

    def step(self, mult: float, grad_scale, found_inf, skip: bool = False, before=None) -> dict:
        """Queue what is left of this step and return at once (schedule/feedstep.py FeedStep.step)."""
        return self.stepper.step(mult, grad_scale, found_inf, skip=skip, before=before)

    def forward_order(self) -> list:
        """Buckets in first-use order (observed in the first forward), the rest in layout order."""
        return self.stepper.forward_order()

    # ------------------------------------------------------------------ lifecycle
    def synchronize(self) -> None:
        """Wait for the worker; a failure not reported yet is raised (later uses of the state then raise
        StoreFailedError through the tier; close() still works)."""
        self.settle_backward()
        self.wait_idle()
        if self.error is not None and self.reported:
            self.uploads.abandon(self.ups)   # reported already: later uses raise StoreFailedError
            return
        self.raise_if_failed()
        self.uploads.wait_all()

    def close(self) -> None:
        self.uploads.close()
        self.stepper.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.worker.stop()
