"""moments_util.py: helpers of the compressed-moment optimizer tests (test_moments_optim.py,
test_moments_state.py): the formats, tensor sizes above and below moments_min_size, deterministic
gradients, steps, and the same steps through the kernel (offload.kernels.adam_step_moments)."""
from __future__ import annotations

import torch

from offload import kernels

FMTS = ("bf16", "8bit")

N = 4096 + 700          # >= moments_min_size, last block short

SMALL = 40              # below moments_min_size: fp32 moments


def _grads(seed, shapes, dtypes):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * torch.rand(n, generator=g)).to(dt) for n, dt in zip(shapes, dtypes)]


def _run(opt, params, steps, seed=0):
    for s in range(steps):
        for p, g in zip(params, _grads(seed + s, [p.numel() for p in params], [p.dtype for p in params])):
            p.grad = g
        opt.step()


def _kernel_reference(p0, grads_by_step, fmt, *, lr, wd, decoupled, maximize=False, mult=1.0, betas=(0.9, 0.999)):
    """The same steps through offload.kernels.adam_step_moments (fp32 master + low-precision out)."""
    master = p0.detach().float().clone()
    out = p0.detach().clone() if p0.dtype != torch.float32 else None
    st = kernels.moment_state(p0.numel(), fmt)
    extra = dict(m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]]) if fmt == "8bit" else {}
    for s, g in enumerate(grads_by_step):
        kernels.adam_step_moments([master], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [s + 1], fmt=fmt, lr=lr,
                                  beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=wd, decoupled=decoupled,
                                  maximize=maximize, grad_multiplier=mult, outs=[out] if out is not None else None,
                                  **extra)
    return (out if out is not None else master), st
