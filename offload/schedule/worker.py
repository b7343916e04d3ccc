"""schedule/worker.py: Worker, the CPU worker thread of the overlapped device schedule
(schedule/backward.py BackwardFeed composes one): its queue and loop, per bucket the D2H into a
staging slot, the state slot, the kernel (engine/bucket.py) and the H2D of the new weights, the
NVMe read-ahead between them, and its shutdown; also the check that a gradient it copies was not
written meanwhile.

What it needs of the feed's step (failure state, gradients to let go, the expected order) comes in
as callables; the engine only through its public seam (``lock``, layout, registry, telemetry).
"""
from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..engine.bucket import step_bucket

__all__ = ["BarrierJob", "FinishJob", "NudgeJob", "ParkJob", "StepJob", "Worker"]

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
        worker = ref()
        if worker is None:
            return
        stop = worker.work(pending, staged)
        del worker
        if stop:
            return


def _stop_worker(q, worker: threading.Thread) -> None:
    """The worker is gone, or the interpreter exits (weakref.finalize runs at exit): the worker
    finishes what is queued (the last step's buckets) and stops, and exit waits for it. Without the
    join a worker still inside a kernel (GIL released) when the interpreter finalized was killed on
    its way back into Python, through C++ code: std::terminate, the process aborted (exit code 134)
    whenever a script ended right after step()."""
    q.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=_WAIT_S)


def _unchanged(reads) -> None:
    """The gradients a bucket's copy reads must not be written between its dispatch and the copy's
    end.

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
                f"offload: the gradient of parameter {i} of group {gi} changed while the CPU "
                "worker still had to copy it to the host (gradients changed after they were sent "
                "to the CPU). Either it was modified between backward and step() while buckets "
                "are stepped during backward (a second backward before step(), which accumulates "
                "into it, torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, a framework's "
                "gradient clipping: pass max_grad_norm= / check_overflow=True, or "
                "step_during_backward=False), or written in place after step() (p.grad.zero_(), "
                "model.zero_grad(set_to_none=False), a refilled gradient buffer: call "
                "optimizer.synchronize() first, or use optimizer.zero_grad(), which waits). The "
                "optimizer state is now partially updated.")


@dataclass
class StepJob:
    """One bucket to step: the pieces with gradients, whether its state was written before
    (``read`` it), its group's hyperparameters, the gradient multiplier, the device event its
    copies down wait for (``after``), the gradients they read with their versions (``reads``:
    :func:`_unchanged`) and the Upload of its new weights (schedule/uploads.py)."""
    bucket: Any
    pieces: list
    read: bool
    hyper: dict
    mult: float
    after: Any
    reads: list
    upload: Any


@dataclass
class FinishJob:
    """Run ``fn`` after the buckets queued before it (the step's commit)."""
    fn: Callable[[], None]


@dataclass
class BarrierJob:
    """Set ``done`` once everything queued before it is done."""
    done: threading.Event


@dataclass
class ParkJob:
    """:meth:`Worker.park`: ``done`` set once what is read ahead is given up; ``n``: jobs put by
    then."""
    done: threading.Event
    n: int


class NudgeJob:
    """Read ahead now (the next step's first buckets, during forward)."""


class Worker:
    """The thread and its jobs: StepJob, FinishJob (run in order, after the buckets queued before
    it), BarrierJob, NudgeJob, ParkJob (``park``); None stops it.

    ``threads()``: the kernel's threads; ``failure()``: the step's failure (None: none), after
    which queued buckets are skipped; ``failed(e)``: report one; ``sent_down(gi, pieces)``: their
    D2H was issued; ``stepping(bi)``: bucket bi is about to be stepped; ``wanted(depth)``: the next
    buckets to read ahead, at most ``depth``."""

    def __init__(self, engine, *, threads: Callable[[], int],
                 failure: Callable[[], Optional[BaseException]],
                 failed: Callable[[BaseException], None], sent_down: Callable,
                 stepping: Callable[[int], None], wanted: Callable[[int], list], trace=None):
        self.engine, self.side, self.tier = engine, engine.side, engine.tier
        self.threads, self.failure, self.failed = threads, failure, failed
        self.sent_down, self.stepping, self.wanted, self.trace = sent_down, stepping, wanted, trace
        self.q: "queue.Queue" = queue.Queue()
        self.puts = 0          # jobs given by ``put`` so far
        self.parked_at = -1    # ``puts`` when the last park was queued: no read-ahead until more
        self.thread: Optional[threading.Thread] = threading.Thread(
            target=_loop, args=(weakref.ref(self), self.q), name="offload-backward-step",
            daemon=True)
        self.thread.start()
        self.finalizer = weakref.finalize(self, _stop_worker, self.q, self.thread)

    def put(self, job) -> None:
        self.puts += 1
        self.q.put(job)

    def work(self, pending: deque, staged: deque) -> bool:
        """One turn of the thread: True when it is to stop. An exception outside a bucket's own
        handling (the read-ahead between jobs) fails the step instead of ending the thread."""
        try:
            return self._work(pending, staged)
        except BaseException as e:
            self.failed(e)
            return False

    def _work(self, pending: deque, staged: deque) -> bool:
        q = self.q
        while True:
            try:
                pending.append(q.get_nowait())
            except queue.Empty:
                break
        side = self.side
        nslots = side.staging_slots
        # a bucket is staged (its gradients copied down) while a slot is free; one whose slot still
        # uploads the weights of an earlier bucket waits until the buckets already staged are
        # stepped
        while (pending and isinstance(pending[0], StepJob) and len(staged) < nslots
               and (not staged or side.next_slot_free())):
            job = pending.popleft()
            if self.failure() is not None:
                job.upload.issued.set()
                continue
            try:
                _unchanged(job.reads)
                with self.engine.lock:
                    staged.append((job, self.side.arrive(job.bucket, job.pieces, job.after)))
                self.sent_down(job.bucket.group, job.pieces)
            except BaseException as e:
                self.failed(e)
        if staged:
            job, st = staged.popleft()
            if self.failure() is None:
                try:
                    self.step_bucket(job, st)
                except BaseException as e:
                    self.failed(e)
            job.upload.issued.set()
            return False
        if pending:
            item = pending.popleft()
            if item is None:
                return True
            if isinstance(item, BarrierJob):
                item.done.set()
            elif isinstance(item, ParkJob):
                self._park(item.done, item.n)
            elif isinstance(item, FinishJob) and self.failure() is None:
                try:
                    item.fn()
                except BaseException as e:
                    self.failed(e)
        if not pending and not staged and self.failure() is None and self.parked_at != self.puts:
            self.read_ahead(blocking=False)
        return False

    def _park(self, done: threading.Event, n: int) -> None:
        """(ParkJob) What is read ahead is given up; nothing more is until the next job."""
        try:
            self.parked_at = n
            tier = self.tier
            with self.engine.lock:
                if tier.storage == "nvme" and not tier.closed and tier.failed is None:
                    tier.keep_reads(set())
        except BaseException as e:
            self.failed(e)
        finally:
            done.set()

    def read_ahead(self, blocking: bool) -> None:
        """Keep ``depth`` reads in flight for the next buckets of the expected order."""
        tier, eng = self.tier, self.engine
        if tier.storage != "nvme" or tier.closed:
            return
        lock = eng.lock
        if not lock.acquire(blocking=blocking):
            return
        try:
            if tier.failed is not None:
                return
            buckets = eng.layout.buckets
            wanted = self.wanted(eng.depth)
            # a mispredicted read-ahead only holds a slot: give it up
            tier.keep_reads(set(wanted))
            for bi in wanted:
                b = buckets[bi]
                if not tier.prefetched(b):
                    tier.prefetch(b, eng.registry.has_state(b))
                    if not tier.prefetched(b):
                        break   # no free slot now
        finally:
            lock.release()

    def step_bucket(self, job: StepJob, st) -> None:
        """Step one queued bucket whose gradients are staged (``st``): state slot, kernel, new
        weights up."""
        b, act, read, hyper, mult, after, reads, up = (job.bucket, job.pieces, job.read, job.hyper,
                                                       job.mult, job.after, job.reads, job.upload)
        eng, side, tier = self.engine, self.side, self.tier
        with eng.lock:
            self.stepping(b.index)
            blk = tier.acquire(b, read)   # read on demand if it was not read ahead
            self.read_ahead(blocking=True)   # the next reads run during this kernel
            # ptrs: waits for the D2H
            t0, t1 = step_bucket(b, act, blk, functools.partial(side.ptrs, b, act, st),
                                 registry=eng.registry,
                                 read_master=functools.partial(side.read_master, after=after),
                                 hyper=hyper, mult=mult, threads=self.threads(),
                                 timing=eng.telemetry,
                                 between=functools.partial(_unchanged, reads))
            tier.release(b, blk)
            up.ev = side.publish(b, act, st, after)
        if self.trace is not None:
            self.trace.span(f"adam b{b.index}", "cpu step", (t0, t1))

    def park(self) -> None:
        """Every job queued so far done, and no state read ahead (NVMe) until the next job: the
        state in the tier is the one after the last job, and an in-place write into it is what the
        next step reads. Returns at once if nothing was queued since the last park, and on the
        worker."""
        n = self.puts
        if self.thread is None or self.thread is threading.current_thread() or self.parked_at == n:
            return
        done = threading.Event()
        self.q.put(ParkJob(done, n))
        if not done.wait(_WAIT_S):
            raise TimeoutError(f"offload: the CPU worker did not finish within {_WAIT_S} s")

    def wait_idle(self) -> None:
        """Every queued bucket stepped and its upload issued."""
        done = threading.Event()
        self.q.put(BarrierJob(done))
        if not done.wait(_WAIT_S):
            raise TimeoutError(f"offload: the CPU worker did not finish within {_WAIT_S} s")

    def stop(self) -> None:
        """Finish what is queued and end the thread (waits up to 10 s)."""
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout=10)
            self.thread = None
