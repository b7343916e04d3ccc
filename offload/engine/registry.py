"""engine/registry.py: which parameter has state, its step count, and fresh-state creation.

Step counts are fp32 like torch's, one vector per group; ``state['step']`` entries are 0-dim views
of them. A parameter's state is created at its first step exactly as the RAM mode does (zeros,
fp32 master = the parameter), so every tier gives bitwise the same results.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np
import torch

from ..base.tensors import bump_versions
from ..state.layout import piece_columns

__all__ = ["Registry"]


class Registry:
    def __init__(self, sizes: Sequence[int]):
        self.steps: List[torch.Tensor] = []
        self.ready: List[np.ndarray] = []
        self._counts: dict = {}   # gi -> (steps[gi], its numpy view): Tensor.numpy() costs ~45 us on cold caches
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

    def has_state(self, b) -> bool:
        return bool(self.ready[b.group][piece_columns(b, b.pieces, "param")[0]].any())

    def init_fresh(self, b, pieces: Sequence, blk, read_master: Callable) -> None:
        """First step of a piece's parameter: zero moments; master = the parameter (read_master)."""
        r = self.ready[b.group]
        if r[piece_columns(b, pieces, "param")[0]].all():
            return   # (every warm step: no Python per piece)
        data = blk.data[:b.nbytes]
        f32 = data.view(torch.float32)
        for pc in pieces:
            if r[pc.param]:
                continue
            for key, _size in b.keys:
                if b.moments != "fp32" and key != "master_param":   # compressed: all-zero bytes are zero state
                    off, nb = b.span(key, pc)
                    data[off:off + nb].zero_()
                    continue
                sec = b.section(key) // 4 + pc.pos
                dst = f32[sec:sec + pc.n]
                if key == "master_param":
                    read_master(b.group, pc.param, pc.start, pc.n, dst)
                else:
                    dst.zero_()

    def advance(self, active: Sequence[np.ndarray]) -> None:
        """One more step for the parameters ``active`` (per group, bool masks). Through numpy (the
        same fp32 additions, without a torch op per group: cheaper when the step's memory traffic has
        evicted torch's code from the caches); the version counters move as torch's += would."""
        moved = []
        for gi, a in enumerate(active):
            if a.any():
                s = self.counts(gi)
                if a.all():
                    s += np.float32(1)   # (every parameter has a gradient: no masked update)
                else:
                    s[a] += np.float32(1)
                moved.append(self.steps[gi])
        bump_versions(moved)

    def commit(self, active: Sequence[np.ndarray]) -> None:
        for gi, a in enumerate(active):
            self.ready[gi] |= a

    def reset(self) -> None:
        for s, r in zip(self.steps, self.ready):
            s.zero_()
            r[:] = False
