"""device/base.py: the Event and Device interfaces, and CpuDevice (copies run synchronously on the
caller)."""
from __future__ import annotations

import time
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["Event", "Device", "CpuDevice", "Pairs"]

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
    # CPUs the CPU kernel leaves free by default for threads that launch device work
    launch_threads = 0

    def check_params(self, params: Sequence[torch.Tensor]) -> None:
        """Raise if these parameters live where this device's copies are not ordered with their
        work."""

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

    def synchronize(self) -> None:
        """Block until every stream of this device is idle."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise if a hazard was detected (only the fake device detects any)."""

    def spare_bytes(self) -> int:
        """Device memory this process could still allocate beyond its peak so far, a safety margin
        left (what optimizer state kept on the device may take: schedule/split.py); 0 where
        unknown."""
        return 0

    def close(self) -> None:
        pass


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
