"""base/torchadam.py: what torch's own Adam code (torch.optim.adam, the single-tensor loop)
raises on part-way through its loop, after updating the parameters before the one it fails on,
checked beforehand: the state entries it reads of a parameter (optim/fallback.py steps some
parameters with that code); and the hyperparameters an inner torch optimizer over some of the
parameters takes from the optimizer's own param groups (schedule/smallparams.py, resident.py)."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HYPER_KEYS", "check_state", "follow_groups", "step_refused"]

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def follow_groups(inner, outer: list, group_of: list) -> None:
    """``inner`` (a torch optimizer) takes the hyperparameters of ``outer`` (param groups): its
    group k those of ``outer[group_of[k]]``."""
    for ig, gi in enumerate(group_of):
        for k in HYPER_KEYS:
            inner.param_groups[ig][k] = outer[gi][k]


def check_state(p: torch.Tensor, st: dict, group: dict, where: str) -> None:
    """The entries of ``st`` (parameter ``p``'s state, not empty) that torch's update of ``p`` with
    the hyperparameters of ``group`` reads: a ValueError naming ``where`` (the parameter) if it
    would raise on one."""
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"]
                                        and "max_exp_avg_sq" in st
                                        else ())
    for key in keys:
        t = st.get(key)
        if (not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype
            or t.device != p.device):
            have = (f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
                    if isinstance(t, torch.Tensor)
                    else "missing" if t is None else type(t).__name__)
            raise ValueError(f"state '{key}' of {where} is {have}, but the parameter is a "
                             f"{p.dtype} tensor of shape {tuple(p.shape)} on {p.device}: fix or "
                             "delete opt.state[p] (deleted: the parameter starts afresh)")
    why = step_refused(st.get("step"), group)
    if why is not None:
        raise ValueError(f"state 'step' of {where} {why}; torch's Adam code would "
                         "raise on it part-way. Give it the parameter's step count as "
                         "torch's (a 0-dim float32 tensor, e.g. opt.state[p]['step'] = "
                         "torch.tensor(10.0)), or delete opt.state[p] to start it afresh")


def step_refused(step_, group) -> Optional[str]:
    """Why torch's single-tensor Adam (what optim/fallback.py runs) raises on the ``step`` entry
    ``step_``, after stepping the parameters before it; None when it takes it (NaN, inf and
    fractional counts included: its results are then torch's). Its own operations, on a copy."""
    if not isinstance(step_, torch.Tensor):   # (adam(): "state_steps ... singleton tensors")
        return f"is {step_!r}, not a tensor"
    if step_.numel() != 1 or step_.dtype == torch.bool or step_.is_complex():
        return f"is a {step_.dtype} tensor of shape {tuple(step_.shape)}, not one real number"
    try:
        step = step_.detach().clone().add_(1).item()   # step_t += 1; _get_value(step_t)
        beta1, beta2 = group["betas"]
        group["lr"] / (1 - beta1 ** step)   # step_size: ZeroDivisionError at a correction of 0
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    except (ArithmeticError, RuntimeError) as e:
        return f"is {step_.item()} ({type(e).__name__}: {e})"
    if isinstance(bias_correction2_sqrt, complex):   # a negative correction: no real square root
        return f"is {step_.item()}: the bias correction at step {step} is negative"
    return None
