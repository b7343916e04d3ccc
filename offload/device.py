"""device.py: the transfer abstraction the GPU-offload scheduler talks to.

The scheduler (offload/pipeline.py) never touches CUDA directly. It asks a ``Device`` to
  * ``record()``          an event at the current point of the compute stream,
  * ``copy_to_host()``    copy device tensors into host buffers on the D2H stream, after an event,
  * ``copy_to_device()``  copy host buffers into device tensors on the H2D stream, after an event,
  * ``wait()``            make the compute stream wait for an event (the host is not blocked on a GPU),
  * ``host_empty()``      allocate a host buffer (pinned when that matters).
Every copy returns an ``Event`` with ``synchronize()`` (block the host) and ``query()``.

Three implementations:
  * ``CudaDevice``  - two side streams (D2H, H2D), CUDA events, pinned host memory, non-blocking copies.
  * ``CpuDevice``   - "device" tensors are CPU tensors; copies run synchronously on the caller.
  * ``FakeDevice``  - CPU tensors, but each stream is a background thread that runs copies after a
    random artificial delay. At enqueue it poisons the destination (NaN) and snapshots the source;
    when the copy runs it checks the source was not modified in the meantime. So a buffer read
    before its copy completed yields NaN (results differ from the reference), and a buffer
    overwritten while a copy still reads it is recorded as a violation (``check()`` raises).
    The compute stream is the host itself: ``wait()`` blocks until the event fired.
"""
from __future__ import annotations

import queue
import random
import threading
import time
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["Event", "Device", "CudaDevice", "CpuDevice", "FakeDevice", "resolve_device"]

Pairs = Sequence[Tuple[torch.Tensor, torch.Tensor]]  # (dst, src)
_WAIT_TIMEOUT_S = 120.0


class Event:
    """A point on a stream. ``seconds()`` is the duration of the copy it ends (0 if unknown)."""

    def synchronize(self) -> None:
        raise NotImplementedError

    def query(self) -> bool:
        raise NotImplementedError

    def seconds(self) -> float:
        return 0.0

    def span(self) -> Optional[Tuple[float, float]]:
        """(start, end) in host ``perf_counter`` seconds of the copy, when known (for traces)."""
        return None


class _DoneEvent(Event):
    def __init__(self, seconds: float = 0.0, span=None):
        self._s = seconds
        self._span = span

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def seconds(self) -> float:
        return self._s

    def span(self):
        return self._span


class Device:
    """Interface; see the module docstring."""

    name = "abstract"
    is_cuda = False

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def record(self) -> Event:
        raise NotImplementedError

    def copy_to_host(self, pairs: Pairs, after: Optional[Event]) -> Event:
        raise NotImplementedError

    def copy_to_device(self, pairs: Pairs, after: Optional[Event]) -> Event:
        raise NotImplementedError

    def wait(self, event: Event) -> float:
        """Compute stream waits for ``event``; returns host seconds blocked (0 on a real GPU)."""
        raise NotImplementedError

    def timed_wait(self, event: Event) -> Event:
        """Like ``wait``; the returned event's ``seconds()`` is how long the compute stream stalled
        (on a GPU: measured with events around the wait; elsewhere: host seconds blocked)."""
        return _DoneEvent(self.wait(event))

    def synchronize(self) -> None:
        """Block until every stream of this device is idle."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise if a hazard was detected (only the fake device detects any)."""

    def discard(self, event: Event) -> None:
        """The scheduler will never use what the copy ending in ``event`` wrote (it was superseded
        by a new copy of the same sources): a hazard on its sources is harmless."""

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------- CUDA
class _CudaEvent(Event):
    def __init__(self, start, end):
        self._start, self._end = start, end

    def synchronize(self) -> None:
        self._end.synchronize()

    def query(self) -> bool:
        return self._end.query()

    def seconds(self) -> float:
        if self._start is None:
            return 0.0
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class CudaDevice(Device):
    """Two side streams (D2H and H2D) next to the current (compute) stream; pinned host buffers.

    Host buffers of 1 MiB or more are page-aligned ordinary allocations page-locked in place with
    ``cudaHostRegister`` (torch's pinned caching allocator rounds each request up to a power of
    two, up to 2x the memory); smaller ones, or if registering fails, come from ``pin_memory=True``.
    """

    is_cuda = True
    _REGISTER_MIN = 1 << 20

    def __init__(self, device=None, timing: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice: CUDA is not available in this process")
        d = torch.device("cuda" if device is None else device)
        self.device = torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
        self.name = str(self.device)
        self._timing = timing
        self._registered: List[torch.Tensor] = []
        # registered memory must be unregistered before it is freed, also when nobody calls close()
        self._finalizer = weakref.finalize(self, CudaDevice._unregister, self._registered, self.device)
        with torch.cuda.device(self.device):
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes >= self._REGISTER_MIN:
            raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
            off = (-raw.data_ptr()) % 4096
            buf = raw[off:off + nbytes]
            try:
                rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
                ok = int(getattr(rc, "value", rc)) == 0
            except Exception:  # pragma: no cover - depends on the CUDA build
                ok = False
            if ok:
                self._registered.append(buf)
                return buf.view(dtype)
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    @staticmethod
    def _unregister(bufs: List[torch.Tensor], device) -> None:
        if not bufs:
            return
        try:
            torch.cuda.synchronize(device)
            for buf in bufs:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        bufs.clear()

    def close(self) -> None:
        """Unregister the page-locked buffers; copies from them are then synchronous (still correct)."""
        self._finalizer()

    def _event(self, timing=False):
        return torch.cuda.Event(enable_timing=timing)

    def record(self) -> Event:
        ev = self._event()
        ev.record(torch.cuda.current_stream(self.device))
        return _CudaEvent(None, ev)

    def _copy(self, stream, pairs: Pairs, after: Optional[Event], d2h: bool) -> Event:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after._end)
            start = self._event(self._timing) if self._timing else None
            if start is not None:
                start.record(stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                # the caching allocator must not hand the device tensor out again before this
                # stream is done with it (grads may be released right after the copy is enqueued)
                (src if d2h else dst).record_stream(stream)
            end = self._event(self._timing)
            end.record(stream)
        return _CudaEvent(start, end)

    def copy_to_host(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._d2h, pairs, after, True)

    def copy_to_device(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._h2d, pairs, after, False)

    def wait(self, event: Event) -> float:
        torch.cuda.current_stream(self.device).wait_event(event._end)
        return 0.0

    def timed_wait(self, event: Event) -> Event:
        stream = torch.cuda.current_stream(self.device)
        start, end = self._event(True), self._event(True)
        start.record(stream)
        stream.wait_event(event._end)
        end.record(stream)
        return _CudaEvent(start, end)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


# ---------------------------------------------------------------------------------------- CPU
class CpuDevice(Device):
    """Device tensors are CPU tensors; every copy runs synchronously on the calling thread."""

    name = "cpu"

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def record(self) -> Event:
        return _DoneEvent()

    def _copy(self, pairs: Pairs) -> Event:
        t0 = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src)
        t1 = time.perf_counter()
        return _DoneEvent(t1 - t0, (t0, t1))

    def copy_to_host(self, pairs: Pairs, after: Optional[Event]) -> Event:
        if after is not None:
            after.synchronize()
        return self._copy(pairs)

    def copy_to_device(self, pairs: Pairs, after: Optional[Event]) -> Event:
        if after is not None:
            after.synchronize()
        return self._copy(pairs)

    def wait(self, event: Event) -> float:
        event.synchronize()
        return 0.0

    def synchronize(self) -> None:
        pass


# ---------------------------------------------------------------------------------------- fake
class _FakeEvent(Event):
    def __init__(self, stream: "_FakeStream"):
        self._done = threading.Event()
        self._stream = stream
        self._span = None
        self.error: Optional[BaseException] = None
        self.hazards: List[str] = []
        self.discarded = False

    def synchronize(self) -> None:
        if not self._done.wait(_WAIT_TIMEOUT_S):
            raise TimeoutError(f"fake {self._stream.name} copy did not complete in {_WAIT_TIMEOUT_S} s")
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

    def submit(self, fn: Callable[[], None], after: Optional[Event], delay: float) -> _FakeEvent:
        ev = _FakeEvent(self)
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
            del item, fn, after, ev   # an idle thread must not keep the last job (and its device) alive

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(0x5A)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class FakeDevice(Device):
    """CPU tensors driven as if they lived on a GPU, with hazard detection (see module docstring).

    ``max_delay`` (seconds): each copy sleeps a uniform random time in [0, max_delay] before it
    runs, on its stream's thread. ``seed`` makes the delays reproducible. ``poison=False`` turns
    off destination poisoning, ``check=False`` the source snapshots (benchmarks use both off).
    """

    name = "fake"

    def __init__(self, max_delay: float = 0.002, seed: int = 0, poison: bool = True, check: bool = True,
                 min_delay: float = 0.0):
        self.max_delay = float(max_delay)
        self.min_delay = float(min_delay)  # lower bound of the random delay (tests that need slow copies)
        self.poison = poison
        self.check_sources = check
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._d2h = _FakeStream("d2h")
        self._h2d = _FakeStream("h2d")
        self._finalizer = weakref.finalize(self, FakeDevice._stop, self._d2h, self._h2d)
        self._last: List[Event] = []
        self._hazardous: List[_FakeEvent] = []
        self.copies = 0

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        _poison(t)
        return t

    def record(self) -> Event:
        return _DoneEvent()  # the compute stream is the host: everything before this is done

    def _copy(self, stream: _FakeStream, pairs: Pairs, after: Optional[Event]) -> Event:
        with self._lock:
            delay = self._rng.uniform(min(self.min_delay, self.max_delay), self.max_delay)
            self.copies += 1
        pairs = [(d, s) for d, s in pairs]
        snaps = [s.detach().clone() if self.check_sources else None for _, s in pairs]
        for d, s in pairs:
            if d.shape != s.shape and d.numel() != s.numel():
                raise RuntimeError(f"fake copy: size mismatch {tuple(d.shape)} <- {tuple(s.shape)}")
            if self.poison:
                _poison(d)
        label = stream.name
        box: List[_FakeEvent] = []

        def run():
            for (d, s), snap in zip(pairs, snaps):
                if snap is not None and not _same_bits(s, snap):
                    box[0].hazards.append(f"{label} copy source {tuple(s.shape)} {s.dtype} was modified between "
                                          "enqueue and execution (overwritten while in use)")
                d.copy_(s.reshape(d.shape))
            if box[0].hazards:
                with self._lock:
                    self._hazardous.append(box[0])

        ev = stream.submit(run, after, delay)
        box.append(ev)
        with self._lock:
            self._last.append(ev)
            if len(self._last) > 64:
                self._last = [e for e in self._last if not e.query()]
        return ev

    def copy_to_host(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._d2h, pairs, after)

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
            return [h for ev in self._hazardous if not ev.discarded for h in ev.hazards]

    def discard(self, event: Event) -> None:
        event.discarded = True

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


def resolve_device(spec, params: Sequence[torch.Tensor]) -> Optional[Device]:
    """The offload device for these parameters: ``spec`` (a Device, 'cuda', 'cpu', 'fake') or,
    when ``spec`` is None, CUDA if the parameters are on a CUDA device, else None (CPU mode)."""
    if isinstance(spec, Device):
        return spec
    if spec is None:
        kinds = {p.device.type for p in params}
        if "cuda" in kinds:
            devs = {p.device for p in params}
            if len(devs) != 1:
                raise RuntimeError(f"GPU offload: all parameters must be on one device, got {sorted(map(str, devs))}")
            return CudaDevice(next(iter(devs)))
        return None
    if isinstance(spec, str):
        if spec == "fake":
            return FakeDevice()
        if spec == "cpu":
            return CpuDevice()
        if spec.startswith("cuda"):
            return CudaDevice(spec)
    raise ValueError(f"offload_device must be a Device, 'cuda', 'cpu', 'fake' or None, got {spec!r}")
