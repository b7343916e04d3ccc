"""device/cuda.py: CudaDevice, two side streams (D2H, H2D) next to the compute stream, pinned host
buffers."""
from __future__ import annotations

import time
from typing import Optional

import torch

from .base import Device, Event, Pairs

__all__ = ["CudaDevice"]


class _CudaEvent(Event):
    def __init__(self, start, end, anchor=None):
        self._start, self._end = start, end
        # (host perf_counter, CUDA event) taken together: places the copy in host time
        self._anchor = anchor

    def synchronize(self) -> None:
        self._end.synchronize()

    def query(self) -> bool:
        return self._end.query()

    def seconds(self) -> float:
        if self._start is None:
            return 0.0
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3

    def span(self):
        """(start, end) in host perf_counter seconds, from the device's anchor event (for
        traces)."""
        if self._start is None or self._anchor is None:
            return None
        self._end.synchronize()
        t, ev = self._anchor
        return (t + ev.elapsed_time(self._start) / 1e3, t + ev.elapsed_time(self._end) / 1e3)


class CudaDevice(Device):
    """Two side streams (D2H and H2D) next to the current (compute) stream; pinned host buffers.

    Host buffers come from torch's pinned allocator (``pin_memory=True``), allocated on this
    device, so a failure is torch's clear error and leaves no CUDA error behind (the allocator
    rounds a request up to a power of two: the staging ring may take up to twice its size). Events
    the host waits on block instead of spinning a core, which the CPU kernel and the launch threads
    need.
    """

    is_cuda = True
    # CPUs left to the threads that launch GPU work (training thread, autograd's)
    launch_threads = 2

    def __init__(self, device=None, timing: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice: CUDA is not available in this process")
        d = torch.device("cuda" if device is None else device)
        self.device = torch.device("cuda",
                                   d.index if d.index is not None else torch.cuda.current_device())
        self.name = str(self.device)
        self._timing = timing
        with torch.cuda.device(self.device):
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
            self._anchor = None
            if timing:
                ev = self._event(True)
                ev.record(torch.cuda.current_stream(self.device))
                ev.synchronize()
                self._anchor = (time.perf_counter(), ev)

    def spare_bytes(self) -> int:
        """Free device memory plus what torch's caching allocator holds beyond this process's peak,
        less a margin of a tenth of the device or 2 GiB, whichever is larger (a later batch may
        need more than the first ones did)."""
        free, total = torch.cuda.mem_get_info(self.device)
        held = (torch.cuda.memory_reserved(self.device)
                - torch.cuda.max_memory_allocated(self.device))
        return max(0, free + max(0, held) - max(total // 10, 2 << 30))

    def check_params(self, params) -> None:
        wrong = sorted({str(p.device) for p in params if p.device != self.device})
        if wrong:
            raise ValueError(f"offload_device is {self.device} but parameters are on "
                             f"{', '.join(wrong)}: its copies would not be ordered with their "
                             "work. Pass offload_device=None (the parameters' device is used) or "
                             "a CudaDevice of that device.")

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return torch.empty(numel, dtype=dtype, pin_memory=True)

    def _event(self, timing=False):
        return torch.cuda.Event(enable_timing=timing, blocking=True)

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
        return _CudaEvent(start, end, self._anchor)

    def copy_to_host(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._d2h, pairs, after, True)

    def copy_to_device(self, pairs: Pairs, after: Optional[Event]) -> Event:
        return self._copy(self._h2d, pairs, after, False)

    def wait(self, event: Event) -> float:
        torch.cuda.current_stream(self.device).wait_event(event._end)
        return 0.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
