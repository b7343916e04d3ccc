"""schedule/backward.py: BackwardFeed, the overlapped schedule that feeds the buckets of device
parameters to a CPU worker: it composes the worker (schedule/worker.py Worker: thread, per-bucket
step, read-ahead) and its ``step()`` on the training thread (schedule/feedstep.py FeedStep), and
owns the step's bookkeeping (schedule/stepround.py StepRound, ``round``: one per step).

``offload.AdamW(cuda_params, storage=...)`` with ``overlap=True`` (any tier). With
``step_during_backward`` (the default without clipping / overflow check) a post-accumulate-grad
hook marks each parameter ready and a bucket whose parameters are all ready is queued at once;
otherwise (``eager=False``) ``step()`` queues every bucket after deciding the multiplier. The
one CPU worker thread, per bucket,
  * keeps up to ``depth`` state reads ahead in the *expected backward order* (reverse layout order
    at the first step, the order observed in the previous step afterwards; a bucket that arrives
    out of that order is read on demand: slower, never wrong);
  * issues the gradients' D2H into a staging slot as soon as one is free (up to the ring size
    ahead),
  * acquires the bucket's state, runs the kernel, writes the state back (asynchronously) and
    issues the H2D of the new weights.
So NVMe reads, D2H, the kernel, write-back and H2D overlap each other and backward. ``step()``
queues the buckets that never completed (parameters without a hooked gradient) and returns; the
worker finishes the step (write-backs drained, state committed) while forward runs, and each
module waits only for the uploads of its own buckets (schedule/uploads.py). Host memory is the
tier's slots plus the staging ring (offload/params/device.py), whatever the model size.

Bitwise equal to every other mode: the same rows and step counts reach the same kernel. Step
counts advance when a parameter's first bucket is queued; hyperparameters are read then (as the
RAM-state GPU scheduler does). Anything that fails after a bucket was stepped marks the tier
failed.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from .backwardwatch import BackwardWatch, unfinished
from .feedstep import FeedStep
from .frameworks import accelerate_accumulating
from .hooks import weak_hook
from .stepround import StepRound
from .uploads import UploadWaits
from .worker import NudgeJob, Worker

__all__ = ["BackwardFeed", "HELD_BUCKETS"]

# release_grads: backward waits while more queued buckets than this still hold their gradients
# (copies down not issued yet); see BackwardFeed._hold_back
HELD_BUCKETS = 2


class BackwardFeed:
    def __init__(self, face, engine, device, *, eager: bool = True, release_grads: bool = False,
                 trace=None):
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
                                   self.raise_if_failed, trace,
                                   lambda bi: self.stepper.unwritten(bi))
        self.error: Optional[BaseException] = None
        self.reported = False
        self.watch = BackwardWatch()   # backward passes that handed gradients over, not completed
        # (a module's state_dict / load_state_dict pre-hook: after a backward that raised part-way)
        self.uploads.settle = weak_hook(self, "settle_backward")
        self._hooks: list = []
        self._hooked = 0
        self._nb = -1
        self.order: list = []
        self._down_cv = threading.Condition()   # the worker issued a bucket's copies down
        self._hook_params()
        self.maps()
        self._reset()
        self.worker = Worker(engine, threads=face.kernel_threads, failure=lambda: self.error,
                             failed=self.fail, sent_down=self._sent_down,
                             stepping=lambda bi: self.round.stepping(bi), wanted=self._wanted,
                             trace=trace)
        # step() on the training thread; observes the first forward
        self.stepper = FeedStep(self, engine, face, self.uploads, self.worker)

    # ------------------------------------------------------------------ shape
    def _hook_params(self) -> None:
        """Hooks on every parameter (also the groups added by add_param_group)."""
        groups = self.engine.groups
        self.key_of = {id(p): (gi, i) for gi, ps in enumerate(groups) for i, p in enumerate(ps)}
        for gi in range(self._hooked, len(groups)):
            for i, p in enumerate(groups[gi]):
                if not p.requires_grad:
                    continue   # frozen: if it gets a gradient later, step() sends it
                # accumulating into p.grad in place: not while the last step's D2H may read it
                self._hooks.append(p.register_hook(weak_hook(self, "_before_accumulate")))
                if self.eager:
                    hook = weak_hook(self, "_on_grad", gi, i)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._hooked = len(groups)

    def maps(self) -> None:
        """Per bucket: its parameters; per parameter: its buckets; the expected order grows with
        the layout."""
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
        if self._nb >= 0:   # growth during a step (a frozen parameter's first gradient)
            self.round.add_buckets(self.params_of[self._nb:])   # (they wait for their gradients)
        self._nb = len(buckets)
        # parameters with no state yet (frozen at construction): a gradient grows the layout
        eng = self.engine
        self.unlaid = [(gi, i) for gi, ps in enumerate(eng.groups) for i in range(len(ps))
                       if eng.numels[gi][i] and (gi, i) not in self.buckets_of
                       and (gi, i) not in eng.excluded]

    def extend(self) -> None:
        self._hook_params()
        self.maps()

    def _reset(self, hypers: Optional[dict] = None) -> None:
        """A fresh StepRound (schedule/stepround.py): the bookkeeping of the step that begins."""
        self.round = StepRound(self.engine.groups, self.params_of, hypers)

    @property
    def in_cycle(self) -> bool:
        """Between a step's first gradient (or step()) and the end of its step()."""
        return self.round.open

    def end_cycle(self) -> None:
        """The step's beginning failed part-way (delay_updates): the next one begins afresh."""
        self.round.close()

    # ---------------------------------------------------- backward (training / autograd thread)
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
        # frozen at construction, unfrozen since: laid out before any bucket is stepped (a full
        # drive refuses, nothing changed)
        if self.engine.reserve(self.unlaid):
            self.maps()
        self._reset(hypers)
        eng.adopt(self.face.port.state())
        if self.face.on_device:   # (stepped at step(), after the buckets this backward steps)
            self.face.on_device.check()
        self.face.reload_changed()
        self.side.grads = self.round.grads
        self.mark()
        self.round.start()

    def mark(self) -> None:
        """The step's marks: the counters at its start (feedstep.py reports the differences)."""
        tel = self.tier.telemetry
        self.round.mark(dict(io=tel["read_wait_s"] + tel["write_wait_s"],
                             kernel=self.engine.telemetry["kernel_s"], side=dict(self.side.stats)))

    def _before_accumulate(self, grad) -> None:
        """Tensor hook before a gradient accumulates: a step still in flight may read p.grad (D2H);
        and the compute stream waits for the uploads no forward waited for (modules that did not
        run), so that writes after backward are ordered after them."""
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
            if self.in_cycle and self.fail_stepped(e):
                self.give_up_uploads()
            raise

    def fail_stepped(self, e: BaseException) -> bool:
        """Buckets of this step were queued (and nothing failed before): the step cannot complete,
        and the feed fails with ``e``, reported. True when it did."""
        if self.round.dispatched and self.error is None:
            self.fail(e, True)
            return True
        return False

    def _take(self, gi: int, i: int, p) -> None:
        if not self.in_cycle:
            self.begin_cycle(in_backward=True)
        # (failed in this step: StoreFailedError, not the 'second backward' below)
        self.raise_if_failed()
        key = (gi, i)
        if key not in self.buckets_of:
            return   # no state laid out (frozen at construction, or empty): step() handles it
        rnd = self.round
        if key in rnd.sent:
            if rnd.dispatched:
                if self.watch.others():   # an earlier backward is open: it raised part-way
                    # (or this one runs inside it: a reentrant activation checkpoint)
                    self.fail(RuntimeError(unfinished(
                        "a backward raised part-way", len(rnd.dispatched),
                        " (or a reentrant activation checkpoint's backward reached a parameter it "
                        "had stepped: construct the optimizer with step_during_backward=False)")))
                    self.raise_if_failed()
                raise RuntimeError(
                    "offload: a second backward reached parameters whose gradients were already "
                    "sent to the CPU and stepped (step_during_backward mode). For gradient "
                    "accumulation wrap the earlier backward passes in `with optimizer.no_sync():` "
                    "(or call optimizer.set_accumulation_boundary(False)). With reentrant "
                    "activation checkpointing that reuses a parameter in several segments, "
                    "construct the optimizer with step_during_backward=False.")
            first = False
        else:
            first = True
        self.stepper.capture(rnd, gi, i, p)
        if first:
            for bi in rnd.arrived(key, self.buckets_of[key]):
                self.stepper.dispatch(rnd, bi, 1.0)
            if self.release_grads:
                self._hold_back()

    def _hold_back(self) -> None:
        """release_grads: wait while more than HELD_BUCKETS queued buckets still hold their
        gradients. A gradient is allocated when its backward is enqueued, and on a GPU backward is
        enqueued far ahead of the copies: without this wait every gradient exists before the first
        one is freed, and the peak is that of release_grads=False. Waiting here holds the rest of
        backward back, so the gradients alive at once stay a few buckets' worth."""
        with self._down_cv:
            while self.round.held() > HELD_BUCKETS and self.error is None:
                self._down_cv.wait(0.05)

    def _sent_down(self, gi: int, pieces) -> None:
        """The D2H of these pieces was issued: the feed drops a gradient whose last bucket this
        was (the device keeps it alive until the copy read it: record_stream on CUDA), so it is
        freed as the step goes (release_grads; torch's zero_grad during the next forward) instead
        of at its end."""
        with self._down_cv:
            self.round.sent_down(gi, pieces)
            self._down_cv.notify_all()

    def raise_if_failed(self) -> None:
        """Report the worker's failure: StoreFailedError naming it, every time until a load. The
        first report gives up the uploads (give_up_uploads), so that no forward or
        model.load_state_dict waits for them again (and raises again) and none lands after the user
        restored the weights."""
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
        """The worker failed: it finishes what is queued (it steps and uploads nothing more), the
        compute stream waits for the uploads it issued before the failure (those of a step still in
        backward too: a failure raised by a gradient hook), and none is waited for again."""
        self.wait_idle()
        self.uploads.abandon(self.round.ups)

    def settle_backward(self, discarded: bool = False) -> None:
        """Outside backward: buckets stepped during a backward that then raised part-way (or,
        ``discarded``, whose gradients zero_grad() discards) hold part of a step that nothing can
        complete: the optimizer fails, naming it (docs/failures.md). With nothing stepped yet, a
        discarded step starts afresh."""
        aborted = self.watch.aborted()
        if not self.in_cycle or self.error is not None or not (aborted or discarded):
            return
        if not self.round.dispatched:
            if discarded:
                self._reset()   # (nothing was stepped: as if the backward had not run)
            return
        why = ("a backward raised part-way" if aborted else
               "zero_grad() discarded the gradients of a step")
        self.fail(RuntimeError(unfinished(why, len(self.round.dispatched))), True)
        self.give_up_uploads()

    def discard(self) -> None:
        """zero_grad(): the gradients go (settle_backward)."""
        self.settle_backward(discarded=True)

    def recover(self) -> None:
        """After a complete load_state_dict (which recovered the tier): a failed step's error goes,
        and the next backward or step() starts a fresh step."""
        self.watch.open.clear()
        if self.error is not None:
            self.wait_idle()
            self.error, self.reported = None, False
            self.uploads.abandon(self.round.ups)
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
        """The next ``depth`` buckets the worker reads ahead (StepRound.wanted): the step's queued
        ones, then the expected order."""
        return self.round.wanted(self.order, len(self.engine.layout.buckets), depth)

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
        """Queue what is left of this step and return at once (schedule/feedstep.py
        FeedStep.step)."""
        t_step = time.perf_counter()
        if not self.in_cycle:
            self.begin_cycle()
        return self.stepper.step(self.round, t_step, mult, grad_scale, found_inf, skip=skip,
                                 before=before)

    def after_step(self) -> None:
        """The end of step() (whether it raised or not): the expected order is the one observed,
        the step's uploads are waited for by forward (or given up after a failure it raised), and
        the worker reads ahead the next step's first buckets during forward."""
        rnd = self.round
        self.order = rnd.pending(self.order)
        rnd.close()
        self.uploads.start(rnd.ups)   # forward waits bucket by bucket
        if self.error is not None and self.reported:
            self.give_up_uploads()   # (this step raised the failure)
        self.worker.put(NudgeJob())

    def forward_order(self) -> list:
        """Buckets in first-use order (observed in the first forward), the rest in layout order."""
        return self.stepper.forward_order()

    # ------------------------------------------------------------------ lifecycle
    def synchronize(self) -> None:
        """Wait for the worker; a failure not reported yet is raised (later uses of the state then
        raise StoreFailedError through the tier; close() still works)."""
        self.settle_backward()
        self.wait_idle()
        if self.error is not None and self.reported:
            # reported already: later uses raise StoreFailedError
            self.uploads.abandon(self.round.ups)
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
