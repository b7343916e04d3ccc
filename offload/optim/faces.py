"""optim/faces.py: the optimizer's one object for where its parameters are: ``StepFace``, the
interface, ``HostFace`` (parameters on the CPU) and ``DeviceFace`` (GPU offload: the device
schedule, schedule/device_step.py), and ``start``, the one factory that chooses between them.

``offload.Adam/AdamW`` (optim/adam.py) hold one face, ``_face``, made by ``start`` once the state
engine exists (unpickled: before it is built from opt.state), for the optimizer's whole life; its
methods call it in a line each and never ask which face they have. When the state engine is built
again (edited param groups, optim/rebuilding.py) the face is told so (``before_rebuild``,
``restart``): the device face closes its schedule and starts one over the new engine.
A face gets what it uses of the optimizer at construction: the port (engine/port.py StepPort) and
``lay_out``, which lays the engine out for the param groups as they are (the optimizer's
``_sync_engine``); the host face also the clip coefficient, the router of the parameters torch's
code steps (optim/fallback.py) and ``fail``, which marks the optimizer failed.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Optional

from . import fallback
from .checks import _check_hyper
from ..schedule.device_step import DeviceStep
from ..schedule.feedstep import WriteRaceError
from ..schedule.resident import resident_for
from ..schedule.split import Split

__all__ = ["DeviceFace", "HostFace", "StepFace", "start"]

log = logging.getLogger("offload")
_ONLY = "{} is only available in GPU-offload mode (parameters on a GPU)"

# last_step_stats() of host parameters: the device schedule's keys, the copies at 0
_HOST_STATS = dict(step=0, d2h_s=0.0, kernel_s=0.0, h2d_s=0.0, nvme_s=0.0, exposed_s=0.0,
                   d2h_bytes=0, h2d_bytes=0, buckets=0, skipped=False, grad_multiplier=1.0,
                   overlapped=False, waited_all=False, complete=True)


class StepFace:
    """What the optimizer calls for where its parameters are. The bodies here are those of a face
    whose steps are done when step() returns (nothing in flight, nothing to wait for)."""
    on_device = False            # the optimizer's ``gpu_offload``
    steps_during_backward = False
    amp_scaling = False          # GradScaler hands step() grad_scale / found_inf: no unscaling
    schedule: Optional[DeviceStep] = None   # the device schedule, if any
    engine = None                # the state engine it steps (engine/engine.py): ``_engine``

    def description(self) -> str:
        """Where the parameters are stepped (the optimizer's INFO line)."""
        raise NotImplementedError

    def step(self, grad_multiplier: Optional[float]) -> None:
        """The optimizer's step() after its closure: checks first (a refused step changes
        nothing)."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool):
        """The optimizer's clip_grad_norm_ (optim/clipping.py: the coefficient the next step
        applies)."""
        raise NotImplementedError

    def check_open(self) -> None:
        """RuntimeError where the optimizer may no longer step, synchronize, save or load."""

    def zero_grad(self, set_to_none: bool) -> None:
        """Before torch's zero_grad: nothing may still read the gradients."""

    def synchronize(self) -> None:
        """The last step landed (the new weights where the parameters are), the engine laid out
        for the param groups as they are."""

    def settle(self) -> None:
        """Before ``opt.state`` is read: no step still writes it."""

    def quiesce(self) -> None:
        """Before add_param_group grows the engine: nothing in flight, user writes adopted."""

    def before_rebuild(self) -> None:
        """Before the engine is built again for edited param groups (raises to refuse it)."""

    def restart(self, engine) -> None:
        """Step ``engine``, the state engine built again, from now on."""
        self.engine = engine

    def load_state(self, loaded: bool = False) -> None:
        """After add_param_group (``loaded``: load_state_dict): the write tracking starts again."""

    def no_sync(self):
        """The optimizer's no_sync(): backward passes inside only accumulate."""
        return contextlib.nullcontext()

    def set_accumulation_boundary(self, flag: bool) -> None:
        """False: the following backward passes only accumulate; True: the next one sends
        gradients."""

    def reload_params(self) -> None:
        raise RuntimeError(_ONLY.format("reload_params"))

    def keep_state_on_device(self, params: list) -> None:
        """The state of ``params`` stays on the device from now on (schedule/split.py decides
        it)."""
        raise RuntimeError(_ONLY.format("gpu_state"))

    def export_chrome_trace(self, path: str) -> int:
        raise RuntimeError(_ONLY.format("export_chrome_trace"))

    def last_step_stats(self, wait: bool) -> Optional[dict]:
        """The latest finished step's timings and bytes (optim/adam.py last_step_stats)."""
        st = self.engine.last_stats
        if st is None:
            return None
        out = dict(_HOST_STATS)
        out.update(st)
        out["exposed_s"] = out.pop("step_s", out["exposed_s"])
        return out

    def close(self) -> None:
        """The optimizer's close(), before its state engine closes."""


class HostFace(StepFace):
    """Parameters on the CPU: step() checks the parameters torch's code steps (``router``), lays
    the engine out, steps the others in the engine, then those in torch's code."""

    def __init__(self, port, lay_out: Callable, clip, router, fail: Callable, decoupled,
                 engine=None):
        self.port, self.lay_out, self.clip, self.router = port, lay_out, clip, router
        self.fail, self.decoupled, self.engine = fail, decoupled, engine

    def description(self) -> str:
        return "parameters on the CPU, stepped in place by the native kernel"

    def step(self, grad_multiplier: Optional[float]) -> None:
        port = self.port
        groups, state = port.groups(), port.state()
        mult = self.clip.multiplier(grad_multiplier)
        native, fb = self.router.split(groups)   # fb: torch's code steps them (optim/fallback.py)
        if not fb and self.engine.step_planned(
                # as planned: engine/fastpath.py
                native, port.hyper, state, mult, port.threads()):
            self.clip.clear()
            return
        for group, _ in fb:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        fallback.check(state, fb, groups)
        self.lay_out(native, stepping=True)   # (self.engine: the engine built again, if it was)
        self.engine.step(native, port.hyper, state, mult, port.threads())
        self.clip.clear()
        try:
            if fb:
                fallback.step(state, fb, mult, self.decoupled)
        except BaseException as e:
            self.fail(e)   # the engine's parameters are stepped: refuse to continue from here
            raise

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool):
        port = self.port
        return self.clip.clip_grad_norm_(port.groups(), self.router, port.threads(), max_norm,
                                         norm_type, error_if_nonfinite)


class DeviceFace(StepFace):
    """Parameters on a device: every call goes to the device schedule (schedule/device_step.py),
    made by ``make(engine, owns_device)`` and made again over an engine built again."""
    on_device = True
    amp_scaling = True

    def __init__(self, lay_out: Callable, make: Callable, engine, owns_device: bool,
                 keep_on_device: Callable[[list], None]):
        self.lay_out, self.make, self.keep_on_device = lay_out, make, keep_on_device
        self.schedule: DeviceStep = make(engine, owns_device)
        opt = self.schedule.gpu_state   # (schedule/split.py: "auto", bytes, or 0)
        self.split = Split(opt, self.schedule.device) if opt else None

    engine = property(lambda self: self.schedule.engine)
    steps_during_backward = property(lambda self: bool(self.schedule.eager))

    def description(self) -> str:
        return _on_device(self.schedule)

    def step(self, grad_multiplier: Optional[float]) -> None:
        self.lay_out(stepping=True)   # (self.schedule: one over the engine built again, if it was)
        self.schedule.step(grad_multiplier)
        if self.split is not None:
            self.rebalance(self.split.after_step(self.schedule))

    def keep_state_on_device(self, params: list) -> None:
        if self.split is None:
            raise RuntimeError("gpu_state=0 (or a configuration it turns itself off in): no split")
        self.rebalance(params)

    def rebalance(self, params: Optional[list]) -> None:
        """The state of ``params`` stays on the device from now on (None: no change): it is moved
        there, and the engine built again without them. If that fails (device memory), nothing
        changes and the split stays as it was (a warning says why)."""
        if params is None:
            return
        sched = self.schedule
        sched.synchronize()
        try:   # their state to the device first: nothing has changed where it does not fit
            moved = resident_for(sched.port, params)
        except Exception as e:   # noqa: BLE001 (device memory)
            self.split.option = 0
            warnings.warn(f"offload: the state of {len(params)} parameters could not stay on the "
                          f"device ({type(e).__name__}: {e}); it stays in host memory",
                          RuntimeWarning)
            return
        # (restart hands it to the schedule made over the engine built again)
        sched.resident = moved
        self.keep_on_device(params)
        self.lay_out(stepping=True)   # the engine built again without them (optim/rebuilding.py)
        self.split.applied(params)
        log.info("offload: the Adam state of %d parameters (%.2f GB of device memory) stays on "
                 "the device, stepped there; the CPU steps the rest", len(params),
                 self.split.info["gpu_state_bytes"] / 1e9)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool):
        return self.schedule.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def check_open(self) -> None:
        self.schedule.check_open()

    def zero_grad(self, set_to_none: bool) -> None:
        self.schedule.zero_grad(set_to_none)

    def synchronize(self) -> None:
        self.schedule.synchronize()
        self.lay_out(stepping=True)

    def settle(self) -> None:
        """(schedule/backward.py ``settle``: with NVMe state no state is read ahead either)"""
        feed = self.schedule.feed
        if feed is not None and not self.schedule.closed:
            feed.settle()

    def quiesce(self) -> None:
        self.schedule.quiesce()

    def before_rebuild(self) -> None:
        """The schedule idle; refused between a backward and its step(), whose gradients went to
        the CPU for the groups as they were."""
        feed = self.schedule.feed
        if feed is not None and feed.in_cycle:
            raise RuntimeError(
                "a param group's 'params' list or amsgrad was changed after backward() and before "
                "step(): with parameters on a device their gradients go to the CPU during "
                "backward, for the groups as they were. Change param groups between step() and "
                "the next forward (undo the change to take this step)")
        self.schedule.quiesce()

    def restart(self, engine) -> None:
        """Its hooks, CPU worker and staging ring go; the device stays, and so does the state kept
        there for the parameters that stay (schedule/resident.py)."""
        old = self.schedule
        owns, old.owns_device = old.owns_device, False
        old.close()
        self.schedule = self.make(engine, owns, old.resident)

    def load_state(self, loaded: bool = False) -> None:
        self.schedule.load_state(loaded)

    def no_sync(self):
        return self.schedule.no_sync()

    def set_accumulation_boundary(self, flag: bool) -> None:
        self.schedule.set_accumulation_boundary(flag)

    def reload_params(self) -> None:
        self.schedule.reload_params()

    def export_chrome_trace(self, path: str) -> int:
        return self.schedule.export_chrome_trace(path)

    def last_step_stats(self, wait: bool) -> Optional[dict]:
        st = self.schedule.last_step_stats(wait)
        if st is not None and self.split is not None:
            st.update(self.split.stats())
        return st

    def close(self) -> None:
        """The last step lands first; a write race is reported, not raised (close() is cleanup)."""
        if self.schedule.closed:
            return
        try:
            self.schedule.synchronize()
        except WriteRaceError as e:
            warnings.warn(str(e), RuntimeWarning, stacklevel=3)
        finally:
            self.schedule.close()


def start(port, device, gpu_options: dict, engine, owns_device: bool = False, *, lay_out: Callable,
          clip, router, fail: Callable, decoupled, describe: Optional[Callable],
          keep_on_device: Optional[Callable] = None) -> StepFace:
    """The face of parameters on ``device`` (None: host memory) over the state ``engine`` (None:
    built later, ``restart``); ``owns_device``: the face closes the device. Logs at INFO
    ``describe(where the parameters are stepped, engine)`` (None: nothing), and again for each
    device schedule made over an engine built again."""
    if device is None:
        face = HostFace(port, lay_out, clip, router, fail, decoupled, engine)
        if describe is not None:
            log.info(describe(face.description(), engine))
        return face

    def make(eng, owns: bool, resident=None) -> DeviceStep:
        sched = DeviceStep(port, eng, device, resident=resident, **gpu_options)   # (staging ring)
        sched.owns_device = owns
        if describe is not None:
            log.info(describe(_on_device(sched), eng))
        return sched
    return DeviceFace(lay_out, make, engine, owns_device, keep_on_device)


def _on_device(sched: DeviceStep) -> str:
    return (f"parameters on device {sched.device.name} (GPU offload: gradients are copied to host "
            f"memory, the CPU steps them{' during backward' if sched.eager else ''}, the new "
            "weights are copied back)")
