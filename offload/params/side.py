"""params/side.py: ParamSide, the interface every parameter side implements.

A side is where the parameters and their gradients live, as the step sees them: the state engine
(engine/engine.py) holds one, built at construction by ``side_maker`` (params/__init__.py), and
never asks which one it has. Host parameters (params/host.py ``HostParams``) are read and written
in place by the kernel; device parameters (params/device.py ``DeviceParams``) stream through a ring
of staging slots: the gradients go down (``arrive``), the new weights go up (``publish``). A new
side implements every method below; those with a body here are right for a side without staging
(nothing is copied).

The engine calls, per step: ``collect`` (validate parameters and gradients; ``row_records`` for
a planned step), ``user_writes``, ``begin``, then per bucket (engine/pipeline.py, the device
worker of schedule/backward.py) ``arrive``, ``ptrs``, ``read_master``, ``publish``, and ``finish``
and ``stepped`` at the end; on
growth ``extend``, ``allocate``, ``drop_buckets``; ``read_master`` for loads; ``info`` and
``close``. The device schedule (schedule/) also calls ``next_slot_free``, ``flat_param``,
``grad_sumsq``, ``synchronize``, ``collect_times`` and reads ``stats`` and ``publishes``.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ParamSide", "SideOver"]


class ParamSide:
    staging_slots = 0    # slots of the staging ring (0: the kernel reads and writes parameters)
    all_masters = False  # every parameter's fp32 master is a state section (False: bf16/fp16 only)

    def __init__(self, groups) -> None:
        self.groups = groups   # the engine's list of parameter lists (grows with it: ``extend``)
        self.grads = None      # this step's validated gradients (per group), set by the engine
        self.stats = dict(d2h_s=0.0, h2d_s=0.0, d2h_bytes=0, h2d_bytes=0)   # copies so far
        self.publishes = 0     # uploads so far (fingerprints of the weights before are stale)
        self.trace = None      # offload.base.trace.Trace: copy spans (trace=True)

    # --- the shape of the engine
    def extend(self, groups) -> None:
        """The engine's parameter lists grew (add_param_group)."""
        self.groups = groups

    def allocate(self, layout) -> None:
        """Buffers for ``layout``'s buckets (called again with a longer layout); all or nothing."""

    def drop_buckets(self, buckets) -> None:
        """The layout lost ``buckets`` (indices; a growth undone): their buffers go."""

    def stage_cap(self, budget_cap: Optional[int], bucket_bytes: Optional[int]) -> Optional[int]:
        """The most parameter bytes a bucket may have, from the budget's share of staging
        (``budget_cap``, state/tier.py split_budget) and the ``bucket_bytes`` asked for."""
        return budget_cap

    # --- a step
    def collect(self, groups, local_groups, dtypes, numels, own, mode: str) -> tuple:
        """Validate this step's parameters and gradients (before any I/O): (per group, the bool
        mask of the parameters with a gradient; per group, their local gradients). ``own``: the
        host memory the tier writes (a gradient may not alias it)."""
        raise NotImplementedError

    def revalidated(self) -> list:
        """(group, rows) that the last ``collect`` checked again because they changed."""
        return []

    def row_records(self):
        """The native per-row records that ``collect`` keeps (params/hostrows.py HostRows), which a
        planned step checks its rows against (engine/fastpath.py); None: steps are not planned."""
        return None

    def user_writes(self, tracker, ready) -> set:
        """(gi, i) whose fp32 master the kernel must take from the parameter first: parameters
        with state (``ready``) the user wrote since their last step (``tracker``,
        params/guards.py WriteTracker). None where masters are re-read before the step."""
        return set()

    def begin(self) -> None:
        """Before the first bucket of a step: what ran so far (backward) comes before any copy."""

    def arrive(self, b, pieces, after=None):
        """Bucket ``b``'s gradients of ``pieces`` where the kernel reads them; what ``ptrs`` and
        ``publish`` get back (None: nothing staged)."""
        return None

    def next_slot_free(self) -> bool:
        """Can ``arrive`` stage the next bucket without waiting for an earlier upload?"""
        return True

    def ptrs(self, b, pieces, staged) -> list:
        """Per piece: (param address or 0, grad address, grad dtype code, out address or 0, out
        dtype code), the kernel's task-table columns."""
        raise NotImplementedError

    def read_master(self, gi: int, i: int, start: int, n: int, dst: torch.Tensor,
                    changed_only: bool = False, after=None) -> None:
        """dst = elements [start, start + n) of parameter i of group gi (fp32). ``changed_only``:
        dst holds its master; take only the elements that differ from round(master). ``after``:
        an event the read waits for."""
        raise NotImplementedError

    def publish(self, b, pieces, staged, after=None):
        """The kernel wrote bucket ``b``'s new weights: they go where the parameters are (after
        ``after``); returns the upload's event or None."""
        return None

    def finish(self) -> None:
        """After the last bucket of a step: what comes next waits for the last upload."""

    def stepped(self, active: list) -> None:
        """The step's new weights of the parameters ``active`` (per group, bool masks) are (or will
        be, before anything waits for them) in the parameters: version counters up."""
        raise NotImplementedError

    def grad_sumsq(self, grads, threads: int) -> float:
        """Sum of squares of ``grads`` (this rank's), where they are."""
        raise NotImplementedError

    def flat_param(self, gi: int, i: int) -> torch.Tensor:
        """Parameter i of group gi as the flat tensor an upload writes (RuntimeError if that
        would be a temporary copy)."""
        raise NotImplementedError

    # --- copies, lifecycle
    def synchronize(self) -> None:
        """Every copy done; their times counted."""

    def collect_times(self) -> None:
        """Count the times of finished copies in ``stats``."""

    @property
    def uncounted_copies(self) -> int:
        """Copies whose times are not in ``stats`` yet."""
        return 0

    def info(self, layout) -> dict:
        """What ``storage_info()`` shows of the side (staging sizes)."""
        return {}

    def close(self) -> None:
        """Copies done, buffers released."""



class SideOver(ParamSide):
    """A side that passes every call to the side ``inner``: the base of a side that changes a few
    of them and keeps the rest (schedule/delayed.py HeldParams: the new weights held back)."""

    def __init__(self, inner: ParamSide) -> None:   # (no state of its own: inner's is the side's)
        self.inner = inner

    groups = property(lambda self: self.inner.groups)
    stats = property(lambda self: self.inner.stats)
    publishes = property(lambda self: self.inner.publishes)
    staging_slots = property(lambda self: self.inner.staging_slots)
    all_masters = property(lambda self: self.inner.all_masters)
    uncounted_copies = property(lambda self: self.inner.uncounted_copies)

    grads = property(lambda self: self.inner.grads, lambda s, g: setattr(s.inner, "grads", g))
    trace = property(lambda self: self.inner.trace, lambda s, t: setattr(s.inner, "trace", t))

    def extend(self, groups) -> None:
        self.inner.extend(groups)

    def allocate(self, layout) -> None:
        self.inner.allocate(layout)

    def drop_buckets(self, buckets) -> None:
        self.inner.drop_buckets(buckets)

    def stage_cap(self, budget_cap, bucket_bytes):
        return self.inner.stage_cap(budget_cap, bucket_bytes)

    def collect(self, groups, local_groups, dtypes, numels, own, mode: str) -> tuple:
        return self.inner.collect(groups, local_groups, dtypes, numels, own, mode)

    def revalidated(self) -> list:
        return self.inner.revalidated()

    def user_writes(self, tracker, ready) -> set:
        return self.inner.user_writes(tracker, ready)

    def begin(self) -> None:
        self.inner.begin()

    def arrive(self, b, pieces, after=None):
        return self.inner.arrive(b, pieces, after)

    def next_slot_free(self) -> bool:
        return self.inner.next_slot_free()

    def ptrs(self, b, pieces, staged) -> list:
        return self.inner.ptrs(b, pieces, staged)

    def read_master(self, gi, i, start, n, dst, changed_only=False, after=None) -> None:
        self.inner.read_master(gi, i, start, n, dst, changed_only, after)

    def publish(self, b, pieces, staged, after=None):
        return self.inner.publish(b, pieces, staged, after)

    def finish(self) -> None:
        self.inner.finish()

    def stepped(self, active: list) -> None:
        self.inner.stepped(active)

    def grad_sumsq(self, grads, threads: int) -> float:
        return self.inner.grad_sumsq(grads, threads)

    def flat_param(self, gi: int, i: int) -> torch.Tensor:
        return self.inner.flat_param(gi, i)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def collect_times(self) -> None:
        self.inner.collect_times()

    def info(self, layout) -> dict:
        return self.inner.info(layout)

    def close(self) -> None:
        self.inner.close()
