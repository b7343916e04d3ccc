"""bench/gpucheck_train.py: the training loops the checks of ``bench/gpu_check.py`` share - a GPT
or MLP trained with offload.AdamW on the device (optionally under the race amplifier, keeping each
step's gradients), and offload's CPU mode fed given gradients (the reference of the engine-claim
and moments checks).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .gpucheck_common import Ctx, same_bits, snapshot, state_tensors


def gpt_loss(model, batch):
    idx, tgt = batch
    return model(idx, tgt)


def mlp_loss(model, batch):
    x, y = batch
    return (model(x).float() - y.float()).square().mean()


def ensure_bitwise(ctx: Ctx, res=None) -> bool:
    """Do two identical overlap=False GPT runs agree bitwise here? If not, later comparisons use
    tolerances."""
    if ctx.bitwise is None:
        ctx.bitwise = True   # (also stops the recursion through run_gpt)
        a = run_gpt(ctx, torch.float32, dict(overlap=False), close=True)
        b = run_gpt(ctx, torch.float32, dict(overlap=False), close=True)
        ctx.bitwise = all(same_bits(x, y) for x, y in zip(a["params"], b["params"]))
        if not ctx.bitwise and res is not None:
            res.note("two identical overlap=False runs differ: comparisons fall "
                     "back to tolerances")
    return ctx.bitwise


def run_gpt(ctx: Ctx, dtype, opts: dict, steps: Optional[int] = None, amplify: bool = False,
            close: bool = True,
            model=None, loss=gpt_loss, data=None, keep_grads: bool = False, autocast=None) -> dict:
    """Train ``steps`` steps with offload.AdamW(**opts); returns params, state tensors, losses (and
    the gradients fed to each step with ``keep_grads``)."""
    ensure_bitwise(ctx)
    steps = steps or ctx.steps
    model = model if model is not None else ctx.gpt(dtype)
    data = data if data is not None else ctx.gpt_batches(steps)
    cm = ctx.amplified() if amplify else contextlib.nullcontext()
    losses, grads = [], []
    with cm:
        opt = ctx.opt(model.parameters(), weight_decay=0.1, **opts)
        for s in range(steps):
            ctx.tick()
            ac = (torch.autocast(ctx.tdev.type, dtype=autocast) if autocast
                  else contextlib.nullcontext())
            with ac:
                lo = loss(model, data[s % len(data)])
            lo.backward()
            losses.append(float(lo.detach()))
            if keep_grads:
                grads.append([None if p.grad is None else p.grad.detach().to("cpu", copy=True)
                              for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        out = dict(params=snapshot(model.parameters()), state=state_tensors(opt), losses=losses,
                   grads=grads, stats=opt.last_step_stats(wait=True), opt=opt, model=model)
        if close:
            ctx.close(opt)
    return out


def cpu_mode_run(ctx: Ctx, init: list, grads: list, opts: dict, cls: str = "AdamW") -> dict:
    """offload's CPU mode (host parameters) fed the given gradients, step by step."""
    hp = [t.detach().to("cpu", copy=True).requires_grad_(True) for t in init]
    opt = ctx.opt(hp, cls, offload_device=None, weight_decay=0.1, **opts)
    for gs in grads:
        for p, g in zip(hp, gs):
            p.grad = None if g is None else g.clone()
        opt.step()
        opt.zero_grad()
    return dict(params=[p.detach().clone() for p in hp], state=state_tensors(opt))
