"""bench/gpucheck_delayed.py: check 19 of ``bench/gpu_check.py`` - the delayed update
(``delay_updates=1``) against its rule written out on the same device.

The rule (docs/gpu.md): with w_t the master weights after update t, w_t = AdamW(w_{t-1}, g_t),
where g_t is computed on w_{t-1} for the first ``delay_after`` updates and on w_{t-2} after them.
The reference keeps a second copy of the model on the GPU holding the weights the rule says forward
sees, and fp32 masters on the host stepped by offload's host-mode AdamW (the same native kernel):
where two identical runs agree bitwise on this GPU, the delayed schedule must match it bitwise,
under the race amplifier.
"""
from __future__ import annotations

import torch

from .gpucheck_common import LR, Ctx, Result, snapshot
from .gpucheck_train import ensure_bitwise, mlp_loss

__all__ = ["check_delayed"]

AFTER = 1   # exact updates before the delay starts


def _reference(ctx: Ctx, dtype, data) -> list:
    import offload
    model = ctx.mlp(dtype)
    masters = [p.detach().float().cpu().clone().requires_grad_() for p in model.parameters()]
    opt = offload.AdamW(masters, lr=LR, weight_decay=0.1)   # host mode: the same kernel
    pending, updates = None, 0
    for batch in data:
        ctx.tick()
        mlp_loss(model, batch).backward()
        if pending is not None:   # step(): the pending update goes up, after this backward
            with torch.no_grad():
                for p, w in zip(model.parameters(), pending):
                    p.copy_(w)
            pending = None
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float().cpu()
        opt.step()
        new = [m.detach().to(device=p.device, dtype=p.dtype)
               for m, p in zip(masters, model.parameters())]
        if updates < AFTER:
            with torch.no_grad():
                for p, w in zip(model.parameters(), new):
                    p.copy_(w)
        else:
            pending = new
        updates += 1
        model.zero_grad(set_to_none=True)
    opt.close()
    return [m.detach().clone() for m in masters]


def _ours(ctx: Ctx, dtype, data) -> list:
    model = ctx.mlp(dtype)
    with ctx.amplified():
        opt = ctx.opt(model.parameters(), weight_decay=0.1, delay_updates=1, delay_after=AFTER)
        for batch in data:
            ctx.tick()
            mlp_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()   # the pending update lands
    params = list(model.parameters())
    st = opt.state_dict()["state"]
    return [st.get(i, {}).get("master_param", p).detach().float().cpu()
            for i, p in enumerate(params)]


def check_delayed(ctx: Ctx, res: Result) -> None:
    exact = ensure_bitwise(ctx, res)
    for dtype in (torch.float32, torch.bfloat16):
        data = ctx.mlp_batches(ctx.steps, dtype=dtype)
        ref = _reference(ctx, dtype, data)
        got = _ours(ctx, dtype, data)
        what = f"{str(dtype)[6:]}: delay_updates=1 masters == the rule written out"
        if exact:
            ctx.compare(res, what, ref, got)
        else:
            ctx.compare_moved(res, what, snapshot(p.float() for p in ctx.mlp(dtype).parameters()),
                              ref, got, tol=1e-3)
