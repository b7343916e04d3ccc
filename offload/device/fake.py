"""device/fake.py: FakeDevice, CPU tensors driven as if they lived on a GPU, with hazard detection.

Each stream is a background thread that runs copies after a random artificial delay. At enqueue it
poisons the destination (NaN) and snapshots the source; when the copy runs it checks the source
was not modified in the meantime. So a buffer read before its copy completed yields NaN, and a
buffer overwritten while a copy still reads it is recorded as a violation (``check()`` raises).
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from typing import Callable, List, Optional

import torch

from .base import _WAIT_TIMEOUT_S, Device, Event, Pairs, _DoneEvent

__all__ = ["FakeDevice"]


class _FakeEvent(Event):
    def __init__(self, stream: "_FakeStream"):
        self._done = threading.Event()
        self._stream = stream
        self._span = None
        self.error: Optional[BaseException] = None
        self.hazards: List[str] = []

    def synchronize(self) -> None:
        if not self._done.wait(_WAIT_TIMEOUT_S):
            raise TimeoutError(f"fake {self._stream.name} copy did not complete in "
                               f"{_WAIT_TIMEOUT_S} s")
        if self.error is not None:
            raise RuntimeError(f"fake {self._stream.name} copy failed") from self.error

    def query(self) -> bool:
        return self._done.is_set()

    def seconds(self) -> float:
        self.synchronize()
        return self._span[1] - self._span[0] if self._span else 0.0

    def span(self):
        return self._span


class _FakeStream:
    """One FIFO worker thread = one stream."""

    def __init__(self, name: str):
        self.name = name
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"offload-fake-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], after: Optional[Event], delay: float,
               ev: Optional[_FakeEvent] = None) -> _FakeEvent:
        ev = ev or _FakeEvent(self)
        self._q.put((fn, after, delay, ev))
        return ev

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, after, delay, ev = item
            try:
                if after is not None:
                    after.synchronize()
                if delay > 0:
                    time.sleep(delay)
                t0 = time.perf_counter()
                fn()
                ev._span = (t0, time.perf_counter())
            except BaseException as e:  # surfaced by Event.synchronize
                ev.error = e
            ev._done.set()
            # an idle thread must not keep the last job (and its device) alive
            del item, fn, after, ev

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(0x5A)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # (contiguous: a gradient may be a strided or expanded view, which .view(uint8) refuses)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                       b.reshape(-1).contiguous().view(torch.uint8))


class FakeDevice(Device):
    """CPU tensors driven as if they lived on a GPU, with hazard detection (see module docstring).

    ``max_delay`` (seconds): each copy sleeps a uniform random time in [0, max_delay] before it
    runs, on its stream's thread. ``compute_lag``: events from ``record()`` complete that much
    later. ``seed`` makes the delays reproducible. ``poison=False`` turns off destination
    poisoning, ``check=False`` the source snapshots (benchmarks use both off). ``d2h_delay``
    (seconds): each copy to the host waits that much more, so that a CPU step (whose gradients come
    down first) is deterministically still running while the training thread goes on.
    ``spare_bytes``: the device memory ``spare_bytes()`` reports (what state kept on the device may
    take; default 0).
    """

    name = "fake"

    def __init__(self, max_delay: float = 0.002, seed: int = 0, poison: bool = True,
                 check: bool = True, min_delay: float = 0.0, compute_lag: Optional[float] = None,
                 d2h_delay: float = 0.0, spare_bytes: int = 0):
        # > 0: record()'s events complete that much later (a GPU's compute stream runs behind the
        # host), so a copy that waits for one starts late, as on CUDA; default from
        # OFFLOAD_FAKE_COMPUTE_LAG (seconds), so a whole test suite can run with it
        self.compute_lag = float(os.environ.get("OFFLOAD_FAKE_COMPUTE_LAG", "0")
                                 if compute_lag is None
                                 else compute_lag)
        self.max_delay = float(max_delay)
        # lower bound of the random delay (tests that need slow copies)
        self.min_delay = float(min_delay)
        self.d2h_delay = float(d2h_delay)  # added to each copy to the host (a slow CPU step)
        self._spare = int(spare_bytes)     # the device memory it reports as spare (spare_bytes())
        self.poison = poison
        self.check_sources = check
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._d2h = _FakeStream("d2h")
        self._h2d = _FakeStream("h2d")
        self._compute = _FakeStream("compute")
        self._finalizer = weakref.finalize(self, FakeDevice._stop, self._d2h, self._h2d,
                                           self._compute)
        self._last: List[Event] = []
        self._hazardous: List[_FakeEvent] = []
        self.copies = 0

    def spare_bytes(self) -> int:
        return self._spare

    def check_params(self, params) -> None:
        wrong = sorted({str(p.device) for p in params if p.device.type != "cpu"})
        if wrong:
            raise ValueError("FakeDevice drives CPU tensors as if they were on a GPU; parameters "
                             f"are on {', '.join(wrong)}: pass offload_device=None for "
                             "parameters on a GPU")

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        _poison(t)
        return t

    def record(self) -> Event:
        if self.compute_lag > 0:   # completes later, in record order
            return self._compute.submit(lambda: None, None, self.compute_lag)
        return _DoneEvent()  # the compute stream is the host: everything before this is done

    def _copy(self, stream: _FakeStream, pairs: Pairs, after: Optional[Event],
              extra: float = 0.0) -> Event:
        with self._lock:
            delay = self._rng.uniform(min(self.min_delay, self.max_delay), self.max_delay) + extra
            self.copies += 1
        pairs = [(d, s) for d, s in pairs]
        snaps = [s.detach().clone() if self.check_sources else None for _, s in pairs]
        for d, s in pairs:
            if d.shape != s.shape and d.numel() != s.numel():
                raise RuntimeError(f"fake copy: size mismatch {tuple(d.shape)} <- "
                                   f"{tuple(s.shape)}")
            if self.poison:
                _poison(d)
        label = stream.name
        # (made before submit: the stream may run the copy before submit returns)
        ev = _FakeEvent(stream)

        def run():
            for (d, s), snap in zip(pairs, snaps):
                if snap is not None and not _same_bits(s, snap):
                    ev.hazards.append(f"{label} copy source {tuple(s.shape)} {s.dtype} was "
                                      "modified between enqueue and execution "
                                      "(overwritten while in use)")
                d.copy_(s.reshape(d.shape))
            if ev.hazards:
                with self._lock:
                    self._hazardous.append(ev)

        stream.submit(run, after, delay, ev)
        with self._lock:
            self._last.append(ev)
            if len(self._last) > 64:
                self._last = [e for e in self._last if not e.query()]
        return ev

    def copy_to_host(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._d2h, pairs, after, self.d2h_delay)

    def copy_to_device(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._h2d, pairs, after)

    def wait(self, event: Event) -> float:
        t0 = time.perf_counter()
        event.synchronize()
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        with self._lock:
            pending = list(self._last)
        for ev in pending:
            ev.synchronize()

    @property
    def violations(self) -> List[str]:
        with self._lock:
            return [h for ev in self._hazardous for h in ev.hazards]

    def check(self) -> None:
        v = self.violations
        if v:
            raise AssertionError(f"FakeDevice detected {len(v)} hazard(s); first: {v[0]}")

    @staticmethod
    def _stop(*streams: _FakeStream) -> None:
        for st in streams:
            st.close()

    def close(self) -> None:
        self._finalizer()
