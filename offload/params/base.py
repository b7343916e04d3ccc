"""params/base.py: the facts about parameters every side shares (shapes for the layout,
validation)."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

from ..base.dist import local
from ..base.dtypes import LOW_PRECISION
from ..base.tensors import bump_versions, check_tensor
from ..state.layout import Shape

__all__ = ["LOW_PRECISION", "frozen", "shapes_of", "check_device_params", "check_grad",
           "check_param", "bump_stepped", "resized"]


def bump_stepped(groups: Sequence[Sequence[torch.Tensor]], active: list) -> None:
    """The step wrote new weights into the parameters ``active`` (per group, bool masks): their
    version counters go up by one, as after torch's in-place update (that of the parameter object a
    forward saves: a sharded parameter's DTensor), and only theirs (a parameter without a gradient
    is not written)."""
    written = []
    for ps, a in zip(groups, active):
        if a.all():
            written += ps   # (every warm step of a model whose parameters all have gradients)
        elif a.any():
            written += [ps[i] for i in np.flatnonzero(a).tolist()]
    bump_versions(written)


def frozen(p) -> bool:
    """A frozen ``nn.Parameter`` (``requires_grad=False``, e.g. a LoRA base) reserves no state
    until it first has a gradient. A plain tensor is stepped through gradients set by hand: always
    reserved."""
    return isinstance(p, torch.nn.Parameter) and not p.requires_grad


def shapes_of(groups: Sequence[Sequence[torch.Tensor]], all_masters: bool,
              first_group: int = 0) -> List[Shape]:
    """Layout shapes of local shards; a master section iff bf16/fp16 or ``all_masters`` (the
    side's: params/side.py); frozen: no state yet."""
    out = []
    for gi, params in enumerate(groups, start=first_group):
        for i, p in enumerate(params):
            lp = local(p)
            out.append(Shape(gi, i, lp.numel(), lp.element_size(),
                             master=all_masters or lp.dtype in LOW_PRECISION,
                             active=not frozen(p)))
    return out


def resized(gi: int, i: int, was: int, now: int, mode: str) -> RuntimeError:
    """The error for a parameter laid out for ``was`` elements that has ``now``."""
    return RuntimeError(
        f"parameter {i} of group {gi} has {now} elements, but its optimizer state was made for "
        f"{was} (it changed size since, e.g. p.data = a tensor of another shape): give it back a "
        f"tensor of {was} elements, or build a new optimizer for the resized parameters (with "
        f"storage={mode!r} the state is laid out for the sizes the parameters had)")


def check_param(p, gi: int, i: int, dtype, numel: int, mode: str, device_side: bool) -> None:
    """Clear exceptions for a parameter the layout cannot step: another size or dtype than the
    layout's (a model cast after the optimizer was built), and for device parameters, not
    contiguous (the new weights would go into a temporary copy)."""
    lp = local(p)
    if lp.numel() != numel:
        raise resized(gi, i, numel, lp.numel(), mode)
    if lp.dtype != dtype:  # the bucket layout depends on it (master section or not)
        raise RuntimeError(
            f"parameter {i} of group {gi} changed dtype ({dtype} -> {lp.dtype}) since the "
            f"optimizer was created with storage={mode!r}: its state and buffers are laid out "
            f"for {dtype}: cast the parameters back (e.g. model.to({dtype})) before the next "
            "step, or build a new optimizer for the cast model and load this one's "
            "state_dict() into it")
    if device_side and not lp.is_contiguous():
        raise RuntimeError(
            f"parameter {i} of group {gi} is not contiguous (strides {tuple(lp.stride())}); "
            "offload never updates a temporary copy: make it contiguous first "
            "(p.data = p.data.contiguous())")


def check_device_params(groups, ready: list, dtypes: list, numels: list, mode: str) -> None:
    """``check_param`` of every device parameter with state (``ready``: per group, a bool mask):
    before anything reads them (masters re-read after a write) or uploads new weights into them."""
    for gi, (ps, r, ds, ns) in enumerate(zip(groups, ready, dtypes, numels)):
        for i, p in enumerate(ps):
            if r[i]:
                lp = local(p)
                if lp.dtype != ds[i] or lp.numel() != ns[i] or not lp.is_contiguous():
                    check_param(p, gi, i, ds[i], ns[i], mode, True)


def check_grad(p, g, gi: int, i: int, dtype, numel: int, mode: str, device_side: bool) -> None:
    """Clear exceptions for a parameter/gradient the layout cannot step."""
    check_param(p, gi, i, dtype, numel, mode, device_side)
    lp, lg = local(p), local(g)
    if device_side:
        if lg.shape != lp.shape or lg.dtype != lp.dtype:
            raise RuntimeError(f"gradient of parameter {i} of group {gi} has shape "
                               f"{tuple(lg.shape)} and dtype {lg.dtype}; expected "
                               f"{tuple(lp.shape)} and {lp.dtype}")
        if not lg.is_contiguous():
            # its flat pieces would be made by a copy kernel on the worker's stream, which no event
            # orders after backward or before the side stream's D2H
            raise RuntimeError(f"gradient of parameter {i} of group {gi} is not contiguous "
                               f"(strides {tuple(lg.stride())}): offload copies gradients to the "
                               "host as flat pieces of their own memory; make it contiguous "
                               "first (p.grad = p.grad.contiguous())")
        return
    check_tensor(lp, f"parameter {i}", dtypes=(torch.float32,) + LOW_PRECISION)
    check_tensor(lg, f"gradient of parameter {i}", dtypes=(lp.dtype,), shape=lp.shape)
