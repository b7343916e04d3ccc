"""device/: the transfer abstraction the parameter side (offload/params/device.py) talks to.

Nothing above it touches CUDA directly. It asks a ``Device`` to
  * ``record()``          an event at the current point of the compute stream,
  * ``copy_to_host()``    copy device tensors into host buffers on the D2H stream, after an event,
  * ``copy_to_device()``  copy host buffers into device tensors on the H2D stream, after an event,
  * ``wait()``            make the compute stream wait for an event (the host is not blocked on a
                          GPU),
  * ``host_empty()``      allocate a host buffer (pinned when that matters).
Every copy returns an ``Event`` with ``synchronize()`` (block the host) and ``query()``.

Three implementations:
  * ``CudaDevice``  - two side streams (D2H, H2D), CUDA events, pinned host memory, non-blocking
                      copies.
  * ``CpuDevice``   - "device" tensors are CPU tensors; copies run synchronously on the caller.
  * ``FakeDevice``  - CPU tensors, but each stream is a background thread that runs copies after a
    random artificial delay. At enqueue it poisons the destination (NaN) and snapshots the source;
    when the copy runs it checks the source was not modified in the meantime. So a buffer read
    before its copy completed yields NaN (results differ from the reference), and a buffer
    overwritten while a copy still reads it is recorded as a violation (``check()`` raises).
    The compute stream is the host itself: ``wait()`` blocks until the event fired.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from .base import CpuDevice, Device, Event
from .cuda import CudaDevice
from .fake import FakeDevice

__all__ = ["Event", "Device", "CudaDevice", "CpuDevice", "FakeDevice", "resolve_device"]


def resolve_device(spec, params: Sequence[torch.Tensor]) -> Optional[Device]:
    """The offload device for these parameters: ``spec`` (a Device, 'cuda', 'cuda:k', 'fake',
    'cpu-test') or, when ``spec`` is None, CUDA if the parameters are on a CUDA device, else None
    (CPU mode). 'cuda' without an index means the parameters' GPU (not the current one); a device
    that does not match the parameters' is refused by name."""
    cuda = {p.device for p in params if p.device.type == "cuda"}
    if spec is None:
        if not cuda:
            return None
        if len(cuda) != 1 or len({p.device for p in params}) != 1:
            raise RuntimeError(f"GPU offload: all parameters must be on one device, got "
                               f"{sorted(str(d) for d in {p.device for p in params})}")
        return CudaDevice(next(iter(cuda)))
    if isinstance(spec, Device):
        device = spec
    elif isinstance(spec, str) and spec in ("fake", "cpu-test", "cpu"):
        # read by DeepSpeed users as "offload to the CPU", which is what offload always does
        if spec == "cpu":
            warnings.warn('offload_device="cpu" selects a test device that drives CPU tensors as '
                          'if they were on a '
                          'GPU; it is spelled "cpu-test" now ("cpu" goes in a later release). For '
                          'a model on the '
                          "CPU, leave offload_device unset: the optimizer state is "
                          "offloaded either way",
                          DeprecationWarning, stacklevel=4)
        device = FakeDevice() if spec == "fake" else CpuDevice()
    elif isinstance(spec, str) and spec.startswith("cuda"):
        device = CudaDevice(next(iter(cuda)) if spec == "cuda" and len(cuda) == 1 else spec)
    else:
        raise ValueError("offload_device must be None, 'cuda', 'cuda:k', a Device, or a test "
                         f"device ('fake', 'cpu-test'), got {spec!r}")
    device.check_params(params)
    return device
