"""step/worker.py: the CPU worker thread's loop, its shutdown, and the check that a gradient it copies
was not written meanwhile; the worker's per-bucket work is BackwardFeed.work (step/backward.py)."""
from __future__ import annotations

import threading
from collections import deque

__all__ = ["_WAIT_S", "_loop", "_stop_worker", "_unchanged"]

_WAIT_S = 300.0   # a hang is a bug: fail loudly instead


def _loop(ref, q) -> None:
    pending, staged = deque(), deque()
    while True:
        if not pending and not staged:
            item = q.get()
            if item is None:
                return
            pending.append(item)
            del item   # waiting for the next job must not keep this one (its gradients) alive
        feed = ref()
        if feed is None:
            return
        stop = feed.work(q, pending, staged)
        del feed
        if stop:
            return


def _stop_worker(q, worker: threading.Thread) -> None:
    """The feed is gone, or the interpreter exits (weakref.finalize runs at exit): the worker finishes
    what is queued (the last step's buckets) and stops, and exit waits for it. Without the join a
    worker still inside a kernel (GIL released) when the interpreter finalized was killed on its way
    back into Python, through C++ code: std::terminate, the process aborted (exit code 134) whenever
    a script ended right after step()."""
    q.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=_WAIT_S)


def _unchanged(reads) -> None:
    """The gradients a bucket's copy reads must not be written between its dispatch and the copy's end.

    step() returns while the worker still copies gradients down (D2H), so an in-place write to
    p.grad after step() (``p.grad.zero_()``, ``model.zero_grad(set_to_none=False)``, a refill of a
    persistent gradient buffer) races with that copy: the bucket would be stepped with the new
    values. Checked before the copy is issued and after it finished, by the gradient's version
    counter (moved by every in-place write, but only once the write is issued (CUDA) or done (CPU),
    so a write that overlaps the end of the copy can escape this check: docs/gpu.md says when
    writing is safe; a write after the copy, before this check, is refused too).
    The step is then failed (some buckets were stepped) rather than silently wrong."""
    for gi, i, g, ver in reads:
        if g._version != ver:
            raise RuntimeError(
                f"offload: the gradient of parameter {i} of group {gi} changed while the CPU worker still had to "
                "copy it to the host (gradients changed after they were sent to the CPU). Either it was modified "
                "between backward and step() while buckets are stepped during backward (torch.nn.utils."
                "clip_grad_norm_, GradScaler.unscale_, a framework's gradient clipping: pass max_grad_norm= / "
                "check_overflow=True, or step_during_backward=False), or written in place after step() "
                "(p.grad.zero_(), model.zero_grad(set_to_none=False), a refilled gradient buffer: call "
                "optimizer.synchronize() first, or use optimizer.zero_grad(), which waits). The optimizer state "
                "is now partially updated.")
