"""bench/fidelity_optim.py: the optimizers ``python -m offload.bench fidelity`` compares, and how
to read their moments.

Contenders (``CONTENDERS``): torch.optim.AdamW (reference), offload fp32/bf16/8bit moments,
torchao's and bitsandbytes' AdamW8bit (when importable and runnable on this CPU). Each factory
takes the model's param groups and the shared hyperparameters and returns an optimizer, or raises
:class:`Skip` with the reason. :func:`read_moments` returns every parameter's (exp_avg,
exp_avg_sq) decoded to fp32, whatever the optimizer stores.

Until ``offload.AdamW(moments=...)`` exists (detected by trying the keyword), the compressed
formats run through :class:`KernelMomentsAdamW`, a small stand-in that steps each parameter through
the public kernel API (``offload.kernels.adam_step_moments``; fp32 moments through
``offload.kernels.adam_step`` for parameters under 4096 elements, as offload.AdamW does).
"""
from __future__ import annotations

import torch

import offload
from offload import kernels
from offload.moments.format import FORMATS, moment_format

__all__ = ["Skip", "KernelMomentsAdamW", "CONTENDERS", "make_optimizer", "read_moments", "set_lr",
           "StochasticBf16AdamW", "offload_has_moments", "compressed_fraction", "implementation"]

# parameters with fewer elements keep fp32 moments (bitsandbytes' min_8bit_size)
MIN_8BIT_SIZE = 4096


class Skip(Exception):
    """A contender that cannot run here (not importable, not supported on CPU); str() is the
    reason."""


class KernelMomentsAdamW(torch.optim.Optimizer):
    """AdamW with compressed moments through the native kernel's public API (a benchmark stand-in).

    fp32 master weights (the parameters themselves, fp32), moments as made by
    ``offload.kernels.moment_state(numel, fmt)``; parameters under ``min_size`` elements keep fp32
    moments (as ``offload.AdamW(moments_min_size=4096)``). Every step validates and calls the
    kernel once per group and kind, so its step time includes that validation (not the wired
    optimizer's).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 moments="8bit", min_size=MIN_8BIT_SIZE):
        if moments not in kernels.MOMENT_FORMATS:
            raise ValueError(f"moments must be one of {', '.join(kernels.MOMENT_FORMATS)}, "
                             f"got {moments!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fmt = moments
        self.min_size = min_size

    def compressed(self, p) -> bool:
        return p.numel() >= self.min_size

    def _init(self, p) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = 0
            if self.compressed(p):
                st.update(kernels.moment_state(p.numel(), self.fmt))
            else:
                st["exp_avg"] = torch.zeros(p.numel())
                st["exp_avg_sq"] = torch.zeros(p.numel())
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            hyper = dict(lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                         weight_decay=group["weight_decay"], decoupled=True)
            comp, plain = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError("KernelMomentsAdamW needs contiguous fp32 parameters")
                st = self._init(p)
                st["step"] += 1
                (comp if self.compressed(p) else plain).append((p, st))
            if comp:
                q8 = "exp_avg_scale" in comp[0][1]   # a format with per-block scales
                kernels.adam_step_moments(
                    [p.view(-1) for p, _ in comp], [p.grad.contiguous().view(-1) for p, _ in comp],
                    [s["exp_avg"] for _, s in comp], [s["exp_avg_sq"] for _, s in comp],
                    [s["step"] for _, s in comp], fmt=self.fmt,
                    m_scales=[s["exp_avg_scale"] for _, s in comp] if q8 else None,
                    v_scales=[s["exp_avg_sq_scale"] for _, s in comp] if q8 else None, **hyper)
            if plain:
                kernels.adam_step([p.view(-1) for p, _ in plain],
                                  [p.grad.contiguous().view(-1) for p, _ in plain],
                                  [s["exp_avg"] for _, s in plain],
                                  [s["exp_avg_sq"] for _, s in plain], None,
                                  [s["step"] for _, s in plain], **hyper)
        return loss

    def decoded_moments(self, p) -> tuple:
        st = self.state[p]
        if not st:
            return torch.zeros_like(p), torch.zeros_like(p)
        if not self.compressed(p):
            return st["exp_avg"].view_as(p), st["exp_avg_sq"].view_as(p)
        m, v = kernels.decode_moments(st["exp_avg"], st["exp_avg_sq"], self.fmt,
                                      st.get("exp_avg_scale"), st.get("exp_avg_sq_scale"))
        return m.view_as(p), v.view_as(p)


class StochasticBf16AdamW(torch.optim.Optimizer):
    """AdamW with bf16 moments stored by *stochastic* rounding, emulated in torch (not offload's
    kernel): decode -> fp32 update (the parameter step uses the fp32 moments, as the kernel does)
    -> encode with an unbiased random rounding to bf16. Answers the question whether
    stochastic rounding measurably helps bf16 moments; ``rounding="nearest"`` is the same emulation
    with round-to-nearest-even (it should track the kernel's bf16 closely)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 rounding="stochastic", min_size=MIN_8BIT_SIZE, seed=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rounding, self.min_size = rounding, min_size
        self.gen = torch.Generator().manual_seed(seed)

    def compressed(self, p) -> bool:
        return p.numel() >= self.min_size

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding == "nearest":
            return x.to(torch.bfloat16)
        bits = x.view(torch.int32) + torch.randint(0, 1 << 16, x.shape, generator=self.gen,
                                                   dtype=torch.int32)
        # exact: the low 16 bits are zero
        return (bits & -65536).view(torch.float32).to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    dt = torch.bfloat16 if self.compressed(p) else torch.float32
                    st.update(step=0, exp_avg=torch.zeros_like(p, dtype=dt),
                              exp_avg_sq=torch.zeros_like(p, dtype=dt))
                st["step"] += 1
                t = st["step"]
                m, v = st["exp_avg"].float(), st["exp_avg_sq"].float()
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - lr * group["weight_decay"])
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                if self.compressed(p):
                    st["exp_avg"], st["exp_avg_sq"] = self._encode(m), self._encode(v)
                else:
                    st["exp_avg"], st["exp_avg_sq"] = m, v
        return loss


_HAS_MOMENTS = None


def offload_has_moments() -> bool:
    """Whether this build's ``offload.AdamW`` takes ``moments=`` (tried once on a dummy
    parameter)."""
    global _HAS_MOMENTS
    if _HAS_MOMENTS is None:
        try:
            offload.AdamW([torch.nn.Parameter(torch.zeros(8))], moments="bf16").close()
            _HAS_MOMENTS = True
        except TypeError as e:
            if "moments" not in str(e):
                raise
            _HAS_MOMENTS = False
    return _HAS_MOMENTS


def _torch(groups, h):
    return torch.optim.AdamW(groups, lr=h["lr"], betas=h["betas"], eps=h["eps"],
                             weight_decay=h["weight_decay"])


def _offload(fmt):
    def make(groups, h):
        kw = dict(lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"])
        if not moment_format(fmt).compressed:
            return offload.AdamW(groups, **kw)
        if offload_has_moments():
            return offload.AdamW(groups, moments=fmt, **kw)
        return KernelMomentsAdamW(groups, moments=fmt, **kw)
    return make


def _torchao(groups, h):
    try:
        from torchao.optim import AdamW8bit
    except Exception as e:  # ImportError, or a torchao build that does not match this torch
        raise Skip(f"torchao not importable ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
    return AdamW8bit(groups, lr=h["lr"], betas=h["betas"], eps=h["eps"],
                     weight_decay=h["weight_decay"])


def _bnb(groups, h):
    try:
        from bitsandbytes.optim import AdamW8bit
    except Exception as e:
        raise Skip(f"bitsandbytes not importable ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:80]})")
    return AdamW8bit(groups, lr=h["lr"], betas=h["betas"], eps=h["eps"],
                     weight_decay=h["weight_decay"])


# name -> (factory, moments format label, what it is); offload's own are named after their format
CONTENDERS = {
    "torch": (_torch, "fp32", "torch.optim.AdamW (reference)"),
    "fp32": (_offload("fp32"), "fp32", "offload.AdamW, fp32 moments"),
    "bf16": (_offload("bf16"), "bf16", "offload bf16 moments"),
    "8bit": (_offload("8bit"), "8bit", "offload 8-bit moments"),
    "bf16-sr": (lambda groups, h: StochasticBf16AdamW(groups, **h), "bf16",
                "bf16 moments, stochastic rounding (torch emulation)"),
    "torchao": (_torchao, "8bit", "torchao.optim.AdamW8bit"),
    "bnb": (_bnb, "8bit", "bitsandbytes.optim.AdamW8bit"),
}
BASELINE = "fp32"   # the contender every other one is compared with: offload.AdamW, fp32 moments


def make_optimizer(name: str, groups, hyper: dict):
    """The contender's optimizer, checked to run one step on this machine (else :class:`Skip`)."""
    factory = CONTENDERS[name][0]
    try:
        return factory(groups, hyper)
    except Skip:
        raise
    except Exception as e:  # e.g. a peer without a CPU implementation
        raise Skip(f"cannot construct on this machine ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:100]})")


def implementation(name: str, opt) -> str:
    if isinstance(opt, KernelMomentsAdamW):
        return "kernel stand-in (KernelMomentsAdamW: offload.kernels.adam_step_moments)"
    compressed = name in FORMATS and moment_format(name).compressed
    return CONTENDERS[name][2] + (" (moments=)" if compressed else "")


def compressed_fraction(opt, params):
    """Share of the elements whose moments the optimizer keeps compressed (None: cannot tell)."""
    total = sum(p.numel() for p in params)
    if isinstance(opt, (KernelMomentsAdamW, StochasticBf16AdamW)):
        return sum(p.numel() for p in params if opt.compressed(p)) / total
    if isinstance(opt, torch.optim.AdamW):
        return 0.0
    # its documented rule: tensors under moments_min_size keep fp32 moments
    if isinstance(opt, offload.AdamW):
        if not moment_format(getattr(opt, "moments", "fp32")).compressed:
            return 0.0
        return sum(p.numel() for p in params if p.numel() >= max(1, opt.moments_min_size)) / total
    n = 0
    for p in params:
        st = opt.state.get(p, {})
        if "state1" in st:
            n += p.numel() * (st["state1"].dtype == torch.uint8)
        elif "exp_avg" in st and type(st["exp_avg"]) is not torch.Tensor:
            n += p.numel()  # torchao's OptimState8bit subclass
        elif "exp_avg" in st and st["exp_avg"].dtype != torch.float32:
            n += p.numel()
        elif not st:
            return None
    return n / total


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        # torchao keeps lr as a tensor (it must be filled, not replaced)
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def _bnb_decode(st, key: str, p):
    import bitsandbytes.functional as F
    x = st[f"state{key}"]
    if x.dtype == torch.uint8:
        x = F.dequantize_blockwise(x, absmax=st[f"absmax{key}"], code=st[f"qmap{key}"],
                                   blocksize=256)
    return x.float().view_as(p).clone()  # a non-quantized state1 is the live tensor: copy it


def read_moments(opt, params) -> list:
    """[(exp_avg, exp_avg_sq)] as fp32 tensors shaped like each parameter (zeros before the first
    step)."""
    if isinstance(opt, KernelMomentsAdamW):
        return [tuple(t.clone() for t in opt.decoded_moments(p)) for p in params]
    # torch's keys; compressed moments exported dequantized to fp32
    if isinstance(opt, offload.AdamW):
        sd = opt.state_dict()["state"]
        out = []
        for i, p in enumerate(params):
            st = sd.get(i, {})
            out.append(tuple(st[k].float().view_as(p).clone() if k in st else torch.zeros_like(p)
                             for k in ("exp_avg", "exp_avg_sq")))
        return out
    out = []
    for p in params:
        st = opt.state.get(p, {})
        if "state1" in st:  # bitsandbytes: state1/state2 (+ qmap/absmax when 8-bit)
            out.append((_bnb_decode(st, "1", p), _bnb_decode(st, "2", p)))
            continue
        pair = []
        for k in ("exp_avg", "exp_avg_sq"):
            t = st.get(k)
            if t is None:
                pair.append(torch.zeros_like(p))
            elif (hasattr(t, "dequantize") and not isinstance(t, torch.nn.Parameter)
                  and type(t) is not torch.Tensor):
                pair.append(t.dequantize().float().view_as(p))  # torchao's OptimState8bit
            else:
                pair.append(t.detach().float().view_as(p).clone())
        out.append(tuple(pair))
    return out
