"""checks.py: argument checks of offload.Adam/AdamW (torch's messages where torch has one):
parameters, hyperparameters, the constructor's flags, the `moments=` choice."""
from __future__ import annotations

import torch

from .moments import format as mformat
from .base.dist import local
from .base.dtypes import NATIVE_DTYPES as _PARAM_DTYPES



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
        raise RuntimeError(f"{where} is on {p.device}: offload steps CPU parameters, or CUDA parameters "
                           "in GPU-offload mode (all parameters on one CUDA device, or offload_device=...)")
    if p.layout is not torch.strided:
        raise RuntimeError(f"{where} is a sparse ({p.layout}) tensor: offload steps dense parameters; keep it in a "
                           "torch optimizer for sparse parameters (torch.optim.SparseAdam) or make it dense")
    if p.is_complex():
        raise TypeError(f"{where} is complex ({p.dtype}): here offload steps float32, bfloat16 and float16 parameters; "
                        "register torch.view_as_real(p) instead, or keep it in a separate torch optimizer")
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(f"{where} has dtype {p.dtype}: here offload steps float32, bfloat16 and float16 parameters; "
                        "convert it (p.data = p.data.float()) or keep it in a separate torch optimizer")
    if not p.is_contiguous():
        raise RuntimeError(f"{where} is not contiguous (strides {tuple(p.stride())}): offload updates "
                           "parameters in place and never a temporary copy; make it contiguous first")
    if p.is_neg():  # e.g. z.conj().imag: its memory holds the negated values, and is what the kernel updates
        raise RuntimeError(f"{where} is a lazy negative-bit view: its memory does not hold its values; "
                           "use p.data = p.data.resolve_neg() first")


_F32_MAX = float(torch.finfo(torch.float32).max)


def _check_moments(moments, min_size, amsgrad, params) -> str:
    """``moments=`` and ``moments_min_size=`` of the constructor."""
    mformat.check_moments(moments)
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"moments_min_size must be an int >= 0, got {min_size!r}")
    if moments != "fp32":
        if amsgrad or any(isinstance(g, dict) and g.get("amsgrad") for g in params):
            raise ValueError(f"amsgrad=True is not supported with moments={moments!r} (compressed moments keep no "
                             "max_exp_avg_sq); use moments='fp32' for amsgrad")
    return moments


def _check_group_options(group: dict, where: str, names, settings: dict) -> None:
    """offload's optimizer-wide constructor options ``names`` in a param group: torch keeps any key of a
    group and ignores the ones it does not know, so a group naming one of these (``{"params": ...,
    "moments": "8bit"}``) would silently not get what it asks for. Refused, unless the group repeats the
    optimizer's own value (``settings``: {name: the constructor's value})."""
    for key in names:
        if key not in group:
            continue
        if key in settings and (group[key] is settings[key] or (type(group[key]) is type(settings[key])
                                                                and group[key] == settings[key])):
            continue
        have = f" (the optimizer has {key}={settings[key]!r})" if key in settings else ""
        raise ValueError(f"{where} sets {key}={group[key]!r}{have}: {key} is an option of the whole optimizer "
                         "(its constructor), not of a param group; use separate optimizers for different settings")


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
    for name, v in (("lr", _scalar(lr)), ("eps", float(eps)), ("weight_decay", float(weight_decay))):
        if not v <= _F32_MAX:
            raise ValueError(f"{name}={v} overflows float32 (max {_F32_MAX:.4g}), the precision the optimizer "
                             "computes in: every weight would become inf/NaN; use a finite value in range")
    if not _scalar(lr) * float(weight_decay) <= _F32_MAX:
        raise ValueError(f"lr * weight_decay = {_scalar(lr) * float(weight_decay)} overflows float32: the decay "
                         "factor 1 - lr*weight_decay would turn every weight into inf; use smaller values")


def _check_init(params, betas, foreach, capturable) -> None:
    """The constructor-only checks of torch.optim.Adam/Optimizer after the value checks, in torch's order."""
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        "but got " + torch.typename(params))
