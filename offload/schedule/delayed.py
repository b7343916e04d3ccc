"""schedule/delayed.py: the delayed update of device parameters (``delay_updates=1``): one step of
staleness.

``step()`` of iteration t queues its CPU step (D2H of the gradients, the kernel, the NVMe traffic)
as the *pending update* and returns; that CPU step runs while the forward and backward of iteration
t+1 run on the weights without it. The first ``delay_after`` updates are exact
(``DelayedUpdates.step`` decides between CPU steps, from the optimizer's step count, so a resumed
run decides as the uninterrupted one did); until then ``HeldParams`` passes the weights through as
``DeviceParams`` does. Once delayed, the kernel writes each bucket's new weights into a host buffer
of that bucket (``HeldParams``) instead of uploading them. ``step()`` of iteration t+1 first waits
for the pending CPU step, then uploads its weights (after t+1's backward on the compute stream),
queues its own CPU step and returns; the next forward waits bucket by bucket for those uploads, as
in the exact schedule (schedule/uploads.py). So with w_t the master weights after update t:

    w_t = AdamW(w_{t-1}, g_t),   g_t computed on w_{t-1} for t <= delay_after + 1, on w_{t-2} after

With ``delay_extrapolate=True`` the weights uploaded for a delayed update are predicted one step
on, w_{t-2} + (w_{t-2} - w_{t-3}) (``HeldParams._extrapolate``: where update t-3 was delayed too
and stepped the piece; else w_{t-2}), so g_t is computed on that instead of w_{t-2}; the masters
follow the same AdamW rule. A prediction is never taken for the weights: a piece an update does not
step gets its true weights back when that update goes up (``HeldParams.release``). Anything that
needs the current weights completes the pending update first (``DelayedUpdates. synchronize``:
``opt.synchronize()``, ``state_dict()``, ``offload.save``, ``close()``, ``add_param_group``, and a
module's ``state_dict()`` / ``load_state_dict()``); the forward after that sees it, and the next
delayed update is not extrapolated, as after a load (a resumed run is the uninterrupted one). So
does a ``step()`` after a parameter's state was deleted (its fresh master is read from the
parameter); a parameter written while an update is pending is refused by ``step()``
(``adoptable``). A skipped step (overflow) completes the pending update and queues none. The device
schedule (schedule/device_step.py) uses this module through ``prepare`` and ``DelayedUpdates``; the
worker (schedule/backward.py) does not know about it: to it, ``publish`` is an upload that needs no
wait. Costs: host memory for one copy of the parameters in their dtype (pinned on CUDA; two to
extrapolate, plus a pass over them per step in the worker), and staleness.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ..base.dist import is_dtensor, multi_rank
from ..params.device import DeviceParams, piece
from ..params.side import SideOver
from .feedstep import WriteRaceError
from .hooks import weak_hook
from .uploads import Upload

__all__ = ["DELAY_AFTER", "DelayedUpdates", "HeldParams", "held_side", "prepare"]

# exact steps before the delay starts, by default (bench/delayed.py --only loss: docs/gpu.md)
DELAY_AFTER = 50


def _delay(delay_updates):
    """``delay_updates`` as the int it stands for (bools are ints); None if neither 0 nor 1."""
    if isinstance(delay_updates, bool):
        delay_updates = int(delay_updates)
    return delay_updates if isinstance(delay_updates, int) and delay_updates in (0, 1) else None


def held_side(delay_updates=0, delay_extrapolate=None):
    """How the state engine's device side is built for these options (params/__init__.py
    side_maker's ``wrap``): a ``HeldParams`` over it with ``delay_updates=1``, else None (the plain
    side). ``prepare`` checks the options, with the others, when the schedule starts."""
    if _delay(delay_updates) != 1:
        return None
    return lambda side: HeldParams(side, extrapolate=bool(delay_extrapolate))


def prepare(overlap: bool, step_during_backward, small_param_numel, engine, delay_updates=0,
            delay_after=None, delay_extrapolate=None) -> tuple:
    """Validate ``delay_updates`` and ``delay_after`` against the other options (nothing changes
    on error; with a delay, the engine's side was built a ``HeldParams``: ``held_side``). Returns
    (None (exact) or the number of exact steps before the delay, step_during_backward: False with
    a delay, which steps the buckets after backward)."""
    given, delay_updates = delay_updates, _delay(delay_updates)
    if delay_updates is None:
        raise ValueError("delay_updates must be 0 (exact) or 1 (one step of "
                         f"delay), got {given!r}")
    if delay_after is not None and (isinstance(delay_after, bool)
                                    or not isinstance(delay_after, int)
                                    or delay_after < 0):
        raise ValueError(f"delay_after must be a number of steps >= 0, got {delay_after!r}")
    if not delay_updates:
        if delay_after is not None or delay_extrapolate is not None:
            raise ValueError("delay_after and delay_extrapolate apply with delay_updates=1 only: "
                             "add delay_updates=1 or leave them unset")
        return None, step_during_backward
    if not overlap:
        raise ValueError("delay_updates=1 cannot be combined with overlap=False (which runs the "
                         "whole step inside step()): leave overlap at its default")
    if step_during_backward:
        raise ValueError("delay_updates=1 steps the buckets after backward, during the next "
                         "forward and backward; it cannot be combined with "
                         "step_during_backward=True (use one or the other)")
    if small_param_numel:
        raise ValueError("delay_updates=1 cannot be combined with small_param_numel (those "
                         "parameters would be updated at once, the others one step later): leave "
                         "small_param_numel unset")
    if multi_rank() or any(is_dtensor(p) for ps in engine.groups for p in ps):
        raise ValueError("delay_updates=1 is not supported with several torch.distributed ranks "
                         "or DTensor (FSDP2) parameters: use delay_updates=0 (the exact schedule)")
    return (DELAY_AFTER if delay_after is None else delay_after), False


def _key(pc) -> tuple:
    """A piece of a bucket, by what it holds."""
    return pc.param, pc.start, pc.n


class HeldParams(SideOver):
    """The side of device parameters ``inner`` (params/device.py), whose new weights wait in one
    host buffer per bucket until ``release`` (while ``hold``; otherwise, in the exact steps before
    the delay starts, every call is ``inner``'s)."""

    def __init__(self, inner: DeviceParams, extrapolate: bool = False):
        super().__init__(inner)
        self.device, self.dtypes = inner.device, inner.dtypes   # (the engine's list: it grows)
        self.extrapolate = extrapolate
        # bucket index -> host buffers of its weights (its staging layout; two to extrapolate)
        self.bufs: dict = {}
        self.held: dict = {}      # bucket index -> (bucket, pieces) stepped and not uploaded yet
        # (bucket index, buffer) -> event of the upload still reading that buffer
        self.reading: dict = {}
        self.hold = True          # set by DelayedUpdates.step, with no CPU step in flight
        # extrapolate: bucket index -> (the buffer of its latest weights, the keys of the pieces
        # the last update stepped: extrapolated by the next one), the buffer of the held weights
        # extrapolated, the pieces of those that are a prediction, and (bucket, pieces) of the
        # predictions on the device now (their weights go up once an update did not step them)
        self.cur: dict = {}
        self.pred: dict = {}
        self.ext: dict = {}
        self.shown: dict = {}

    def allocate(self, layout) -> None:
        self.inner.allocate(layout)
        new = {b.index: [self.device.host_empty(max(64, b.stage_bytes), torch.uint8)
                         for _ in range(2 if self.extrapolate else 1)]
               for b in layout.buckets if b.index not in self.bufs}
        self.bufs.update(new)   # (all or none)

    def drop_buckets(self, buckets) -> None:
        """The layout lost ``buckets`` (indices; a growth that was undone): their buffers go (a
        bucket laid out later under the same index may need another size)."""
        self.inner.drop_buckets(buckets)
        for bi in buckets:
            self.bufs.pop(bi, None)

    @property
    def pinned_bytes(self) -> int:
        held = sum(buf.numel() for bufs in self.bufs.values() for buf in bufs)
        return self.inner.pinned_bytes + held

    def info(self, layout) -> dict:
        return dict(self.inner.info(layout), staging_bytes=self.pinned_bytes)

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
        rows = self.inner.ptrs(b, pieces, staged)
        if not self.hold:
            return rows
        base = self._free(b.index, self._target(b.index)).data_ptr()
        return [(r[0], r[1], r[2], base + pc.boff, r[4]) for r, pc in zip(rows, pieces)]

    def publish(self, b, pieces, staged, after=None):
        """Nothing goes up now: the bucket's weights are held until ``release``."""
        if not self.hold:
            return self.inner.publish(b, pieces, staged, after)
        self.held[b.index] = (b, list(pieces))
        if self.extrapolate:
            self._extrapolate(b, pieces)
        return None

    def _extrapolate(self, b, pieces) -> None:
        """(extrapolate) into the buffer of the weights before, w_{t-1}, for each piece the
        previous update stepped too: w_t + (w_t - w_{t-1}), computed in fp32 and rounded to the
        parameter's dtype; other pieces get w_t. Nothing to extrapolate from (the first delayed
        update, after a load or ``forget``): the held weights are w_t. The pieces of that buffer
        this update did not step keep their weights: ``release`` sends them up where a prediction
        of them is shown."""
        bi, k = b.index, self._target(b.index)
        keys = {_key(pc) for pc in pieces}
        if bi not in self.cur:
            self.cur[bi], self.pred[bi], self.ext[bi] = (k, keys), k, []
            return
        o, before = self.cur[bi][0], self.cur[bi][1]
        old_buf, dtypes, ext = self._free(bi, o), self.dtypes[b.group], []
        for pc in pieces:
            dtype = dtypes[pc.param]
            new, old = piece(self.bufs[bi][k], pc, dtype), piece(old_buf, pc, dtype)
            if _key(pc) in before:
                x = new.float()
                old.copy_(x + (x - old.float()))
                ext.append(pc)
            else:
                old.copy_(new)
        self.cur[bi], self.pred[bi], self.ext[bi] = (k, keys), o, ext

    def release(self, after, order, actual: bool = False, update: bool = False) -> list:
        """Upload every held bucket (after ``after``, the compute stream's event), in ``order``
        first; returns their ``Upload`` records for the next forward's waits. With extrapolate, the
        weights extrapolated, or (``actual``) the new weights themselves; and the true weights of
        each piece whose prediction is on the device but which this update did not step
        (``update``: an update was queued since the last release; the next one extrapolates no
        piece it did not step). Every destination is checked first: a refusal uploads nothing."""
        for b, pieces in list(self.held.values()) + list(self.shown.values()):
            for pc in pieces:
                self.inner.flat_param(b.group, pc.param)
        held, self.held = self.held, {}
        shown, self.shown = self.shown, {}
        if update:
            for bi, (k, _) in list(self.cur.items()):
                if bi not in held:
                    self.cur[bi] = (k, frozenset())
        ups = []
        todo = set(held) | set(shown)
        first = [bi for bi in order if bi in todo]
        for bi in first + sorted(todo - set(first)):
            b, parts = self._sources(bi, held, shown, actual)
            dtypes = self.dtypes[b.group]
            pairs = [(self.inner.flat_param(b.group, pc.param)[pc.start:pc.start + pc.n],
                      piece(self.bufs[bi][k], pc, dtypes[pc.param])) for pc, k in parts]
            ev = self.inner.upload(pairs, after)
            for k in {k for _, k in parts}:
                self.reading[(bi, k)] = ev
            up = Upload(bi)
            up.ev = ev
            up.issued.set()
            ups.append(up)
            if bi in held and not actual and self.ext.get(bi):
                self.shown[bi] = (b, self.ext[bi])
        return ups

    def _sources(self, bi: int, held: dict, shown: dict, actual: bool) -> tuple:
        """(bucket, [(piece, index of the buffer it goes up from)]) of bucket bi at a release."""
        # not stepped by this update: its latest weights replace the prediction
        if bi not in held:
            b, pieces = shown[bi]
            return b, [(pc, self.cur[bi][0]) for pc in pieces]
        b, pieces = held[bi]
        k = (self.cur[bi][0] if actual else self.pred[bi]) if self.extrapolate else 0
        parts = [(pc, k) for pc in pieces]
        # predicted by the update before and not stepped now: their weights are in
        if bi in shown:
            # the buffer of that update (this kernel left them)
            keys = {_key(pc) for pc in pieces}
            parts += [(pc, self.pred[bi]) for pc in shown[bi][1] if _key(pc) not in keys]
        return b, parts

    def discard(self) -> None:
        """A load replaced the state: the held weights are not the loaded ones."""
        self.held, self.shown = {}, {}
        self.forget()

    def forget(self) -> None:
        """The next delayed update extrapolates nothing (its weights go up as they are)."""
        self.cur, self.pred, self.ext = {}, {}, {}

    def synchronize(self) -> None:
        self.inner.synchronize()
        self.reading = {}


class DelayedUpdates:
    """The pending update of the device schedule: ``step`` releases the previous one and queues the
    next; ``synchronize`` completes it (the device weights are then the master weights). Updates up
    to the ``after``-th are exact: their CPU step uploads as in the deferred schedule."""

    def __init__(self, feed, side: HeldParams, device, after: int = 0):
        if not isinstance(side, HeldParams):   # (the side is fixed when the engine is built)
            raise TypeError("delay_updates=1 needs a state engine built with the "
                            "side of held_side()")
        self.feed, self.side, self.device, self.after = feed, side, device, after
        self.pending = False   # an update queued and not on the device yet (no synchronize since)
        self.update = False    # an update queued since the last release
        # a module's state_dict / load_state_dict
        feed.uploads.before_read = weak_hook(self, "before_read")

    def step(self, run: Callable[[], dict], skip: bool = False) -> dict:
        """``run`` queues this step's CPU step (the feed's step()); before it, the pending one is
        waited for and its weights go up after this backward; the next forward waits for those.
        First the edits of ``opt.state`` are adopted and a parameter written while an update is
        pending is refused (``feed.begin_cycle``: it held the weights without the update, not the
        masters); a state deleted meanwhile completes the pending update first, so that its fresh
        master is the parameter's true weight. Whether this update is held is decided then, between
        CPU steps, from the optimizer's step count (the largest of its parameters'; restored by a
        load): held from ``after`` on. A skipped step queues none: the weights of the pending one
        go up as they are (not extrapolated)."""
        feed = self.feed
        feed.synchronize()   # the pending CPU step: it ran during this forward and backward
        with_state = self._with_state()
        feed.begin_cycle()
        try:
            if self.pending and self._with_state() < with_state:
                self.synchronize()
            ups = self._release(actual=skip)
            feed.mark()   # (the release's copies belong to the step before)
        except BaseException:
            feed.end_cycle()
            raise
        self.side.hold = self.steps() >= self.after
        if not self.side.hold:   # an exact update: the feed's step starts its own uploads
            self.pending = False
            if ups:
                feed.uploads.start(ups)
                feed.uploads.wait_all()
            return run()
        try:
            rec = run()
            self.pending = self.update = not skip
            return rec
        finally:
            feed.uploads.start(ups)

    def _with_state(self) -> int:
        """How many parameters have state."""
        return sum(int(np.count_nonzero(r)) for r in self.feed.engine.registry.ready)

    def steps(self) -> int:
        """The optimizer's step count: updates applied so far (skipped steps do not count). A NaN
        or infinite count (opt.state edited) counts as none: the step refuses it (registry.py)."""
        steps = self.feed.engine.registry.steps
        top = max((float(s.max()) for s in steps if s.numel()), default=0.0)
        return int(top) if math.isfinite(top) else 0

    def wrap(self, feed_step: Callable[..., dict]) -> Callable[..., dict]:
        """The feed's step() (schedule/feedstep.py) as ``step`` runs it."""
        return lambda *args, **kw: self.step(lambda: feed_step(*args, **kw), kw.get("skip", False))

    def _release(self, actual: bool = False) -> list:
        update, self.update = self.update, False
        if not (self.side.held or self.side.shown or update):
            return []
        return self.side.release(self.device.record(), self.feed.forward_order(), actual, update)

    def synchronize(self) -> None:
        """Complete the pending update: its CPU step done, its weights on the device (those of
        every parameter: no prediction stays there). The next delayed update is not extrapolated,
        as after a load, so that a run resumed from a checkpoint is the uninterrupted run."""
        self.feed.synchronize()
        self.pending = False
        ups = self._release(actual=True)
        if ups:
            self.feed.uploads.start(ups)
            self.feed.uploads.wait_all()
        self.side.forget()

    def adoptable(self, written: set) -> bool:
        """Parameters ``written`` ({(gi, i)}) since the last step() are adopted (their masters
        re-read): True, unless an update is pending (the write went into the weights without it,
        and it would go up over the write): then refused by name."""
        if self.pending:
            gi, i = min(written)
            # (synchronize() then sends the update up over it)
            self.feed.stepper.reported(written)
            raise WriteRaceError(
                f"offload: parameter {i} of group {gi} was written (or its .data replaced) while "
                "an update of delay_updates=1 was pending: the write went into the weights "
                "without that update (what the forward saw), not into the optimizer's, and the "
                "update would go up over it. Nothing was stepped. Call optimizer.synchronize() "
                "before writing parameters between steps (after it, write the parameter again); "
                "docs/gpu.md, 'Delayed update'.")
        return True

    def before_read(self) -> None:
        """(a module's state_dict / load_state_dict pre-hook) complete the pending update, if
        any."""
        if self.pending or self.side.shown:
            self.synchronize()

    def recover(self) -> None:
        """A load replaced the state (and cleared a worker failure): nothing is pending any
        more."""
        self.side.discard()
        self.pending = False
        self.feed.recover()
