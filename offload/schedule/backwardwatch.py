"""schedule/backwardwatch.py: BackwardWatch, which backward passes that handed gradients to the
optimizer completed. The eager device schedule (schedule/backward.py) steps buckets during
backward; a backward that raises part-way (out of memory, a hook or an autograd Function that
raises, an interrupt) leaves those buckets stepped, and no ``step()`` will complete them. torch
tells no hook that a backward failed, but it runs a callback queued during a backward only when
that backward completes: a watched backward whose callback has not run once the caller is outside
every backward did not complete.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch

__all__ = ["BackwardWatch", "unfinished"]


def _task() -> int:
    """The id of the backward (graph task) running on this thread, -1 outside backward."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


def unfinished(why: str, buckets: int, more: str = "") -> str:
    """The failure of a step whose ``buckets`` were stepped during a backward that cannot complete
    it, naming the exception being handled, if any (zero_grad() in the except block of that
    backward)."""
    exc = sys.exc_info()[1]
    handled = "" if exc is None else f"; the exception being handled: {type(exc).__name__}: {exc}"
    return (f"offload: {why} after {buckets} bucket(s) had been stepped during backward "
            f"(step_during_backward){handled}{more}. Those buckets hold part of a step that no "
            "step() can complete")


def _completed(ref, task: int) -> None:
    watch = ref()
    if watch is not None:
        watch.open.discard(task)


class BackwardWatch:
    def __init__(self):
        self.open: set = set()   # backward passes that handed gradients over, not completed yet

    def entered(self) -> None:
        """From a gradient hook: the backward running it is watched until it completes."""
        task = _task()
        if task < 0 or task in self.open:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_completed, weakref.ref(self), task))
        except RuntimeError:   # not a backward the engine reports on: not watched
            return
        self.open.add(task)

    def aborted(self) -> bool:
        """Outside every backward: did a watched one not complete? (It is forgotten either way.)"""
        if not self.open or _task() >= 0:
            return False
        self.open.clear()
        return True

    def others(self) -> bool:
        """Inside a backward: is another watched one still open (it raised part-way, or it runs
        around this one, as a reentrant activation checkpoint's outer backward does)?"""
        return bool(self.open - {_task()})
