"""params/: WHERE THE PARAMETERS AND GRADIENTS LIVE. ``host`` (CPU tensors, FSDP2 local shards on
the CPU) and ``device`` (parameters on an ``offload.device.Device``: CUDA, or CpuDevice/FakeDevice
in tests). A side turns the pieces of a bucket into kernel pointers; it never sees where the state
lives (offload/state/). Every side implements the interface of side.py; ``side_maker`` (here, not
in side.py, so that the sides import side.py and nothing imports back) says how an engine builds
its side."""
from __future__ import annotations

from typing import Callable, Optional

from .side import ParamSide

__all__ = ["ParamSide", "side_maker"]


def side_maker(device=None, staging_slots: int = 3,
               wrap: Optional[Callable] = None) -> Callable[[list, list], ParamSide]:
    """How a state engine builds its side from its lists (parameters, dtypes per group): host
    parameters without ``device``, else ``staging_slots`` staging slots on ``device``, given to
    ``wrap`` (schedule/delayed.py HeldParams: the weights held for a delayed update) if any."""
    if device is None:
        from .host import HostParams
        return HostParams

    def make(groups: list, dtypes: list) -> ParamSide:
        from .device import DeviceParams
        side = DeviceParams(groups, device, staging_slots, dtypes)
        return side if wrap is None else wrap(side)
    return make
