"""device/cuda.py: CudaDevice, two side streams (D2H, H2D) next to the compute stream, pinned host buffers."""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from .base import Device, Event, Pairs

__all__ = ["CudaDevice"]


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

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
