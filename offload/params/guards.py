"""params/guards.py: checks that keep a step over raw pointers safe from what users do between
steps.

- ``check_overlaps``: parameters that share memory (one listed twice, overlapping views) and
  gradients that share memory with a parameter or with the optimizer's own buffers (``p.grad =
  p.data``) are refused by name, before anything is read or written: the native kernel writes
  those bytes while it reads them. ``SpanIndex`` is that check in two halves, so that a caller
  that knows the parameters did not move (params/hostrows.py) checks only new gradients.
- ``WriteTracker``: a bf16/fp16 parameter's fp32 master lives apart from the parameter, and the
  kernel writes the parameter through a raw pointer; the step then raises its version counter
  itself (HostParams.stepped) before the tracker records it. A user's write in between
  (``p.mul_(mask)``, ``clamp_``, ``copy_``, ``load_state_dict``, ``p.data = ...``) changes the
  version counter or the data pointer; ``refresh_master`` then takes the parameter's new values
  into the master where they differ from the rounded master, so unchanged elements keep their fp32
  precision. (A write through ``p.data.mul_()`` bumps no counter of ``p`` and is not seen.)
"""
from __future__ import annotations

import bisect
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..base.dtypes import LOW_PRECISION as _LOW


class SharedMemoryError(ValueError, RuntimeError):
    """Parameters, gradients or optimizer state that share memory (a parameter listed twice,
    overlapping views, ``p.grad = p.data``): refused before a step reads or writes anything, with
    the same type in every mode: a ValueError, and also a RuntimeError (what torch raises for
    memory it cannot write while reading it). ``offload.SharedMemoryError``."""


__all__ = ["SharedMemoryError", "check_overlaps", "SpanIndex", "extent", "span_of", "spans_of",
           "WriteTracker", "refresh_master"]



def _owned(own) -> list:
    """The optimizer's own buffers: None, one tensor or a list of tensors (several arenas)."""
    return [] if own is None else list(own) if isinstance(own, (list, tuple)) else [own]


def _spans(groups: Sequence[Sequence[torch.Tensor]], own: Optional[torch.Tensor]) -> list:
    """Sorted (start, end, name) of the memory a step writes: parameters and the optimizer's
    buffers."""
    spans = []
    for gi, params in enumerate(groups):
        for i, p in enumerate(params):
            if p.numel():
                a = p.data_ptr()
                spans.append((a, a + p.numel() * p.element_size(), f"parameter {i} of group {gi}"))
    for t in _owned(own):
        if t.numel():
            a = t.data_ptr()
            spans.append((a, a + t.numel() * t.element_size(), "the optimizer's state buffers"))
    spans.sort()
    return spans


class SpanIndex:
    """The memory a step writes (parameters, the optimizer's buffers), checked disjoint once, and
    the check of gradients against it. Built again whenever any of that memory moves; ``where``
    keeps, per group, the (address, bytes) of each parameter it was built from (0, 0 when
    empty)."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], own: Optional[torch.Tensor],
                 mode: str):
        spans = _spans(groups, own)
        reach, owner, prefix = -1, "", []  # prefix[k]: (largest end among spans[:k+1], whose)
        for s, e, name in spans:
            if s < reach:
                raise SharedMemoryError(f"{name} shares memory with {owner} (a parameter listed "
                                        "twice, or overlapping views of one tensor): with "
                                        f"storage={mode!r} every parameter needs its own memory")
            if e > reach:
                reach, owner = e, name
            prefix.append((reach, owner))
        self.spans, self.prefix = spans, prefix
        self.starts = [s for s, _, _ in spans]
        # (check_spans: the same search,
        self._starts = np.array(self.starts, dtype=np.int64)
        self._reach = np.array([r for r, _ in prefix], dtype=np.int64)      # vectorized)
        self.own = spans_of(own)
        self.where = [np.array([span_of(p) for p in ps], dtype=np.int64).reshape(len(ps), 2)
                      for ps in groups]

    def check_grads(self, grads: Iterable) -> None:
        """Raise SharedMemoryError naming the first gradient in ``grads`` ((gi, i, grad) triples)
        that shares memory with a parameter or with the optimizer's buffers."""
        spans, prefix, starts = self.spans, self.prefix, self.starts
        for gi, i, g in grads:
            if not g.numel():
                continue
            a = g.data_ptr()
            k = bisect.bisect_left(starts, a + extent(g))  # spans that start before g ends
            if k and prefix[k - 1][0] > a:
                other = next(name for s, e, name in spans[:k] if e > a)
                raise SharedMemoryError(f"the gradient of parameter {i} of group {gi} shares "
                                        f"memory with {other} (e.g. p.grad = p.data): the step "
                                        "overwrites that memory while it reads the gradient. "
                                        "Give the parameter a gradient of its own "
                                        "(p.grad = g.clone())")

    def check_spans(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """check_grads for gradients known only by (address, bytes) (int64 arrays, 0 bytes: empty,
        never in conflict): the positions whose memory overlaps a parameter or the optimizer's
        buffers, in order. The caller raises through check_grads on the first of them (its message
        names both)."""
        if not len(self._starts) or not len(addrs):
            return np.zeros(0, dtype=np.int64)
        # spans that start before each ends
        k = np.searchsorted(self._starts, addrs + nbytes, side="left")
        hit = (nbytes > 0) & (k > 0) & (self._reach[np.maximum(k - 1, 0)] > addrs)
        return np.flatnonzero(hit)


def extent(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element: numel * itemsize when
    contiguous, else what its strides reach (an expanded gradient covers one element, a strided
    slice more than numel)."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def spans_of(own) -> tuple:
    """(address, bytes) of each of the optimizer's own buffers (None, a tensor or a list of
    them)."""
    return tuple(span_of(t) for t in _owned(own))


def span_of(t: Optional[torch.Tensor]) -> tuple:
    """(address, bytes) of the memory ``t`` covers; (0, 0) for None or an empty tensor."""
    if t is None or not t.numel():
        return (0, 0)
    return (t.data_ptr(), t.numel() * t.element_size())


def check_overlaps(groups: Sequence[Sequence[torch.Tensor]], grads: Iterable,
                   own: Optional[torch.Tensor], mode: str) -> None:
    """Raise SharedMemoryError naming the first parameter that shares memory with another (or with
    ``own``), or the first gradient in ``grads`` ((gi, i, grad) triples) that shares memory with
    either."""
    SpanIndex(groups, own, mode).check_grads(grads)


class WriteTracker:
    """Per bf16/fp16 parameter: (version counter, data pointer) when its master last matched it.

    With ``dtypes`` (the engine's per-group dtypes at construction) set, only parameters created
    bf16/fp16 are looked at: only they can be stepped as bf16/fp16 (a changed dtype is refused
    before this is asked), so the answer for every parameter that is stepped is the same."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]]):
        self.groups = groups
        self.seen = [np.full((len(ps), 2), -1, dtype=np.int64) for ps in groups]
        # set by the engine: per group, the dtype of each parameter at construction
        self.dtypes = None
        self._low: list = []

    def _rows(self, gi: int, rows) -> Iterable[int]:
        """``rows`` (all when None) of group gi that may be bf16/fp16 parameters."""
        if (self.dtypes is None or gi >= len(self.dtypes)
            or len(self.dtypes[gi]) != len(self.groups[gi])):
            return range(len(self.groups[gi])) if rows is None else rows
        while len(self._low) <= gi:
            self._low.append(None)
        low = self._low[gi]
        if low is None or len(low[0]) != len(self.dtypes[gi]):
            mask = np.array([d in _LOW for d in self.dtypes[gi]], dtype=bool)
            low = self._low[gi] = (mask, np.flatnonzero(mask))
        if rows is None:
            return low[1].tolist()
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        return rows[low[0][rows]].tolist() if rows.size else []

    def low_rows(self, gi: int) -> np.ndarray:
        """Indices of group gi's parameters that may be bf16/fp16 (``dtypes`` set: created so)."""
        return np.asarray(self._rows(gi, None), dtype=np.int64).reshape(-1)

    def add_group(self, n: int) -> None:
        """A group of ``n`` parameters was added (``groups`` holds it): none recorded yet."""
        self.seen.append(np.full((n, 2), -1, dtype=np.int64))

    def drop_groups(self, gi: int) -> None:
        """The groups from ``gi`` on went (an add_param_group that failed part-way)."""
        del self.seen[gi:]

    def record(self, gi: int, rows: Iterable[int]) -> None:
        """The masters of these parameters match the parameters now."""
        seen, params = self.seen[gi], self.groups[gi]
        for i in self._rows(gi, rows):
            p = params[i]
            if p.dtype in _LOW:
                seen[i] = (p._version, p.data_ptr())

    def written(self, ready: Sequence[np.ndarray]) -> set:
        """(gi, i) of bf16/fp16 parameters with state (``ready``) written since ``record``."""
        out = set()
        for gi, params in enumerate(self.groups):
            seen, rd = self.seen[gi], ready[gi]
            for i in self._rows(gi, None):
                p = params[i]
                if rd[i] and p.dtype in _LOW and (seen[i, 0] != p._version
                                                  or seen[i, 1] != p.data_ptr()):
                    out.add((gi, i))
        return out


def refresh_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """Take ``param``'s values into the fp32 ``master`` (same length) where they differ from the
    rounded master."""
    changed = master.to(param.dtype) != param
    if changed.any():
        master[changed] = param[changed].float()
