"""engine/adopt.py: a state tensor a user put in ``opt.state`` in place of the one the optimizer holds, taken
over by a resident tier (host RAM): its values are copied into the state's own memory and the state's
view goes back into ``opt.state``, so the step uses exactly what torch's AdamW would use.

What torch would also accept is checked first, with messages that name the entry: the replacement must
be a tensor with the parameter's number of elements (any dtype, layout or device: it is converted),
and it may not share memory with a parameter (the step would write the parameter while reading it).
The check runs only for replaced entries, never on a warm step.

Also here: a parameter given another shape (``p.data = p.data.reshape(...)``, the same elements) has
the views of its state in ``opt.state`` reshaped alike (the same memory), as torch's state would need.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..base.dist import local
from ..params.guards import SharedMemoryError, extent
from ..moments.compressed import CompressedState
from .registry import count_error

__all__ = ["copy_in", "follow_shapes", "missing_entry", "step_count"]


def missing_entry(key: str, where: str, t) -> Exception:
    """The error for an entry the step needs that is gone (``del opt.state[p]['exp_avg']``) or not a
    tensor, as torch's AdamW would fail on it (KeyError / TypeError), with what to do."""
    if t is None:
        return KeyError(f"{where} has no {key!r} (it was deleted or set to None): give it one again, or clear the "
                        "parameter's whole state (del opt.state[p]) to start it afresh")
    return TypeError(f"{where}: {key!r} is a {type(t).__name__}, not a tensor")


def step_count(v, where: str) -> float:
    """The count of a ``step`` entry put in place of the optimizer's own (a one-element real
    tensor, as torch's code takes, or a plain number) if the kernel takes it (registry.py
    count_error); anything else is refused, naming ``where`` (its parameter), before it is used."""
    real = isinstance(v, torch.Tensor) and not (v.dtype == torch.bool or v.is_complex())
    if real and v.numel() == 1:
        v = v.item()
    elif v is None:
        raise missing_entry("step", f"state of {where}", v)
    if isinstance(v, torch.Tensor):
        got = f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    elif not isinstance(v, (int, float)) or isinstance(v, bool):
        got = f"{v!r} ({type(v).__name__})"
    else:
        err = count_error(float(v), where)
        if err is not None:
            raise err
        return float(v)
    raise ValueError(f"state 'step' of {where} is {got}, not a step count: give it one as a "
                     "one-element tensor (torch's is a 0-dim float32 tensor, e.g. "
                     "opt.state[p]['step'] = torch.tensor(10.0))")


def copy_in(cur: torch.Tensor, t, key: str, where: str, groups: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy the replacement ``t`` of state entry ``key`` into ``cur``, the state's own view."""
    if not isinstance(t, torch.Tensor):
        raise missing_entry(key, where, t)
    lt, lc = local(t), local(cur)
    if lt.numel() != lc.numel():
        raise ValueError(f"{where}: {key!r} has shape {tuple(lt.shape)} but the parameter has shape "
                         f"{tuple(lc.shape)}: give it a tensor like the parameter")
    if lt.device.type == "cpu" and lt.numel() and lt.layout == torch.strided:
        a = lt.data_ptr()
        e = a + extent(lt)
        for gi, params in enumerate(groups):
            for i, p in enumerate(params):
                lp = local(p)
                if lp.device.type != "cpu" or not lp.numel():
                    continue
                s = lp.data_ptr()
                if a < s + lp.numel() * lp.element_size() and s < e:
                    raise SharedMemoryError(
                        f"{where}: {key!r} shares memory with parameter {i} of group {gi}: the step would write "
                        "the parameter while reading its state. Give the state a tensor of its own "
                        f"(opt.state[p][{key!r}] = t.clone())")
    lc.copy_(lt.detach().reshape(lc.shape))


def follow_shapes(params: Sequence[torch.Tensor], rows, ready, state, keys: Callable[[int], object],
                  forget: Callable[[int], None]) -> None:
    """Rows ``rows`` of a group (``params``) were revalidated: those with state (``ready``) whose views
    (the entries ``keys(i)`` of ``state[p]``) no longer have the parameter's shape are reshaped;
    ``forget(i)``: the entry changed, look at it again."""
    for i in rows:
        p = params[i]
        if not ready[i] or type(p) not in (torch.Tensor, torch.nn.Parameter):
            continue
        st = state.get(p)
        inner = st.live if isinstance(st, CompressedState) else st
        for key in keys(i):
            t = inner.get(key) if inner else None
            if isinstance(t, torch.Tensor) and t.shape != p.shape and t.numel() == p.numel():
                inner[key] = t.view(p.shape)
                forget(i)
