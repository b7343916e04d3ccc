"""step/feedstep.py: ``step()`` of the CPU worker's feed (step/backward.py), on the training thread.

It checks what the step may do (GradScaler, multiplier, gradients changed after they were sent),
validates the remaining gradients, queues every bucket not queued during backward (when nothing was:
in the order the first forward used the buckets, observed by a module pre-hook until the first step,
since their uploads are what the next forward waits for) and a ``finish`` job
that commits the state when the worker is done, then returns: the worker and the uploads run on
during the next forward (step/uploads.py). A mixin of BackwardFeed, using its attributes.
"""
from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["FeedStep", "WriteRaceError"]


class WriteRaceError(RuntimeError):
    """A parameter was written while its new weights were still being uploaded (reported once)."""


class FeedStep:
    def observe(self, module, args=None) -> None:
        """Forward pre-hook until the first step(): the modules that run, in order (step/owners.py), and
        the modules whose state_dict() waits for their uploads (step/uploads.py note)."""
        self.uploads.note(module)
        self.forward.saw(module)

    def end_observation(self) -> None:
        """At the first step() after a forward: the forward order of the buckets, and the parameters
        modules read without running their owner (their waits and state_dict hooks)."""
        if self._observer is None or not self.forward:
            return
        self._observer.remove()
        self._observer = None
        claims = self.forward.claims()
        for module, _, claimed, owners in claims:
            self.uploads.claim(module, claimed)
            for owner in owners:
                self.uploads.note(owner)
        self.seen = self.forward.order(claims, lambda p: self.buckets_of.get(self.key_of.get(id(p)), ()))

    def forward_order(self) -> list:
        """Buckets in first-use order (observed in the first forward), the rest in layout order."""
        self.end_observation()
        known = set(self.seen)
        return self.seen + [b.index for b in self.engine.layout.buckets if b.index not in known]

    def step(self, mult: float, grad_scale, found_inf, skip: bool = False, before=None) -> dict:
        """Queue what is left of this step and return at once; the returned record is completed by the
        worker (``done``). ``skip``: decided by the caller (overflow); ``before()``: runs first if not skipped."""
        t_step = time.perf_counter()
        port = self.face.port
        if not self.in_cycle:
            self._begin()
        early = bool(self.dispatched)
        if self.release_grads and found_inf is not None:
            raise RuntimeError("offload: release_grads=True cannot be combined with torch.amp.GradScaler (it reads "
                               "the device gradients after backward); use release_grads=False")
        if early and (grad_scale is not None or found_inf is not None):
            raise RuntimeError("offload: torch.amp.GradScaler needs check_overflow=True (or step_during_backward="
                               "False): buckets were already stepped during backward without the loss scale")
        if early and mult != 1.0:
            raise RuntimeError(f"offload: step(grad_multiplier={mult}) needs step_during_backward=False: buckets "
                               "are stepped during backward, before the multiplier is known")
        self._raise_if_failed()
        eng = self.engine
        rec = dict(done=False, t_step=t_step, side0=self._t["side"], kernel0=self._t["kernel"], io0=self._t["io"])
        try:
            self._check_sent()
            if any(eng.groups[gi][i].grad is not None for gi, i in self.unlaid):
                self.wait_idle()   # the layout grows (tier, staging ring): nothing may be in flight
                self._raise_if_failed()
            eng.collect(port.groups(), keep_grads=False)   # validates the other gradients; lays out late ones
            self._maps()
            self.grads += [[None] * len(g) for g in eng.groups[len(self.grads):]]
            self.advanced += [np.zeros(len(g), dtype=bool) for g in eng.groups[len(self.advanced):]]
            skip = skip or (found_inf is not None and float(found_inf) > 0)
            if not skip:
                if not math.isfinite(mult):
                    raise ValueError(f"grad_multiplier must be finite, got {mult}")
                if before is not None:
                    before()
                for gi, ps in enumerate(eng.groups):
                    for i, p in enumerate(ps):
                        if (gi, i) not in self.sent and p.grad is not None and (gi, i) in self.buckets_of:
                            self._capture(gi, i, p)
                order = self.order if self.eager else self.forward_order()
                if self.eager:
                    self.end_observation()
                todo = [bi for bi in order if bi not in self.done]
                buckets = eng.layout.buckets
                hypers = {gi: self.hyper(gi) for gi in {buckets[bi].group for bi in todo}}   # all checked first
                for bi in todo:
                    self._dispatch(bi, mult, hypers)
            active = [np.zeros(len(g), dtype=bool) for g in eng.groups]
            if not skip:
                for gi, i in self.sent:
                    active[gi][i] = True
            fresh = [(gi, i) for gi, a in enumerate(active) for i in np.flatnonzero(a & ~eng.registry.ready[gi])]
            rec.update(first=self._t["first"], buckets=0 if skip else len(self.dispatched), skipped=skip)
            order = self.dispatched + [bi for bi in self.order if bi not in self.done]
            self._q.put(("finish", lambda: self._finish(active, fresh, rec, order)))
        except BaseException as e:
            if self.dispatched and self.error is None:
                self._failed(e, True)   # buckets were stepped: the state no longer matches any whole step
            raise
        finally:
            self.order = self.dispatched + [bi for bi in self.order if bi not in self.done]
            self.in_cycle = False
            self._race_reported = set()
            self.uploads.start(self.ups)   # forward waits bucket by bucket
            if self.error is not None and self._reported:
                self._give_up_uploads()   # (this step raised the failure)
            self._q.put(("nudge",))   # read ahead the next step's first buckets during forward
        return rec

    def _finish(self, active: list, fresh: list, rec: dict, order: list) -> None:
        """The worker, after the step's last bucket: write-backs done, the state committed."""
        eng, port = self.engine, self.face.port
        with eng.lock:
            self.tier.drain()
            self.ahead = order   # read ahead the next step's first buckets (during forward)
            eng.commit(active, fresh, port.state())
            self.side.grads = None
        self.grads = [[None] * len(g) for g in self.grads]   # no reference to this step's gradients survives it
        self.sent, self.unsent = {}, {}
        tel, first = self.tier.telemetry, rec["first"]
        rec.update(kernel_s=eng.telemetry["kernel_s"] - rec["kernel0"],
                   nvme_s=tel["read_wait_s"] + tel["write_wait_s"] - rec["io0"],
                   pipeline_s=time.perf_counter() - (rec["t_step"] if first is None else min(first, rec["t_step"])),
                   done=True)

    def _raise_if_failed(self) -> None:
        """Report the worker's failure: StoreFailedError naming it, every time until a load. The first
        report gives up the uploads (_give_up_uploads), so that no forward or model.load_state_dict
        waits for them again (and raises again) and none lands after the user restored the weights."""
        if self.error is not None:
            if not self._reported or self.uploads.pending:
                self._give_up_uploads()
            self._reported = True
            self.tier.fail(self.error)   # (kept if the tier has its own first failure)
            self.tier.check_usable()     # StoreFailedError naming the first failure

    def check_usable(self) -> None:
        """StoreFailedError if the worker or the tier failed (a step failed part-way) and no state was
        loaded since."""
        self._raise_if_failed()
        self.tier.check_usable()

    def _give_up_uploads(self) -> None:
        """The worker failed: it finishes what is queued (it steps and uploads nothing more), the compute
        stream waits for the uploads it issued before the failure, and none is waited for again."""
        self.wait_idle()
        self.uploads.abandon()

    def _unwritten(self, bi: int) -> None:
        """Before the compute stream waits for bucket bi's upload (UploadWaits): a parameter of it
        written in place or re-pointed since step() was written before that wait, so the upload may
        land after the write and revert it. Raised once per parameter and step (then the next step
        adopts whatever the parameter holds once every upload landed, as after any write)."""
        g = self.engine.layout.buckets[bi].group
        for i in self.params_of[bi]:
            if (g, i) in self._race_reported or not self.face.moved_since_step(g, i):
                continue
            self._race_reported.add((g, i))
            raise WriteRaceError(
                f"offload: parameter {i} of group {g} was written (or its .data replaced) after step() while its "
                "new weights were still being uploaded to the device, so the upload may land after the write and "
                "revert it. Call optimizer.synchronize() before writing parameters between steps (or before "
                "model.load_state_dict); docs/gpu.md, 'Writing the weights between steps'.")

    def _check_sent(self) -> None:
        """Gradients changed after they were sent (torch clipping / unscale_ on the device gradients)."""
        for (gi, i), (ref, ver) in list(self.sent.items()):
            p = self.engine.groups[gi][i]
            now = p.grad
            g = None if ref is None else ref()
            same = now is None if self.release_grads else (g is not None and now is g and now._version == ver)
            if same:
                continue
            if any(bi in self.done for bi in self.buckets_of[(gi, i)]):
                raise RuntimeError(
                    "offload: gradients changed after they were sent to the CPU and stepped during backward "
                    "(e.g. torch.nn.utils.clip_grad_norm_ or GradScaler.unscale_ on the device gradients). "
                    "Use optimizer.clip_grad_norm_ / max_grad_norm= and check_overflow=True (which turn off "
                    "stepping during backward), or pass step_during_backward=False. With transformers' Trainer or "
                    "accelerate's clip_grad_norm_: TrainingArguments(max_grad_norm=0) (no clipping by the "
                    "framework) and offload.AdamW(..., max_grad_norm=...).")
            del self.sent[(gi, i)]
            self.unsent.pop((gi, i), None)
            self.grads[gi][i] = None
            if now is not None:
                self._capture(gi, i, p)

