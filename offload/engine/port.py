"""engine/port.py: StepPort, what the device schedule and the small-parameter optimizer see of the
optimizer.

The schedule (schedule/device_step.py, the CPU worker of schedule/backward.py) and DeviceSideAdam
(offload/schedule/smallparams.py) never hold the optimizer itself: they get these callables, built
once from the optimizer's public API (``param_groups``, ``state``, ``group_hyper``,
``kernel_threads``, the pending clip coefficient, and the ``grad_scale`` / ``found_inf`` that
``torch.amp.GradScaler`` sets on an optimizer that steps with AMP scaling). What they may read or
change of it is therefore listed here, in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, MutableMapping, Optional, Tuple

__all__ = ["StepPort", "port_of"]


@dataclass(frozen=True)
class StepPort:
    groups: Callable[[], list]                        # the live param_groups
    state: Callable[[], MutableMapping]               # the live opt.state
    # validated, finite hyperparameters of group gi (else ValueError)
    hyper: Callable[[int], dict]
    # the optimizer's threads= (0: the pool's size)
    threads: Callable[[], int]
    pending: Callable[[], float]                      # the clip coefficient left for the next step
    # record one, tied to these parameters' gradients
    set_pending: Callable[[float, list], None]
    # (grad_scale, found_inf) from GradScaler
    amp: Callable[[], Tuple[Optional[object], Optional[object]]]


def port_of(opt) -> StepPort:
    """The port of an ``offload.Adam`` / ``AdamW``, through its public API only."""
    # vars(opt)["state"], the dict itself: opt.state waits for a CPU step still running
    # (optim/adam.py), which the schedule must not, nor the worker that commits a step into it
    return StepPort(groups=lambda: opt.param_groups, state=lambda: vars(opt)["state"],
                    hyper=opt.group_hyper, threads=lambda: opt.kernel_threads,
                    pending=opt.pending_clip_coefficient, set_pending=opt.set_clip_coefficient,
                    amp=lambda: (getattr(opt, "grad_scale", None),
                                 getattr(opt, "found_inf", None)))
