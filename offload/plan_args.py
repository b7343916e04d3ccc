"""plan_args.py: the arguments of ``offload.plan`` (offload/planner.py), checked before anything
is computed: a bad value is refused in one line that names it (ValueError; TypeError for a value
of the wrong kind). Where the optimizer has a rule for the same setting, the planner calls that
rule (offload/state/choice.py, offload/state/tier.py, offload/moments/format.py), so it never
plans what the optimizer refuses. Also here: the tensors a plan covers (:func:`inventory`) and
the planner's limits on what it lays out one by one (``MAX_TENSORS`` tensors, ``MAX_BUCKETS``
pieces of split tensors), which keep every plan to a few seconds.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import List, Optional, Tuple

import torch

from .base.units import human, parse_size
from .moments.format import check_amsgrad, check_min_size, check_moments
from .state.choice import check_storage
from .state.statedir import parse_dirs

__all__ = ["DTYPES", "MAX_COUNT", "MAX_TENSORS", "MAX_BUCKETS", "count", "dtype", "device",
           "flag", "at_least", "activation", "threads", "budget", "dirs", "storage", "moments",
           "bandwidths", "inventory", "check_buckets"]

# the names of parameter and gradient dtypes (param_dtype=, grad_dtype=, the benches' --dtype): not
# moment formats, whose names overlap ("fp32", "bf16") but which are objects (moments/format.py)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_DTYPE_SET = frozenset(DTYPES.values())
_DTYPE_NAMES = "'fp32', 'bf16', 'fp16' (or torch.float32, torch.bfloat16, torch.float16)"
MAX_COUNT = 2 ** 63 - 1       # elements one tensor can hold (torch sizes are int64)
MAX_TENSORS = 100_000         # parameter tensors in a plan (the largest models have fewer)
MAX_BUCKETS = 100_000         # state buckets of the tensors cut into pieces (NVMe/mmap state)
_WHAT = ("plan() takes a torch.nn.Module, an iterable of parameters or param groups, a parameter "
         "count or the path of a Hugging Face config.json")


def count(n) -> int:
    """A parameter count: a whole number from 1 to ``MAX_COUNT`` (an int, or a float like 7e9)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"{_WHAT}; got {n!r}")
    whole = isinstance(n, numbers.Integral) or (math.isfinite(n) and float(n).is_integer())
    if not whole or n < 1:
        raise ValueError(f"parameter count must be a whole number >= 1, got {n!r}")
    if n > MAX_COUNT:
        raise ValueError(f"parameter count {int(n):,} is more than one tensor holds (at most "
                         f"{MAX_COUNT:,} elements)")
    return int(n)


def dtype(x, what: str) -> Optional[torch.dtype]:
    """``param_dtype`` / ``grad_dtype``: None, a name ('bf16', ...) or a dtype offload steps."""
    if x is None:
        return None
    if isinstance(x, str) and x.lower() in DTYPES:
        return DTYPES[x.lower()]
    if isinstance(x, torch.dtype) and x in _DTYPE_SET:
        return x
    err = ValueError if isinstance(x, (str, torch.dtype)) else TypeError
    raise err(f"{what} must be one of {_DTYPE_NAMES}, got {x!r}")


def device(x) -> str:
    """Where forward and backward run: 'cpu' or 'cuda' (None: cuda if available)."""
    if x is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    msg = f"device must be 'cpu' or 'cuda' (where forward and backward run), got {x!r}"
    if not isinstance(x, (str, torch.device)):
        raise TypeError(msg)
    try:
        kind = torch.device(x).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(msg)
    return kind


def flag(x, what: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{what} must be True or False, got {x!r}")
    return x


def at_least(x, what: str, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{what} must be an int >= {lo}, got {x!r}")
    if x < lo:
        raise ValueError(f"{what} must be an int >= {lo}, got {x!r}")
    return x


def activation(x) -> Optional[int]:
    """``activation_bytes``: None, or a number of bytes >= 0."""
    if x is None:
        return None
    msg = f"activation_bytes must be a number of bytes >= 0, got {x!r}"
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(msg)
    if not 0 <= x < math.inf:
        raise ValueError(msg)
    return int(x)


def seconds(x, what: str) -> Optional[float]:
    """``backward_s``, ``forward_s``: None, or a finite number of seconds >= 0."""
    if x is None:
        return None
    msg = f"{what} must be a number of seconds >= 0, got {x!r}"
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(msg)
    if not 0 <= x < math.inf:
        raise ValueError(msg)
    return float(x)


def gpu_state(x):
    """``gpu_state``: "auto", or bytes >= 0 (an int or a size string), as the optimizer takes
    it."""
    if x == "auto":
        return x
    if x == 0 and type(x) is int:
        return 0
    msg = f"gpu_state must be 'auto', a size such as '8GiB' or 0, got {x!r}"
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise TypeError(msg)
    try:
        return parse_size(x)
    except ValueError:
        raise ValueError(msg) from None


def threads(x) -> Optional[int]:
    """The optimizer's ``threads=`` (its rule, offload/optim/checks.py)."""
    if x is not None and not (isinstance(x, int) and 1 <= x <= 1024):
        raise ValueError(f"threads must be an int in [1, 1024] or None, got {x!r}")
    return x


def budget(x) -> int:
    """``host_budget`` in bytes, as the optimizer parses it."""
    try:
        return parse_size(x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"host_budget={x!r}: {e}") from None


def dirs(nvme_dir) -> List[Optional[str]]:
    """The drives ``nvme_dir`` names, as the optimizer reads it ([None] for None)."""
    try:
        return parse_dirs(nvme_dir)
    except TypeError as e:
        raise TypeError(f"nvme_dir={nvme_dir!r}: {e}") from None


def storage(kind: str, nvme_dir) -> str:
    """What the optimizer refuses of ``storage`` and ``nvme_dir`` (offload/state/choice.py)."""
    check_storage(kind, nvme_dir)
    return kind


def moments(fmt, min_size, amsgrad: bool) -> Tuple[str, int]:
    """``moments``, ``moments_min_size`` (the optimizer's rules); amsgrad needs fp32 moments."""
    check_moments(fmt)
    check_min_size(min_size)
    check_amsgrad(fmt, amsgrad)
    return fmt, min_size


def bandwidths(spec):
    """``bandwidths``: None, 'measure', JSON paths, a Bandwidths or a dict of figures (checked)."""
    from .bandwidth import Bandwidths
    if spec is None:
        return None
    if isinstance(spec, Bandwidths):
        return spec.checked()
    if isinstance(spec, dict):
        return Bandwidths.of(spec)
    if isinstance(spec, (str, os.PathLike)):
        if not any(p.strip() for p in os.fsdecode(spec).split(",")):
            raise ValueError(f"bandwidths={spec!r} names no file: give 'measure', the JSON of "
                             "python -m offload.bench kernel/io, or the figures")
        return spec
    named = (str, os.PathLike)
    paths = isinstance(spec, (list, tuple)) and all(isinstance(p, named) for p in spec)
    if paths and spec:
        return spec
    raise TypeError("bandwidths must be 'measure', JSON paths (a str, comma-separated, or a "
                    f"list), an offload.bandwidth.Bandwidths or a dict of bytes/s; got {spec!r}")


def inventory(what, param_dtype: Optional[torch.dtype]) -> List[Tuple[int, torch.dtype, bool]]:
    """[(numel, dtype, active)] per parameter tensor of a module, an iterable of tensors or param
    groups (each tensor once), or a count (one tensor); ``active``: it gets optimizer state (frozen
    ``nn.Parameter`` s do not)."""
    if isinstance(what, (numbers.Real, type(None))):
        return [(count(what), param_dtype or torch.float32, True)]
    if isinstance(what, torch.Tensor):
        raise TypeError(f"{_WHAT}: an iterable of Tensors or dicts, but got "
                        f"{torch.typename(what)}")
    if isinstance(what, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                        "the ordering of tensors in sets will change between runs. Please use "
                        "a list instead.")
    if isinstance(what, torch.nn.Module):
        items = what.parameters()
    else:
        try:
            items = iter(what)
        except TypeError:
            raise TypeError(f"{_WHAT}; got {type(what).__name__}") from None
    params: list = []
    for gi, item in enumerate(items):
        if isinstance(item, dict):
            if "params" not in item:
                raise ValueError(f"param group {gi} has no 'params'")
            ps = item["params"]
            if isinstance(ps, set):
                return inventory(ps, param_dtype)   # refused as above
            params.extend([ps] if isinstance(ps, torch.Tensor) else ps)
        else:
            params.append(item)
        if len(params) > MAX_TENSORS:
            raise ValueError(f"more than {MAX_TENSORS:,} parameter tensors: the planner lays out "
                             f"at most {MAX_TENSORS:,}")
    if not params:
        raise ValueError("no parameters to plan (an empty model or list)")
    seen, inv, param = set(), [], torch.nn.Parameter
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            continue
        seen.add(id(p))
        dt = param_dtype or p.dtype
        if dt not in _DTYPE_SET:
            raise ValueError(f"parameter {i} is {dt}: the planner plans float32, bfloat16 and "
                             "float16 parameters (offload's kernel; torch's own code steps the "
                             "others): pass param_dtype= to plan them as one of these")
        # a frozen nn.Parameter gets no state
        active = type(p) is torch.Tensor or p.requires_grad or not isinstance(p, param)
        inv.append((p.numel(), dt, active))
    return inv


def check_buckets(pieces: int, budget_bytes: int, host_budget, state_cap: int) -> None:
    """Refuse a layout whose split tensors would take more than ``MAX_BUCKETS`` buckets, naming
    the budget that brings it under (buckets shrink as the budget grows)."""
    if pieces > MAX_BUCKETS:
        need = -(-budget_bytes * pieces // MAX_BUCKETS)
        raise ValueError(f"host_budget={host_budget!r} would take {pieces:,} state buckets of "
                         f"at most {human(state_cap, 2)}: the planner lays out at most "
                         f"{MAX_BUCKETS:,}; raise host_budget to {human(need, 2)} or more")
