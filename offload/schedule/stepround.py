"""schedule/stepround.py: StepRound, the bookkeeping of one step of the CPU worker's feed.

A BackwardFeed (schedule/backward.py) makes one when a step begins (its first gradient, or
``step()``) and keeps it until the next one begins: the worker may still finish its buckets after
``step()`` returned. The feed owns it; ``step()`` (schedule/feedstep.py FeedStep) receives it as an
argument. Its fields change only through its own methods.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, Optional

import numpy as np

from ..base.dist import local

__all__ = ["StepRound"]


class StepRound:
    def __init__(self, groups: list, params_of: list, hypers: Optional[dict] = None):
        """``groups``: the parameter lists; ``params_of``: per bucket, its parameters; ``hypers``:
        group -> its hyperparameters, read as the step began (the others are read when needed)."""
        self.open = False      # between the step's beginning and the end of its step()
        # (gi, i) -> (weakref to the grad, or None with release_grads; its version)
        self.sent: dict = {}
        # (gi, i) -> how many of its buckets' copies down are not issued yet
        self.unsent: dict = {}
        self.hypers: dict = {} if hypers is None else hypers
        self.missing = [len(ps) for ps in params_of]   # per bucket: parameters without a gradient
        self.dispatched: list = []   # queued buckets, in queue order
        self.down = 0                # queued buckets whose copies down were issued (worker)
        self.done: set = set()       # queued (training thread)
        self.stepped: set = set()    # stepped (worker)
        self.grads = [[None] * len(g) for g in groups]   # captured, until their copies down
        self.advanced = [np.zeros(len(g), dtype=bool) for g in groups]   # step counts advanced
        self.ups: list = []          # Upload of each queued bucket, in queue order
        self.ahead: Optional[list] = None   # set when the step finished: the next one's order
        self.marks: dict = {}        # the counters at the step's start (BackwardFeed.mark)

    def start(self) -> None:
        """The step is open: its beginning's checks passed."""
        self.open = True

    def close(self) -> None:
        """The step's step() returned (or its beginning failed): the worker may still run it."""
        self.open = False

    def mark(self, counters: dict) -> None:
        """The counters at the step's start (BackwardFeed.mark); ``first``: its first bucket
        queued."""
        self.marks = dict(counters, first=None)

    def hyper(self, gi: int, read: Callable[[int], dict]) -> dict:
        """Group ``gi``'s hyperparameters for this step: read once (``read``), then kept."""
        if gi not in self.hypers:
            self.hypers[gi] = read(gi)
        return self.hypers[gi]

    def grow(self, groups: list) -> None:
        """Groups were added (``groups``: every parameter list): room for their gradients and step
        marks (in place: the parameter side holds ``grads``)."""
        self.grads += [[None] * len(g) for g in groups[len(self.grads):]]
        self.advanced += [np.zeros(len(g), dtype=bool) for g in groups[len(self.advanced):]]

    def add_buckets(self, params_of: list) -> None:
        """The layout grew by buckets of these parameter lists: each waits for all its
        gradients."""
        self.missing += [len(ps) for ps in params_of]

    def capture(self, gi: int, i: int, g, nbuckets: int, release: bool) -> None:
        """Gradient ``g`` of parameter (gi, i) goes to its ``nbuckets`` buckets: held until the
        copy down of its last bucket is issued (sent_down); ``release``: p.grad goes at once."""
        self.grads[gi][i] = local(g)
        self.unsent[(gi, i)] = nbuckets
        self.sent[(gi, i)] = (None if release else weakref.ref(g), g._version)

    def arrived(self, key, buckets: list) -> list:
        """The first gradient of parameter ``key`` arrived: those of its ``buckets`` that have
        all their gradients with it."""
        ready = []
        for bi in buckets:
            self.missing[bi] -= 1
            if self.missing[bi] == 0:
                ready.append(bi)
        return ready

    def forget(self, key) -> None:
        """Parameter ``key``'s gradient changed after it was sent: it is captured again (or
        not)."""
        del self.sent[key]
        self.unsent.pop(key, None)
        self.grads[key[0]][key[1]] = None

    def first_steps(self, gi: int, params: list) -> list:
        """Of ``params`` of group ``gi`` being queued, those whose step count has not advanced yet
        in this step (sorted); marked as advanced."""
        adv = self.advanced[gi]
        first = sorted({i for i in params if not adv[i]})
        adv[first] = True
        return first

    def queue(self, bi: int, up) -> None:
        """Bucket ``bi`` queued with its upload ``up``; the first one marks the time."""
        if not self.dispatched:
            self.marks["first"] = time.perf_counter()   # the optimizer's part of the step starts
        self.dispatched.append(bi)
        self.done.add(bi)
        self.ups.append(up)

    def sent_down(self, gi: int, pieces) -> None:
        """The copies down of these pieces were issued: a gradient whose last bucket this was is no
        longer held."""
        for pc in pieces:
            key = (gi, pc.param)
            left = self.unsent.get(key, 0) - 1
            if left > 0:
                self.unsent[key] = left
            elif self.unsent.pop(key, None) is not None:
                self.grads[gi][pc.param] = None
        self.down += 1

    def held(self) -> int:
        """Queued buckets whose copies down are not issued yet."""
        return len(self.dispatched) - self.down

    def pending(self, order: list) -> list:
        """The queued buckets, then those of ``order`` not queued."""
        return self.dispatched + [bi for bi in order if bi not in self.done]

    def stepping(self, bi: int) -> None:
        """The worker steps bucket ``bi``."""
        self.stepped.add(bi)

    def finish(self, ahead: list) -> None:
        """The worker finished the step: ``ahead``, the next step's expected order, is read ahead
        during forward."""
        self.ahead = ahead

    def drop_grads(self) -> None:
        """No reference to the step's gradients survives it."""
        self.grads = [[None] * len(g) for g in self.grads]
        self.sent, self.unsent = {}, {}

    def wanted(self, order: list, nbuckets: int, depth: int) -> list:
        """The next ``depth`` buckets to read ahead: queued ones first (the worker may lag behind
        backward), then those of ``order``; after the step finished, ``ahead``."""
        if self.ahead is not None:
            return [bi for bi in self.ahead if bi < nbuckets][:depth]
        return [bi for bi in list(self.dispatched) + [bi for bi in order if bi not in self.done]
                if bi not in self.stepped and bi < nbuckets][:depth]

