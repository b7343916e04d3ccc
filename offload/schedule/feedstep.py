"""schedule/feedstep.py: ``step()`` of the CPU worker's feed (schedule/backward.py), on the
training thread.

It checks what the step may do (GradScaler, multiplier, gradients changed after they were sent),
validates the remaining gradients, queues every bucket not queued during backward (when nothing
was: in the order the first forward used the buckets, observed by a module pre-hook until the first
step, since their uploads are what the next forward waits for) and a ``finish`` job that commits
the state when the worker is done, then returns: the worker and the uploads run on during the next
forward (schedule/uploads.py). Also here: the observation of the first forward, and the check that
no parameter is written while its new weights are still going up.

The step's bookkeeping is the feed's StepRound (schedule/stepround.py), which ``step()`` receives
as an argument. Of the feed (BackwardFeed) FeedStep reads its settings ``eager`` and
``release_grads``, its maps ``order``, ``unlaid``, ``buckets_of``, ``key_of`` and ``params_of``,
and its ``device``, and calls ``raise_if_failed``, ``wait_idle``, ``maps``, ``fail_stepped`` and
``after_step``; it writes none of its attributes. The feed's backward hooks call ``capture`` and
``dispatch`` here with the round.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch

from ..params.base import check_grad
from .hooks import weak_module_hook
from .owners import ForwardObserver
from .uploads import Upload
from .worker import FinishJob, StepJob

__all__ = ["FeedStep", "WriteRaceError"]


class WriteRaceError(RuntimeError):
    """A parameter was written while its new weights were still being uploaded (reported once)."""


class FeedStep:
    def __init__(self, feed, engine, face, uploads, worker):
        """``feed``: the BackwardFeed; ``engine``: its StateEngine; ``face``: the DeviceStep (the
        optimizer's port); ``uploads``: the feed's UploadWaits; ``worker``: its CPU worker."""
        self.feed, self.engine, self.face, self.uploads, self.worker = (
            feed, engine, face, uploads, worker)
        self._race_reported: set = set()   # parameters whose racing write was reported (this step)
        self.seen: list = []   # buckets in the order the first forward used them (upload order)
        self.forward = ForwardObserver()
        # until the first step(): the order the first forward uses the buckets in (deferred
        # schedule), and the modules whose state_dict() must wait for uploads (uploads.note)
        hook = weak_module_hook(self, "observe")
        self._observer = torch.nn.modules.module.register_module_forward_pre_hook(hook)

    def close(self) -> None:
        """Stop observing forwards (if still observing)."""
        if self._observer is not None:
            self._observer.remove()
            self._observer = None

    def observe(self, module, args=None) -> None:
        """Forward pre-hook until the first step(): the modules that run, in order
        (schedule/owners.py), and the modules whose state_dict() waits for their uploads
        (schedule/uploads.py note)."""
        self.uploads.note(module)
        self.forward.saw(module)

    def end_observation(self) -> None:
        """At the first step() after a forward: the forward order of the buckets, and the
        parameters modules read without running their owner (their waits and state_dict hooks)."""
        feed = self.feed
        if self._observer is None or not self.forward:
            return
        self._observer.remove()
        self._observer = None
        claims = self.forward.claims()
        for module, _, claimed, owners in claims:
            self.uploads.claim(module, claimed)
            for owner in owners:
                self.uploads.note(owner)
        self.seen = self.forward.order(
            claims, lambda p: feed.buckets_of.get(feed.key_of.get(id(p)), ()))

    def forward_order(self) -> list:
        """Buckets in first-use order (observed in the first forward), the rest in layout order."""
        self.end_observation()
        known = set(self.seen)
        return self.seen + [b.index for b in self.engine.layout.buckets if b.index not in known]

    def step(self, rnd, t_step: float, mult: float, grad_scale, found_inf, skip: bool = False,
             before=None) -> dict:
        """Queue what is left of step ``rnd`` (the feed's open StepRound; ``t_step``: when step()
        was called) and return at once; the returned record is completed by the worker
        (``done``). ``skip``: decided by the caller (overflow); ``before()``: runs first if not
        skipped."""
        feed, eng, port = self.feed, self.engine, self.face.port
        early = bool(rnd.dispatched)
        if feed.release_grads and found_inf is not None:
            raise RuntimeError(
                "offload: release_grads=True cannot be combined with torch.amp.GradScaler (it "
                "reads the device gradients after backward); use release_grads=False")
        if early and (grad_scale is not None or found_inf is not None):
            raise RuntimeError(
                "offload: torch.amp.GradScaler needs check_overflow=True (or "
                "step_during_backward=False): buckets were already stepped during backward "
                "without the loss scale")
        if early and mult != 1.0:
            raise RuntimeError(
                f"offload: step(grad_multiplier={mult}) needs step_during_backward=False: "
                "buckets are stepped during backward, before the multiplier is known")
        feed.raise_if_failed()
        marks = rnd.marks
        rec = dict(done=False, t_step=t_step, side0=marks["side"], kernel0=marks["kernel"],
                   io0=marks["io"])
        try:
            self._check_sent(rnd)
            if any(eng.groups[gi][i].grad is not None for gi, i in feed.unlaid):
                # the layout grows (tier, staging ring): nothing may be in flight
                feed.wait_idle()
                feed.raise_if_failed()
            # validates the other gradients; lays out late ones (with the entries they have)
            eng.collect(port.groups(), keep_grads=False, state=port.state())
            feed.maps()
            rnd.grow(eng.groups)
            skip = skip or (found_inf is not None and float(found_inf) > 0)
            if not skip:
                if not math.isfinite(mult):
                    raise ValueError(f"grad_multiplier must be finite, got {mult}")
                if before is not None:
                    before()
                for gi, ps in enumerate(eng.groups):
                    for i, p in enumerate(ps):
                        if ((gi, i) not in rnd.sent and p.grad is not None
                                and (gi, i) in feed.buckets_of):
                            self.capture(rnd, gi, i, p)
                order = feed.order if feed.eager else self.forward_order()
                if feed.eager:
                    self.end_observation()
                todo = [bi for bi in order if bi not in rnd.done]
                buckets = eng.layout.buckets
                # all checked first; those read as backward began are kept for the whole step
                groups = {buckets[bi].group for bi in todo}
                hypers = {gi: rnd.hypers.get(gi) or port.hyper(gi) for gi in groups}
                for bi in todo:
                    self.dispatch(rnd, bi, mult, hypers)
            active = [np.zeros(len(g), dtype=bool) for g in eng.groups]
            if not skip:
                for gi, i in rnd.sent:
                    active[gi][i] = True
                # versions up here (before _finish records them, in order)
                eng.side.stepped(active)
            fresh = [(gi, i) for gi, a in enumerate(active)
                     for i in np.flatnonzero(a & ~eng.registry.ready[gi])]
            rec.update(first=rnd.marks["first"], buckets=0 if skip else len(rnd.dispatched),
                       skipped=skip)
            order = rnd.pending(feed.order)
            self.worker.put(FinishJob(lambda: self._finish(rnd, active, fresh, rec, order)))
        except BaseException as e:
            # buckets were stepped: the state matches no whole step
            feed.fail_stepped(e)
            raise
        finally:
            self._race_reported = set()
            feed.after_step()
        return rec

    def capture(self, rnd, gi: int, i: int, p) -> None:
        """Parameter (gi, i)'s gradient, checked, goes to the CPU with its buckets in step ``rnd``.
        Only its local tensor is held, until its copies down are issued; the gradient itself is
        freed once copied down (with release_grads, p.grad goes at once)."""
        eng, feed = self.engine, self.feed
        g = p.grad
        check_grad(p, g, gi, i, eng.dtypes[gi][i], eng.numels[gi][i], eng.mode, True)
        rnd.capture(gi, i, g, len(feed.buckets_of[(gi, i)]), feed.release_grads)
        if feed.release_grads:
            p.grad = None

    def dispatch(self, rnd, bi: int, mult: float, hypers: Optional[dict] = None) -> None:
        """Queue bucket ``bi`` of step ``rnd`` for the worker with the gradients sent of its
        parameters; ``hypers`` (group -> hyperparameters) None: the step's, read once per group
        (during backward)."""
        eng = self.engine
        b = eng.layout.buckets[bi]
        sent = rnd.sent
        act = [pc for pc in b.pieces if (b.group, pc.param) in sent]
        if not act:
            return
        h = rnd.hyper(b.group, self.face.port.hyper) if hypers is None else hypers[b.group]
        eng.registry.advance_params(b.group, rnd.first_steps(b.group, [pc.param for pc in act]))
        up = Upload(bi)
        rnd.queue(bi, up)
        gr = rnd.grads[b.group]
        # the versions the worker checks (worker.py _unchanged)
        reads = [(b.group, pc.param, gr[pc.param], gr[pc.param]._version) for pc in act]
        self.worker.put(StepJob(b, act, eng.registry.has_state(b), h, mult,
                                self.feed.device.record(), reads, up))

    def _finish(self, rnd, active: list, fresh: list, rec: dict, order: list) -> None:
        """The worker, after the last bucket of step ``rnd``: write-backs done, the state
        committed."""
        eng, port = self.engine, self.face.port
        with eng.lock:
            eng.tier.drain()
            rnd.finish(order)   # read ahead the next step's first buckets (during forward)
            eng.commit(active, fresh, port.state())
            eng.side.grads = None
        rnd.drop_grads()   # no reference to this step's gradients survives it
        tel, first = eng.tier.telemetry, rec["first"]
        began = rec["t_step"] if first is None else min(first, rec["t_step"])
        rec.update(kernel_s=eng.telemetry["kernel_s"] - rec["kernel0"],
                   nvme_s=tel["read_wait_s"] + tel["write_wait_s"] - rec["io0"],
                   pipeline_s=time.perf_counter() - began, done=True)

    def unwritten(self, bi: int) -> None:
        """Before the compute stream waits for bucket bi's upload (UploadWaits): a parameter of it
        written in place or re-pointed since step() was written before that wait, so the upload
        may land after the write and revert it. Raised once per parameter and step (then the next
        step adopts whatever the parameter holds once every upload landed, as after any write)."""
        g = self.engine.layout.buckets[bi].group
        for i in self.feed.params_of[bi]:
            if (g, i) in self._race_reported or not self.face.moved_since_step(g, i):
                continue
            self._race_reported.add((g, i))
            raise WriteRaceError(
                f"offload: parameter {i} of group {g} was written (or its .data replaced) after "
                "step() while its new weights were still being uploaded to the device, so the "
                "upload may land after the write and revert it. Call optimizer.synchronize() "
                "before writing parameters between steps (or before model.load_state_dict); "
                "docs/gpu.md, 'Writing the weights between steps'.")

    def reported(self, keys) -> None:
        """Writes of the parameters ``keys`` ({(gi, i)}) were reported already (a delayed step()
        refused them): the waits for their uploads do not report them again."""
        self._race_reported |= set(keys)

    def _check_sent(self, rnd) -> None:
        """Gradients of step ``rnd`` changed after they were sent (torch clipping / unscale_ on the
        device gradients)."""
        feed = self.feed
        for (gi, i), (ref, ver) in list(rnd.sent.items()):
            p = self.engine.groups[gi][i]
            now = p.grad
            g = None if ref is None else ref()
            if feed.release_grads:
                same = now is None
            else:
                same = g is not None and now is g and now._version == ver
            if same:
                continue
            if any(bi in rnd.done for bi in feed.buckets_of[(gi, i)]):
                raise RuntimeError(
                    "offload: gradients changed after they were sent to the CPU and stepped "
                    "during backward (e.g. torch.nn.utils.clip_grad_norm_ or GradScaler.unscale_ "
                    "on the device gradients). Use optimizer.clip_grad_norm_ / max_grad_norm= "
                    "and check_overflow=True (which turn off stepping during backward), or pass "
                    "step_during_backward=False. With transformers' Trainer or accelerate's "
                    "clip_grad_norm_: TrainingArguments(max_grad_norm=0) (no clipping by the "
                    "framework) and offload.AdamW(..., max_grad_norm=...).")
            rnd.forget((gi, i))
            if now is not None:
                self.capture(rnd, gi, i, p)

