"""schedule/delayed.py: the delayed update of device parameters (``delay_updates=1``): one step of staleness.

``step()`` of iteration t queues its CPU step (D2H of the gradients, the kernel, the NVMe traffic) as
the *pending update* and returns; that CPU step runs while the forward and backward of iteration t+1
run on the weights without it. The first ``delay_after`` updates are exact (``DelayedUpdates.step``
decides between CPU steps, from the optimizer's step count, so a resumed run decides as the
uninterrupted one did); until then ``HeldParams`` passes the weights through as ``DeviceParams`` does.
Once delayed, the kernel writes each bucket's new weights into a host buffer of
that bucket (``HeldParams``) instead of uploading them. ``step()`` of iteration t+1 first waits for
the pending CPU step, then uploads its weights (after t+1's backward on the compute stream), queues
its own CPU step and returns; the next forward waits bucket by bucket for those uploads, as in the
exact schedule (schedule/uploads.py). So with w_t the master weights after update t:

    w_t = AdamW(w_{t-1}, g_t),   g_t computed on w_{t-1} for t <= delay_after + 1, on w_{t-2} after

With ``delay_extrapolate=True`` the weights uploaded for a delayed update are predicted one step on,
w_{t-2} + (w_{t-2} - w_{t-3}) (``HeldParams._extrapolate``: when update t-3 was delayed too; else
w_{t-2}), so g_t is computed on that instead of w_{t-2}; the masters follow the same AdamW rule.
Anything that needs the current weights completes the pending update first (``DelayedUpdates.
synchronize``: ``opt.synchronize()``, ``state_dict()``, ``offload.save``, ``close()``, ``add_param_group``,
and a module's ``state_dict()`` / ``load_state_dict()``); the forward after that sees it. A skipped
step (overflow) completes the pending update and queues none. The device schedule (schedule/device_step.py)
uses this module through ``prepare`` and ``DelayedUpdates``; the worker (schedule/backward.py) does not
know about it: to it, ``publish`` is an upload that needs no wait.
Costs: host memory for one copy of the parameters in their dtype (pinned on CUDA; two to extrapolate,
plus a pass over them per step in the worker), and staleness.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..base.dist import is_dtensor, multi_rank
from ..params.device import DeviceParams
from .hooks import weak_hook
from .uploads import Upload

__all__ = ["DELAY_AFTER", "DelayedUpdates", "HeldParams", "prepare"]

DELAY_AFTER = 50   # exact steps before the delay starts, by default (bench/delayed.py --only loss: docs/gpu.md)


def prepare(overlap: bool, step_during_backward, small_param_numel, engine, delay_updates=0,
            delay_after=None, delay_extrapolate=None) -> tuple:
    """Validate ``delay_updates`` and ``delay_after`` against the other options (nothing changes on
    error); with a delay, the engine's parameter side becomes a ``HeldParams``. Returns (None (exact) or
    the number of exact steps before the delay, step_during_backward: False with a delay, which steps
    the buckets after backward)."""
    if isinstance(delay_updates, bool):
        delay_updates = int(delay_updates)
    if not isinstance(delay_updates, int) or delay_updates not in (0, 1):
        raise ValueError(f"delay_updates must be 0 (exact) or 1 (one step of delay), got {delay_updates!r}")
    if delay_after is not None and (isinstance(delay_after, bool) or not isinstance(delay_after, int)
                                    or delay_after < 0):
        raise ValueError(f"delay_after must be a number of steps >= 0, got {delay_after!r}")
    if not delay_updates:
        if delay_after is not None or delay_extrapolate is not None:
            raise ValueError("delay_after and delay_extrapolate apply with delay_updates=1 only: add "
                             "delay_updates=1 or leave them unset")
        return None, step_during_backward
    if not overlap:
        raise ValueError("delay_updates=1 cannot be combined with overlap=False (which runs the whole step inside "
                         "step()): leave overlap at its default")
    if step_during_backward:
        raise ValueError("delay_updates=1 steps the buckets after backward, during the next forward and backward; "
                         "it cannot be combined with step_during_backward=True (use one or the other)")
    if small_param_numel:
        raise ValueError("delay_updates=1 cannot be combined with small_param_numel (those parameters would be "
                         "updated at once, the others one step later): leave small_param_numel unset")
    if multi_rank() or any(is_dtensor(p) for ps in engine.groups for p in ps):
        raise ValueError("delay_updates=1 is not supported with several torch.distributed ranks or DTensor (FSDP2) "
                         "parameters: use delay_updates=0 (the exact schedule)")
    old = engine.side
    engine.side = HeldParams(old.groups, old.device, old.nslots, old.dtypes,
                             extrapolate=bool(delay_extrapolate))
    engine.side.allocate(engine.layout)
    old.close()
    return (DELAY_AFTER if delay_after is None else delay_after), False


class HeldParams(DeviceParams):
    """DeviceParams whose new weights wait in one host buffer per bucket until ``release`` (while
    ``hold``; otherwise, in the exact steps before the delay starts, a plain ``DeviceParams``)."""

    def __init__(self, groups, device, slots: int = 2, dtypes=None, extrapolate: bool = False):
        super().__init__(groups, device, slots, dtypes)
        self.extrapolate = extrapolate
        self.bufs: dict = {}      # bucket index -> host buffers of its weights (its staging layout; two to extrapolate)
        self.held: dict = {}      # bucket index -> (bucket, pieces) stepped and not uploaded yet
        self.reading: dict = {}   # (bucket index, buffer) -> event of the upload still reading that buffer
        self.hold = True          # set by DelayedUpdates.step, with no CPU step in flight
        self.cur: dict = {}       # extrapolate: bucket index -> (buffer of its latest weights, their pieces)
        self.pred: dict = {}      # extrapolate: bucket index -> buffer of the held weights extrapolated

    def allocate(self, layout) -> None:
        super().allocate(layout)
        for b in layout.buckets:
            if b.index not in self.bufs:
                self.bufs[b.index] = [self.device.host_empty(max(64, b.stage_bytes), torch.uint8)
                                      for _ in range(2 if self.extrapolate else 1)]

    @property
    def pinned_bytes(self) -> int:
        return super().pinned_bytes + sum(buf.numel() for bufs in self.bufs.values() for buf in bufs)

    def _free(self, bi: int, k: int):
        """Buffer k of bucket bi, once the last upload from it has read it."""
        ev = self.reading.pop((bi, k), None)
        if ev is not None:
            ev.synchronize()
        return self.bufs[bi][k]

    def _target(self, bi: int) -> int:
        """The buffer the kernel writes: not the one of the weights before (extrapolate)."""
        return 1 - self.cur[bi][0] if bi in self.cur else 0

    def ptrs(self, b, pieces, staged) -> list:
        """The kernel's pointers, its output redirected to the bucket's own buffer (once the last
        upload from that buffer has read it)."""
        rows = super().ptrs(b, pieces, staged)
        if not self.hold:
            return rows
        base = self._free(b.index, self._target(b.index)).data_ptr()
        return [(r[0], r[1], r[2], base + pc.boff, r[4]) for r, pc in zip(rows, pieces)]

    def publish(self, b, pieces, staged, after=None):
        """Nothing goes up now: the bucket's weights are held until ``release``."""
        if not self.hold:
            return super().publish(b, pieces, staged, after)
        self.held[b.index] = (b, list(pieces))
        if self.extrapolate:
            self._extrapolate(b, pieces)
        return None

    def _extrapolate(self, b, pieces) -> None:
        """(extrapolate) into the buffer of the weights before, w_{t-1}, for each piece the previous
        update stepped too: w_t + (w_t - w_{t-1}), computed in fp32 and rounded to the parameter's
        dtype; other pieces get w_t. Nothing to extrapolate from (the first delayed update, after a
        load): the held weights are w_t."""
        bi, k = b.index, self._target(b.index)
        keys = {(pc.param, pc.start, pc.n) for pc in pieces}
        if bi not in self.cur:
            self.cur[bi], self.pred[bi] = (k, keys), k
            return
        o, before = self.cur[bi][0], self.cur[bi][1]
        old_buf, dtypes = self._free(bi, o), self.dtypes[b.group]
        for pc in pieces:
            dtype = dtypes[pc.param]
            new, old = self._piece(self.bufs[bi][k], pc, dtype), self._piece(old_buf, pc, dtype)
            if (pc.param, pc.start, pc.n) in before:
                x = new.float()
                old.copy_(x + (x - old.float()))
            else:
                old.copy_(new)
        self.cur[bi], self.pred[bi] = (k, keys), o

    def release(self, after, order, actual: bool = False) -> list:
        """Upload every held bucket (after ``after``, the compute stream's event), in ``order`` first;
        returns their ``Upload`` records for the next forward's waits. With extrapolate, the weights
        extrapolated, or (``actual``) the new weights themselves."""
        for b, pieces in self.held.values():   # every destination first: a refusal uploads nothing
            for pc in pieces:
                self.flat_param(b.group, pc.param)
        held, self.held = self.held, {}
        ups = []
        first = [bi for bi in order if bi in held]
        for bi in first + sorted(set(held) - set(first)):
            b, pieces = held[bi]
            k = (self.cur[bi][0] if actual else self.pred[bi]) if self.extrapolate else 0
            buf, dtypes = self.bufs[bi][k], self.dtypes[b.group]
            pairs = [(self.flat_param(b.group, pc.param)[pc.start:pc.start + pc.n],
                      self._piece(buf, pc, dtypes[pc.param])) for pc in pieces]
            self.publishes += 1
            ev = self.device.copy_to_device(pairs, after)
            self.reading[(bi, k)] = self._last_up = ev
            with self._events_lock:
                self._events.append(("h2d", ev))
            self.stats["h2d_bytes"] += sum(d.numel() * d.element_size() for d, _ in pairs)
            up = Upload(bi)
            up.ev = ev
            up.issued.set()
            ups.append(up)
        return ups

    def discard(self) -> None:
        """A load replaced the state: the held weights are not the loaded ones."""
        self.held, self.cur, self.pred = {}, {}, {}

    def synchronize(self) -> None:
        super().synchronize()
        self.reading = {}


class DelayedUpdates:
    """The pending update of the device schedule: ``step`` releases the previous one and queues the
    next; ``synchronize`` completes it (the device weights are then the master weights). Updates up to
    the ``after``-th are exact: their CPU step uploads as in the deferred schedule."""

    def __init__(self, feed, side: HeldParams, device, after: int = 0):
        self.feed, self.side, self.device, self.after = feed, side, device, after
        self.pending = False   # a step() queued since the last synchronize
        feed.uploads.before_read = weak_hook(self, "before_read")   # a module's state_dict / load_state_dict

    def step(self, run: Callable[[], dict], skip: bool = False) -> dict:
        """``run`` queues this step's CPU step (the feed's step()); before it, the pending one is
        waited for and its weights go up after this backward; the next forward waits for those.
        Whether this update is held is decided here, between CPU steps, from the optimizer's step
        count (the largest of its parameters'; restored by a load) before it: held from ``after`` on.
        A skipped step queues none: the weights of the pending one go up as they are (not extrapolated)."""
        self.feed.synchronize()   # the pending CPU step: it ran during this forward and backward
        ups = self._release(actual=skip)
        self.side.hold = self.steps() >= self.after
        if not self.side.hold:   # an exact update: the feed's step starts its own uploads
            if ups:   # (none: the step count only grows, and a load discards what was held)
                self.feed.uploads.start(ups)
                self.feed.uploads.wait_all()
            return run()
        try:
            rec = run()
            self.pending = True
            return rec
        finally:
            self.feed.uploads.start(ups)

    def steps(self) -> int:
        """The optimizer's step count: updates applied so far (skipped steps do not count)."""
        return int(max((float(s.max()) for s in self.feed.engine.registry.steps if s.numel()), default=0))

    def wrap(self, feed_step: Callable[..., dict]) -> Callable[..., dict]:
        """The feed's step() (schedule/feedstep.py) as ``step`` runs it."""
        return lambda *args, **kw: self.step(lambda: feed_step(*args, **kw), kw.get("skip", False))

    def _release(self, actual: bool = False) -> list:
        if not self.side.held:
            return []
        return self.side.release(self.device.record(), self.feed.forward_order(), actual)

    def synchronize(self) -> None:
        """Complete the pending update: its CPU step done, its weights on the device."""
        self.feed.synchronize()
        self.pending = False
        ups = self._release(actual=True)
        if ups:
            self.feed.uploads.start(ups)
            self.feed.uploads.wait_all()

    def before_read(self) -> None:
        """(a module's state_dict / load_state_dict pre-hook) complete the pending update, if any."""
        if self.pending:
            self.synchronize()

    def recover(self) -> None:
        """A load replaced the state (and cleared a worker failure): nothing is pending any more."""
        self.side.discard()
        self.pending = False
        self.feed.recover()
