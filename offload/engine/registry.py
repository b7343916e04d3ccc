"""engine/registry.py: which parameter has state, its step count, and fresh-state creation.

Step counts are fp32 like torch's, one vector per group; ``state['step']`` entries are 0-dim views
of them. A parameter's state is created at its first step exactly as the RAM mode does (zeros,
fp32 master = the parameter), so every tier gives bitwise the same results.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from ..base.tensors import bump_versions
from ..state.layout import piece_columns

__all__ = ["Registry", "MAX_STEP", "count_error"]

MAX_STEP = 2 ** 62   # the largest step count taken (the kernel's is an int64, after one more step)


class Registry:
    def __init__(self, sizes: Sequence[int]):
        self.steps: List[torch.Tensor] = []
        self.ready: List[np.ndarray] = []
        # gi -> (steps[gi], its numpy view): Tensor.numpy() costs ~45 us on cold caches
        self._counts: dict = {}
        self._valid: dict = {}    # gi -> (steps[gi], its _version) when check() found it valid
        self.grow(sizes)

    def counts(self, gi: int) -> np.ndarray:
        """Group ``gi``'s step counts as a numpy view of ``steps[gi]`` (the same memory)."""
        t = self.steps[gi]
        got = self._counts.get(gi)
        if got is None or got[0] is not t:
            got = self._counts[gi] = (t, t.numpy())
        return got[1]

    def grow(self, sizes: Sequence[int]) -> None:
        """Groups added (``add_param_group``): ``sizes`` lists every group's parameter count."""
        for n in sizes[len(self.steps):]:
            self.steps.append(torch.zeros(n, dtype=torch.float32))
            self.ready.append(np.zeros(n, dtype=bool))

    def drop_groups(self, gi: int) -> None:
        """Undo ``grow`` from group ``gi`` on (an add_param_group that failed part-way)."""
        del self.steps[gi:]
        del self.ready[gi:]

    def has_state(self, b) -> bool:
        return bool(self.ready[b.group][piece_columns(b, b.pieces, "param")[0]].any())

    def init_fresh(self, b, pieces: Sequence, blk, read_master: Callable) -> None:
        """First step of a piece's parameter: zero moments; master = the parameter
        (read_master)."""
        r = self.ready[b.group]
        if r[piece_columns(b, pieces, "param")[0]].all():
            return   # (every warm step: no Python per piece)
        data = blk.data[:b.nbytes]
        f32 = data.view(torch.float32)
        for pc in pieces:
            if r[pc.param]:
                continue
            for key, _size in b.keys:
                if key == "master_param":
                    sec = b.section(key) // 4 + pc.pos
                    read_master(b.group, pc.param, pc.start, pc.n, f32[sec:sec + pc.n])
                else:   # every moment format's zero state is all-zero bytes
                    off, nb = b.span(key, pc)
                    data[off:off + nb].zero_()

    def advance(self, active: Sequence[np.ndarray]) -> None:
        """One more step for the parameters ``active`` (per group, bool masks). Through numpy (the
        same fp32 additions, without a torch op per group: cheaper when the step's memory traffic
        has evicted torch's code from the caches); the version counters move as torch's +=
        would."""
        moved = []
        for gi, a in enumerate(active):
            if a.any():
                s = self.counts(gi)
                if a.all():
                    s += np.float32(1)   # (every parameter has a gradient: no masked update)
                else:
                    s[a] += np.float32(1)
                moved.append(self.steps[gi])
        valid = [gi for gi, t in enumerate(self.steps) if self._checked(gi, t)]
        bump_versions(moved)
        for gi in valid:   # a valid count one step on is still valid
            self._valid[gi] = (self.steps[gi], self.steps[gi]._version)

    def advance_all(self, groups: Sequence[int]) -> None:
        """advance() with every parameter of the (non-empty) groups ``groups`` active, every count
        valid (:meth:`valid`): the planned step (engine/fastpath.py)."""
        one, steps = np.float32(1), self.steps
        for gi in groups:
            s = self.counts(gi)
            s += one
        bump_versions([steps[gi] for gi in groups])
        for gi in groups:
            t = steps[gi]
            self._valid[gi] = (t, t._version)

    def valid(self) -> bool:
        """Every group's step counts found valid by :meth:`check` and not written since."""
        return all(self._checked(gi, t) for gi, t in enumerate(self.steps))

    def advance_params(self, gi: int, idx: Sequence[int]) -> None:
        """One more step for parameters ``idx`` of group ``gi`` (the device schedule, bucket by
        bucket as backward delivers them): the same additions and version counters as
        :meth:`advance`."""
        if not len(idx):
            return
        t = self.steps[gi]
        valid = self._checked(gi, t)
        self.counts(gi)[np.asarray(idx, dtype=np.int64)] += np.float32(1)
        bump_versions([t])
        if valid:   # a valid count one step on is still valid
            self._valid[gi] = (t, t._version)

    def check(self, where: Callable[[int, int], str]) -> None:
        """Every step count is one the kernel takes (:func:`count_error`); a ValueError naming the
        first that is not (``where(gi, i)``: its parameter), before anything is stepped."""
        for gi, t in enumerate(self.steps):
            if self._checked(gi, t):
                continue   # not written since (a write through a view moves _version)
            s = self.counts(gi)
            if s.size and not (s.min() >= 0 and s.max() <= MAX_STEP and (np.floor(s) == s).all()):
                # (a NaN fails the comparisons: min() and max() return it)
                i = int(np.flatnonzero(~((s >= 0) & (s <= MAX_STEP) & (np.floor(s) == s)))[0])
                raise count_error(float(s[i]), where(gi, i))
            self._valid[gi] = (t, t._version)

    def _checked(self, gi: int, t: torch.Tensor) -> bool:
        got = self._valid.get(gi)
        return got is not None and got[0] is t and got[1] == t._version

    def commit(self, active: Sequence[np.ndarray]) -> None:
        for gi, a in enumerate(active):
            self.ready[gi] |= a

    def reset(self) -> None:
        for s, r in zip(self.steps, self.ready):
            s.zero_()
            r[:] = False


def count_error(n: float, where: str) -> Optional[ValueError]:
    """None if ``n`` is a whole number from 0 to MAX_STEP, else the error naming ``where``: the
    kernel's bias correction takes an integer count (torch's code would compute with a fractional
    one, and divide by zero or give NaN on a negative or NaN one)."""
    if 0 <= n <= MAX_STEP and n == math.floor(n):
        return None
    return ValueError(f"state 'step' of {where} is {n}: offload's kernel takes a whole number "
                      "of steps from 0 to 2**62 (the updates the parameter had), and cannot step "
                      "from this one as torch's code would. Set it (opt.state[p]['step'].fill_(n))"
                      " or delete opt.state[p] to start the parameter afresh")
