"""testing.py: the supported way for tests and benchmarks to look inside an ``offload.Adam``/``AdamW``:
its state engine, state tier, parameter side, device schedule and device, and I/O fault injection.
It is the one module that reads the optimizer's private attributes, so an internal rename touches
this file only; nothing here is part of the training API.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["state_engine", "tier", "side", "device_schedule", "device", "inject_io_fault"]


def state_engine(opt) -> Optional[object]:
    """The state engine (offload/step/engine.py) of every mode but host parameters with fp32 RAM state
    (None there: that mode runs in offload/host_ram.py)."""
    return opt._store


def tier(opt):
    """Where the state lives (offload/state/): RamTier, NvmeTier or MmapTier."""
    return _engine(opt).tier


def side(opt):
    """Where the parameters live (offload/params/): HostParams or DeviceParams."""
    return _engine(opt).side


def device_schedule(opt) -> Optional[object]:
    """The device schedule (offload/step/device_step.py) of device parameters, else None."""
    return opt._gpu


def device(opt):
    """The offload.device.Device the device schedule copies through."""
    sched = device_schedule(opt)
    if sched is None:
        raise ValueError("this optimizer's parameters are not on a device")
    return sched.device


def inject_io_fault(opt, kind: int, nth: int, drive: int = 0) -> None:
    """Make the NVMe tier's ``nth`` next system call fail with ``kind`` (offload.aio.FAULT_EIO, ...);
    ``drive``: which directory of ``nvme_dir`` (several drives: each has its own I/O engine)."""
    eng = _engine(opt)
    drives = getattr(eng.tier, "drives", None)
    if drives:
        eng = drives[drive]
    eng.engine._set_fault(kind, nth)


def _engine(opt):
    eng = state_engine(opt)
    if eng is None:
        raise ValueError("host parameters with fp32 moments in RAM have no state engine")
    return eng
