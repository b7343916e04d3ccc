"""schedule/feedstep.py: ``step()`` of the CPU worker's feed (schedule/backward.py), on the training thread.

It checks what the step may do (GradScaler, multiplier, gradients changed after they were sent),
validates the remaining gradients, queues every bucket not queued during backward (when nothing was:
in the order the first forward used the buckets, observed by a module pre-hook until the first step,
since their uploads are what the next forward waits for) and a ``finish`` job
that commits the state when the worker is done, then returns: the worker and the uploads run on
during the next forward (schedule/uploads.py). Also here: the observation of the first forward, and the
check that no parameter is written while its new weights are still going up.

A part of BackwardFeed (``feed.stepper``): the step's bookkeeping (sent, queued, done ...) stays the
feed's, read and changed here through its public attributes and methods.
"""
from __future__ import annotations

import math
import time
import weakref
from typing import Optional

import numpy as np
import torch

from ..base.dist import local
from ..params.base import check_grad
from .hooks import weak_module_hook
from .owners import ForwardObserver
from .uploads import Upload
from .worker import FinishJob, NudgeJob, StepJob

__all__ = ["FeedStep", "WriteRaceError"]


class WriteRaceError(RuntimeError):
    """A parameter was written while its new weights were still being uploaded (reported once)."""


class FeedStep:
    def __init__(self, feed):
        self.feed = feed
        self._race_reported: set = set()   # parameters whose racing write was reported (this step)
        self.seen: list = []         # buckets in the order the first forward used them (upload order)
        self.forward = ForwardObserver()
        # until the first step(): the order the first forward uses the buckets in (deferred schedule),
        # and the modules whose state_dict() must wait for uploads (uploads.note)
        self._observer = torch.nn.modules.module.register_module_forward_pre_hook(weak_module_hook(self, "observe"))

    def close(self) -> None:
        """Stop observing forwards (if still observing)."""
        if self._observer is not None:
            self._observer.remove()
            self._observer = None

    def observe(self, module, args=None) -> None:
        """Forward pre-hook until the first step(): the modules that run, in order (schedule/owners.py), and
        the modules whose state_dict() waits for their uploads (schedule/uploads.py note)."""
        feed = self.feed
        feed.uploads.note(module)
        self.forward.saw(module)

    def end_observation(self) -> None:
        """At the first step() after a forward: the forward order of the buckets, and the parameters
        modules read without running their owner (their waits and state_dict hooks)."""
        feed = self.feed
        if self._observer is None or not self.forward:
            return
        self._observer.remove()
        self._observer = None
        claims = self.forward.claims()
        for module, _, claimed, owners in claims:
            feed.uploads.claim(module, claimed)
            for owner in owners:
                feed.uploads.note(owner)
        self.seen = self.forward.order(claims, lambda p: feed.buckets_of.get(feed.key_of.get(id(p)), ()))

    def forward_order(self) -> list:
        """Buckets in first-use order (observed in the first forward), the rest in layout order."""
        feed = self.feed
        self.end_observation()
        known = set(self.seen)
        return self.seen + [b.index for b in feed.engine.layout.buckets if b.index not in known]

    def step(self, mult: float, grad_scale, found_inf, skip: bool = False, before=None) -> dict:
        """Queue what is left of this step and return at once; the returned record is completed by the
        worker (``done``). ``skip``: decided by the caller (overflow); ``before()``: runs first if not skipped."""
        feed = self.feed
        t_step = time.perf_counter()
        port = feed.face.port
        if not feed.in_cycle:
            feed.begin_cycle()
        early = bool(feed.dispatched)
        if feed.release_grads and found_inf is not None:
            raise RuntimeError("offload: release_grads=True cannot be combined with torch.amp.GradScaler (it reads "
                               "the device gradients after backward); use release_grads=False")
        if early and (grad_scale is not None or found_inf is not None):
            raise RuntimeError("offload: torch.amp.GradScaler needs check_overflow=True (or step_during_backward="
                               "False): buckets were already stepped during backward without the loss scale")
        if early and mult != 1.0:
            raise RuntimeError(f"offload: step(grad_multiplier={mult}) needs step_during_backward=False: buckets "
                               "are stepped during backward, before the multiplier is known")
        feed.raise_if_failed()
        eng = feed.engine
        marks = feed.marks
        rec = dict(done=False, t_step=t_step, side0=marks["side"], kernel0=marks["kernel"], io0=marks["io"])
        try:
            self._check_sent()
            if any(eng.groups[gi][i].grad is not None for gi, i in feed.unlaid):
                feed.wait_idle()   # the layout grows (tier, staging ring): nothing may be in flight
                feed.raise_if_failed()
            # validates the other gradients; lays out late ones (with the entries they have)
            eng.collect(port.groups(), keep_grads=False, state=port.state())
            feed.maps()
            feed.grads += [[None] * len(g) for g in eng.groups[len(feed.grads):]]
            feed.advanced += [np.zeros(len(g), dtype=bool) for g in eng.groups[len(feed.advanced):]]
            skip = skip or (found_inf is not None and float(found_inf) > 0)
            if not skip:
                if not math.isfinite(mult):
                    raise ValueError(f"grad_multiplier must be finite, got {mult}")
                if before is not None:
                    before()
                for gi, ps in enumerate(eng.groups):
                    for i, p in enumerate(ps):
                        if (gi, i) not in feed.sent and p.grad is not None and (gi, i) in feed.buckets_of:
                            self.capture(gi, i, p)
                order = feed.order if feed.eager else self.forward_order()
                if feed.eager:
                    self.end_observation()
                todo = [bi for bi in order if bi not in feed.done]
                buckets = eng.layout.buckets
                # all checked first; those read as backward began are kept for the whole step
                groups = {buckets[bi].group for bi in todo}
                hypers = {gi: feed.hypers.get(gi) or feed.face.port.hyper(gi) for gi in groups}
                for bi in todo:
                    self.dispatch(bi, mult, hypers)
            active = [np.zeros(len(g), dtype=bool) for g in eng.groups]
            if not skip:
                for gi, i in feed.sent:
                    active[gi][i] = True
                feed.side.stepped(active)   # versions up now (before _finish records them, in order)
            fresh = [(gi, i) for gi, a in enumerate(active) for i in np.flatnonzero(a & ~eng.registry.ready[gi])]
            rec.update(first=feed.marks["first"], buckets=0 if skip else len(feed.dispatched), skipped=skip)
            order = feed.dispatched + [bi for bi in feed.order if bi not in feed.done]
            feed.worker.put(FinishJob(lambda: self._finish(active, fresh, rec, order)))
        except BaseException as e:
            if feed.dispatched and feed.error is None:
                feed.fail(e, True)   # buckets were stepped: the state no longer matches any whole step
            raise
        finally:
            feed.order = feed.dispatched + [bi for bi in feed.order if bi not in feed.done]
            feed.in_cycle = False
            self._race_reported = set()
            feed.uploads.start(feed.ups)   # forward waits bucket by bucket
            if feed.error is not None and feed.reported:
                feed.give_up_uploads()   # (this step raised the failure)
            feed.worker.put(NudgeJob())   # read ahead the next step's first buckets during forward
        return rec

    def capture(self, gi: int, i: int, p) -> None:
        feed = self.feed
        eng = feed.engine
        g = p.grad
        check_grad(p, g, gi, i, eng.dtypes[gi][i], eng.numels[gi][i], eng.mode, True)
        feed.grads[gi][i] = local(g)   # held until the D2H of its last bucket is issued (_sent_down)
        feed.unsent[(gi, i)] = len(feed.buckets_of[(gi, i)])
        # the gradient itself is not held here: it is freed once copied down (and, with release_grads, at once)
        feed.sent[(gi, i)] = (None if feed.release_grads else weakref.ref(g), g._version)
        if feed.release_grads:
            p.grad = None

    def dispatch(self, bi: int, mult: float, hypers: Optional[dict] = None) -> None:
        feed = self.feed
        eng = feed.engine
        b = eng.layout.buckets[bi]
        sent = feed.sent
        act = [pc for pc in b.pieces if (b.group, pc.param) in sent]
        if not act:
            return
        if hypers is None:   # (during backward: once per group and step, not per bucket)
            hypers = feed.hypers
            if b.group not in hypers:
                hypers[b.group] = feed.face.port.hyper(b.group)
        h = hypers[b.group]
        adv = feed.advanced[b.group]
        first = sorted({pc.param for pc in act if not adv[pc.param]})
        adv[first] = True
        eng.registry.advance_params(b.group, first)
        if not feed.dispatched:
            feed.marks["first"] = time.perf_counter()   # the optimizer's part of the step starts here
        feed.dispatched.append(bi)
        feed.done.add(bi)
        up = Upload(bi)
        feed.ups.append(up)
        gr = feed.grads[b.group]
        reads = [(b.group, pc.param, gr[pc.param], gr[pc.param]._version) for pc in act]   # see _unchanged
        feed.worker.put(StepJob(b, act, eng.registry.has_state(b), h, mult, feed.device.record(), reads, up))

    def _finish(self, active: list, fresh: list, rec: dict, order: list) -> None:
        """The worker, after the step's last bucket: write-backs done, the state committed."""
        feed = self.feed
        eng, port = feed.engine, feed.face.port
        with eng.lock:
            feed.tier.drain()
            feed.ahead = order   # read ahead the next step's first buckets (during forward)
            eng.commit(active, fresh, port.state())
            feed.side.grads = None
        feed.grads = [[None] * len(g) for g in feed.grads]   # no reference to this step's gradients survives it
        feed.sent, feed.unsent = {}, {}
        tel, first = feed.tier.telemetry, rec["first"]
        rec.update(kernel_s=eng.telemetry["kernel_s"] - rec["kernel0"],
                   nvme_s=tel["read_wait_s"] + tel["write_wait_s"] - rec["io0"],
                   pipeline_s=time.perf_counter() - (rec["t_step"] if first is None else min(first, rec["t_step"])),
                   done=True)

    def unwritten(self, bi: int) -> None:
        """Before the compute stream waits for bucket bi's upload (UploadWaits): a parameter of it
        written in place or re-pointed since step() was written before that wait, so the upload may
        land after the write and revert it. Raised once per parameter and step (then the next step
        adopts whatever the parameter holds once every upload landed, as after any write)."""
        feed = self.feed
        g = feed.engine.layout.buckets[bi].group
        for i in feed.params_of[bi]:
            if (g, i) in self._race_reported or not feed.face.moved_since_step(g, i):
                continue
            self._race_reported.add((g, i))
            raise WriteRaceError(
                f"offload: parameter {i} of group {g} was written (or its .data replaced) after step() while its "
                "new weights were still being uploaded to the device, so the upload may land after the write and "
                "revert it. Call optimizer.synchronize() before writing parameters between steps (or before "
                "model.load_state_dict); docs/gpu.md, 'Writing the weights between steps'.")

    def reported(self, keys) -> None:
        """Writes of the parameters ``keys`` ({(gi, i)}) were reported already (a delayed step()
        refused them): the waits for their uploads do not report them again."""
        self._race_reported |= set(keys)

    def _check_sent(self) -> None:
        """Gradients changed after they were sent (torch clipping / unscale_ on the device gradients)."""
        feed = self.feed
        for (gi, i), (ref, ver) in list(feed.sent.items()):
            p = feed.engine.groups[gi][i]
            now = p.grad
            g = None if ref is None else ref()
            same = now is None if feed.release_grads else (g is not None and now is g and now._version == ver)
            if same:
                continue
            if any(bi in feed.done for bi in feed.buckets_of[(gi, i)]):
                raise RuntimeError(
                    "offload: gradients changed after they were sent to the CPU and stepped during backward "
                    "(e.g. torch.nn.utils.clip_grad_norm_ or GradScaler.unscale_ on the device gradients). "
                    "Use optimizer.clip_grad_norm_ / max_grad_norm= and check_overflow=True (which turn off "
                    "stepping during backward), or pass step_during_backward=False. With transformers' Trainer or "
                    "accelerate's clip_grad_norm_: TrainingArguments(max_grad_norm=0) (no clipping by the "
                    "framework) and offload.AdamW(..., max_grad_norm=...).")
            del feed.sent[(gi, i)]
            feed.unsent.pop((gi, i), None)
            feed.grads[gi][i] = None
            if now is not None:
                self.capture(gi, i, p)

