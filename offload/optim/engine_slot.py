"""optim/engine_slot.py: ``EngineSlot``, the part of offload.Adam/AdamW (optim/adam.py's ``_slot``)
that knows how its state engine (offload/engine/engine.py, ``opt._engine``) is built: the
constructor's storage arguments, the device of GPU offload (or None), which param groups the engine
holds (host parameters without those torch's code steps, offload/optim/fallback.py; device
parameters all), and when and how it is built again from ``opt.state`` (offload/engine/rebuild.py):
where a group's params list or amsgrad changed, in every configuration, and when an optimizer is
unpickled (host parameters, fp32 moments in RAM: the one configuration that pickles).
"""
from __future__ import annotations

from typing import Callable, Optional

from . import fallback
from ..moments.format import moment_format
from .gpu import make_state_engine
from ..engine.rebuild import fits, rebuild

__all__ = ["EngineSlot"]

# the arguments of an optimizer unpickled from a version that did not record them
_UNPICKLED = dict(state="ram", nvme_dir=None, host_budget="2GiB", keep=False, nvme_options={},
                  gpu_options={})


class EngineSlot:
    def __init__(self, args: Optional[dict] = None, device=None, mode: str = "ram",
                 moments: str = "fp32") -> None:
        # make_state_engine's keywords, and state=
        self.args = dict(_UNPICKLED) if args is None else args
        self.device = device   # offload.device.Device of GPU offload, or None
        self.mode = mode       # where the state lives: "ram", "nvme", "mmap"
        self.moments = moments

    @classmethod
    def configure(cls, state: str, nvme_dir, host_budget, keep_files: bool,
                  nvme_options: Optional[dict],
                  gpu_options: dict, device, moments: str, moments_min_size: int) -> "EngineSlot":
        """From the constructor's arguments (checked), once the device is known."""
        if state == "ram" and nvme_options and device is None:
            raise ValueError("nvme_options={'staging_slots': ...} with storage='ram' only applies "
                             "to device parameters")
        opts = dict(nvme_options or {})
        if moment_format(moments).compressed:
            opts.update(moments=moments, moments_min_size=moments_min_size)
        return cls(dict(state=state, nvme_dir=nvme_dir, host_budget=host_budget, keep=keep_files,
                        nvme_options=opts, gpu_options=gpu_options), device, state, moments)

    @property
    def on_device(self) -> bool:
        """The parameters are on a device (GPU offload), stepped through a device schedule."""
        return self.device is not None

    @property
    def picklable(self) -> bool:
        """Host parameters with fp32 moments in RAM: the optimizer pickles (its engine is built
        again from opt.state when it is unpickled)."""
        compressed = moment_format(self.moments).compressed
        return self.mode == "ram" and not compressed and not self.on_device

    def check_picklable(self) -> None:
        """TypeError naming what keeps an optimizer with this (built) engine from being pickled or
        deep-copied."""
        if not self.picklable:
            what = ("NVMe/mmap state" if self.mode != "ram" else
                    "parameters on a device (GPU offload)" if self.on_device else
                    "compressed moments")
            raise TypeError(f"an optimizer with {what} cannot be pickled or deep-copied; use "
                            "state_dict() / load_state_dict()")

    def groups(self, param_groups: list, router) -> list:
        """The param groups as the state engine holds them: host parameters without those torch's
        code steps (``router``: offload/optim/fallback.py; their state stays in host RAM), device
        parameters all."""
        return param_groups if self.on_device else router.split(param_groups)[0]

    def index(self, param_groups: list, router) -> dict:
        """{(group, position in the engine's list of :meth:`groups`): index in torch's state_dict
        numbering}."""
        return fallback.engine_index(param_groups, self.groups(param_groups, router))

    def make(self, groups: list):
        """An empty state engine for ``groups`` (as :meth:`groups` returns them), without the
        parameters whose state stays on the device (``resident``)."""
        a = self.args
        engine = make_state_engine(groups, a["state"], nvme_dir=a["nvme_dir"],
                                   host_budget=a["host_budget"],
                                   keep=a["keep"], nvme_options=a["nvme_options"],
                                   device=self.device,
                                   gpu_options=a["gpu_options"], resident=self.resident)
        engine.resident_version = self.resident_version
        return engine

    def keep_on_device(self, params: list) -> None:
        """From the next time the engine is laid out, the state of ``params`` stays on the device
        (schedule/split.py): the engine is built again without them."""
        self.__dict__["resident"] = list(params)
        self.__dict__["resident_version"] = self.resident_version + 1

    resident = property(lambda self: self.__dict__.get("resident", ()))
    resident_version = property(lambda self: self.__dict__.get("resident_version", 0))

    def stale(self, engine, native: list, stepping: bool) -> bool:
        """``engine`` must be built again for ``native`` (None, or a group's params list changed,
        or, ``stepping``, its amsgrad; or the parameters kept on the device changed)."""
        return (engine is None or not fits(engine, native, stepping)
                or getattr(engine, "resident_version", 0) != self.resident_version)

    def rebuild(self, native: list, state, names: Callable[[int, int], str], old=None) -> tuple:
        """(a new engine for ``native`` holding ``state``, {parameter: its new opt.state entry});
        raises before any change (offload/engine/rebuild.py). ``old``: the engine it replaces, or
        None."""
        held = [p for gi, ps in enumerate(old.groups) for i, p in enumerate(ps)
                if (gi, i) not in old.excluded] if old is not None else ()   # (state in its tier)
        return rebuild(lambda: self.make(native), native, state, names, held)
