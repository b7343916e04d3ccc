"""optim/checks.py: argument checks of offload.Adam/AdamW (torch's messages where torch has one):
parameters, hyperparameters, the constructor's flags and options, a param group's options and
parameters, the `moments=` choice, and the hyperparameters of a group as the kernels take them."""
from __future__ import annotations

import operator

import torch

from ..moments import format as mformat
from ..base.dist import local
from ..state.choice import check_storage
from ..base.dtypes import NATIVE_DTYPES as _PARAM_DTYPES



def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _check_param(p: torch.Tensor, where: str, gpu_mode: bool = False) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(p).__name__}")
    p = local(p)  # DTensor (FSDP2): check the local shard
    if gpu_mode:  # GPU offload: parameters on the device (or CPU tensors driven by a test device)
        if p.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"{where} is on {p.device}: GPU offload supports CUDA parameters")
    elif p.device.type != "cpu":
        raise RuntimeError(f"{where} is on {p.device}: offload steps CPU parameters, or CUDA "
                           "parameters in GPU-offload mode (all parameters on one CUDA device, "
                           "or offload_device=...)")
    if p.layout is not torch.strided:
        raise RuntimeError(f"{where} is a sparse ({p.layout}) tensor: offload steps dense "
                           "parameters; keep it in a torch optimizer for sparse parameters "
                           "(torch.optim.SparseAdam) or make it dense")
    if p.is_complex():
        raise TypeError(f"{where} is complex ({p.dtype}): here offload steps float32, bfloat16 "
                        "and float16 parameters; register torch.view_as_real(p) instead, or keep "
                        "it in a separate torch optimizer")
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(f"{where} has dtype {p.dtype}: here offload steps float32, bfloat16 and "
                        "float16 parameters; convert it (p.data = p.data.float()) or keep it in "
                        "a separate torch optimizer")
    if not p.is_contiguous():
        raise RuntimeError(f"{where} is not contiguous (strides {tuple(p.stride())}): offload "
                           "updates parameters in place and never a temporary copy; make it "
                           "contiguous first")
    # e.g. z.conj().imag: its memory holds the negated values, and is what the kernel updates
    if p.is_neg():
        raise RuntimeError(f"{where} is a lazy negative-bit view: its memory does not hold its "
                           "values; use p.data = p.data.resolve_neg() first")


_F32_MAX = float(torch.finfo(torch.float32).max)


def _check_moments(moments, min_size, amsgrad, params) -> str:
    """``moments=`` and ``moments_min_size=`` of the constructor."""
    mformat.check_moments(moments)
    mformat.check_min_size(min_size)
    groups = any(isinstance(g, dict) and g.get("amsgrad") for g in params)
    mformat.check_amsgrad(moments, amsgrad or groups)
    return moments


def _check_group_options(group: dict, where: str, names, settings: dict) -> None:
    """offload's optimizer-wide constructor options ``names`` in a param group: torch keeps any key
    of a group and ignores the ones it does not know, so a group naming one of these (``{"params":
    ..., "moments": "8bit"}``) would silently not get what it asks for. Refused, unless the group
    repeats the optimizer's own value (``settings``: {name: the constructor's value})."""
    for key in names:
        if key not in group:
            continue
        if key in settings and (group[key] is settings[key]
                                or (type(group[key]) is type(settings[key])
                                                                and group[key] == settings[key])):
            continue
        have = f" (the optimizer has {key}={settings[key]!r})" if key in settings else ""
        raise ValueError(f"{where} sets {key}={group[key]!r}{have}: {key} is an option of the "
                         "whole optimizer (its constructor), not of a param group; use separate "
                         "optimizers for different settings")


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    # Same checks and messages as torch.optim.Adam.
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= _scalar(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= _scalar(betas[0]) < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= _scalar(betas[1]) < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    # Beyond torch: torch.optim.AdamW raises "value cannot be converted to type float without
    # overflow" at its first step for lr/eps above the float32 range and silently gives inf/NaN
    # weights for lr=inf or a huge weight_decay; the native kernel computes in float32, so refuse.
    for name, v in (("lr", _scalar(lr)), ("eps", float(eps)),
                    ("weight_decay", float(weight_decay))):
        if not v <= _F32_MAX:
            raise ValueError(f"{name}={v} overflows float32 (max {_F32_MAX:.4g}), the precision "
                             "the optimizer computes in: every weight would become inf/NaN; use "
                             "a finite value in range")
    if not _scalar(lr) * float(weight_decay) <= _F32_MAX:
        raise ValueError(f"lr * weight_decay = {_scalar(lr) * float(weight_decay)} overflows "
                         "float32: the decay factor 1 - lr*weight_decay would turn every weight "
                         "into inf; use smaller values")


def _check_init(params, betas, foreach, capturable) -> None:
    """The constructor-only checks of torch.optim.Adam/Optimizer after the value checks, in torch's
    order."""
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                                 "and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors "
                        "or dicts, but got " + torch.typename(params))


def check_options(params, lr, betas, eps, weight_decay, amsgrad, foreach, capturable,
                  differentiable, fused,
                  threads, state, nvme_dir, nvme_options, moments, moments_min_size) -> tuple:
    """The constructor's checks (torch's first, in torch's order), before anything is allocated:
    returns (``params`` as a list, the checked ``moments``)."""
    if isinstance(lr, torch.Tensor) and foreach and not capturable:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True: "
                         "pass lr as a float, or leave foreach unset")
    _check_hyper(lr, betas, eps, weight_decay)
    _check_init(params, betas, foreach, capturable)
    params = list(params)
    for g in params:  # torch's add_param_group check, before split_params turns a set into a list
        if isinstance(g, dict) and isinstance(g.get("params"), set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. Please "
                            "use a list instead.")
    check_storage(state, nvme_dir, nvme_options)   # NVMe/mmap state: offload.plan's rule too
    # compressed moments (docs/moments.md)
    moments = _check_moments(moments, moments_min_size, amsgrad, params)
    if capturable:
        raise ValueError("capturable=True is not supported by offload (the step runs on the CPU)")
    if differentiable:
        raise ValueError("differentiable=True is not supported by offload")
    if fused:
        raise ValueError("fused=True selects torch's own kernel; offload always uses "
                         "its native kernel")
    if threads is not None and not (isinstance(threads, int) and 1 <= threads <= 1024):
        raise ValueError(f"threads must be an int in [1, 1024] or None, got {threads!r}")
    return params, moments


def check_amsgrad(group: dict, gi: int, moments: str) -> None:
    """amsgrad=True is refused with compressed moments (a group added, or switched on later)."""
    if group.get("amsgrad") and mformat.moment_format(moments).compressed:
        raise ValueError(f"param group {gi}: amsgrad=True with moments={moments!r}: compressed "
                         "moments have no max_exp_avg_sq; use moments='fp32' for amsgrad")


def check_group(group: dict, gi: int, names, settings: dict, moments: str, gpu: bool) -> None:
    """offload's checks of param group ``gi`` (``names``/``settings``: see _check_group_options):
    its options, then every parameter (those torch's code steps excepted:
    offload/optim/fallback.py)."""
    from . import fallback
    _check_group_options(group, f"param group {gi}", names, settings)
    check_amsgrad(group, gi, moments)
    params = group["params"]
    pnames = group.get("param_names")
    for i, p in enumerate(params):
        if gpu or fallback.reason(p) is None:
            _check_param(p,
                         f"parameter {i} of group {gi}" + (f" ({pnames[i]!r})" if pnames else ""),
                         gpu)
    if gpu and len(set(map(id, params))) != len(params):
        i = next(i for i, p in enumerate(params) if any(q is p for q in params[:i]))
        raise ValueError(f"parameter {i} of group {gi} is listed twice: with parameters on a "
                         "device (GPU offload) every parameter must appear once "
                         "(torch.optim.AdamW steps a repeated parameter once per listing, host "
                         "parameters do the same); remove the duplicate")


def group_hyper(group: dict, checked_keys: int, names, settings: dict, decoupled) -> dict:
    """The validated hyperparameters of ``group`` as the kernels take them; a group with more than
    ``checked_keys`` keys has its optimizer-wide options checked again (one set after it was
    added?)."""
    if len(group) > checked_keys:
        _check_group_options(group, "a param group", names, settings)
    lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
    eps, wd = group["eps"], group["weight_decay"]
    _check_hyper(lr, (beta1, beta2), eps, wd)
    decoupled = decoupled if decoupled is not None else bool(group["decoupled_weight_decay"])
    return dict(lr=lr, beta1=_scalar(beta1), beta2=_scalar(beta2), eps=float(eps),
                weight_decay=float(wd),
                decoupled=decoupled, amsgrad=bool(group["amsgrad"]),
                maximize=bool(group["maximize"]))


# what group_hyper reads of a group; a result is kept while the group holds these very objects
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
               "decoupled_weight_decay")
_VALUES = (float, int, bool, type(None))


def _immutable(v) -> bool:
    return type(v) in _VALUES or (type(v) is tuple and all(type(x) in _VALUES for x in v))


class HyperCache:
    """group_hyper per group, answered again without the checks while the group is the same dict
    with as many keys and the same objects (by identity) under the keys it reads, each a float,
    int, bool, None or a tuple of them (a tensor may be written in place: never kept). A group with
    more keys than ``checked_keys`` (its options checked every time) is never kept. The same dict
    is returned each time: read it, do not modify it."""

    def __init__(self):
        self._got: dict = {}   # gi -> ((group, size, checked_keys, settings, decoupled, *vals), h)

    def get(self, gi: int, group: dict, checked_keys: int, names, settings: dict,
            decoupled) -> dict:
        got = self._got.get(gi)
        if got is not None:
            k = got[0]
            if (k[0] is group and k[1] == len(group) and k[2] == checked_keys and k[3] is settings
                    and k[4] is decoupled
                    and all(map(operator.is_, map(group.get, _HYPER_KEYS), k[5:]))):
                return got[1]
        h = group_hyper(group, checked_keys, names, settings, decoupled)
        values = tuple(map(group.get, _HYPER_KEYS))
        if len(group) <= checked_keys and all(map(_immutable, values)):
            self._got[gi] = ((group, len(group), checked_keys, settings, decoupled) + values, h)
        else:
            self._got.pop(gi, None)
        return h


def param_name(groups: list, gi: int, i: int) -> str:
    """How messages name parameter ``i`` of group ``gi`` (with its name where the group has
    ``param_names``)."""
    names = groups[gi].get("param_names") if gi < len(groups) else None
    return f"parameter {i}" + (f" ({names[i]!r})" if names and i < len(names)
                               else "") + f" of group {gi}"


def check_threads(threads) -> None:
    """The ``kernel_threads`` setter's argument."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 0 <= threads <= 1024):
        raise ValueError("threads must be None or an int in [0, 1024] (0 = the pool's size), "
                         f"got {threads!r}")
