"""bench/gpucheck_correct.py: checks 01-06 of ``bench/gpu_check.py`` - schedule equivalence under
the race amplifier, the engine claim (GPU offload == offload's CPU mode fed the same gradients),
parity with torch.optim.AdamW/Adam on the device, the NVMe and mmap tiers, compressed moments, and
gradient accumulation. Comparisons are bitwise when two identical runs agree bitwise on this
machine.
"""
from __future__ import annotations

import torch

from .gpucheck_common import LR, Ctx, Result, Skip, snapshot, state_tensors
from .gpucheck_train import ensure_bitwise, cpu_mode_run, run_gpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CLIP = 0.05   # small enough that clipping is active at every step


# ------------------------------------------------------------------------ 01
def check_schedules(ctx: Ctx, res: Result) -> None:
    """eager vs deferred vs overlap=False, and max_grad_norm deferred vs overlap=False;
    fp32/bf16/fp16."""
    ensure_bitwise(ctx, res)
    res.data['bitwise_reproducible'] = ctx.bitwise
    for dn, dt in DTYPES.items():
        ctx.tick()
        ref = run_gpt(ctx, dt, dict(overlap=False))
        for sched, opts in (("eager", dict(step_during_backward=True)),
                            ("deferred", dict(step_during_backward=False))):
            got = run_gpt(ctx, dt, opts, amplify=True)
            ctx.compare(res, f"{dn} {sched} == overlap=False (params)", ref["params"],
                        got["params"])
            ctx.compare(res, f"{dn} {sched} == overlap=False (state)", ref["state"], got["state"])
        ref = run_gpt(ctx, dt, dict(overlap=False, max_grad_norm=CLIP))
        got = run_gpt(ctx, dt, dict(max_grad_norm=CLIP), amplify=True)
        ctx.compare(res, f"{dn} max_grad_norm deferred == overlap=False (params)", ref["params"],
                    got["params"])
        ctx.compare(res, f"{dn} max_grad_norm deferred == overlap=False (state)", ref["state"],
                    got["state"])


# ------------------------------------------------------------------------ 02 (and 05)
def _claim(ctx: Ctx, res: Result, label: str, dtype, opts: dict, cpu_opts: dict) -> None:
    model = ctx.gpt(dtype)
    init = snapshot(model.parameters())
    gpu = run_gpt(ctx, dtype, opts, model=model, keep_grads=True, amplify=True)
    cpu = cpu_mode_run(ctx, init, gpu["grads"], cpu_opts)
    ctx.compare(res, f"{label}: parameters == CPU mode", cpu["params"], gpu["params"], exact=True)
    ctx.compare(res, f"{label}: state == CPU mode", cpu["state"], gpu["state"], exact=True)


def check_engine_claim(ctx: Ctx, res: Result) -> None:
    for dn in ("fp32", "bf16"):
        for sched, opts in (("eager", {}), ("deferred", dict(step_during_backward=False)),
                            ("sync", dict(overlap=False))):
            ctx.tick()
            _claim(ctx, res, f"{dn} {sched}", DTYPES[dn], opts, {})


# ------------------------------------------------------------------------ 03
def _shapes(ctx: Ctx):
    d = ctx.width
    return [(d, 2 * d), (2 * d,), (2 * d, d), (d,), (3, d, 5)]


def _grads(ctx: Ctx, steps: int, shapes, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=gen) * (1 + k) for s in shapes] for k in range(steps)]


def _feed(params, grads) -> None:
    """Gradients exactly ``grads`` through autograd (so the device pipeline's hooks see them)."""
    loss = sum((p * g.to(p.device, p.dtype)).sum() for p, g in zip(params, grads))
    loss.backward()


def _parity_case(ctx: Ctx, res: Result, label: str, cls: str, hyper: dict, *, dtype=torch.float32,
                 groups=None, sched=None, opts=None) -> None:
    shapes = _shapes(ctx)
    steps = ctx.steps + 2
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(*s, generator=gen) * 0.1 for s in shapes]
    ours = [t.to(ctx.tdev, dtype, copy=True).requires_grad_(True) for t in init]
    # fp32-master recipe
    masters = [t.to(ctx.tdev, dtype, copy=True).float().requires_grad_(True) for t in init]
    gs = _grads(ctx, steps, shapes)

    def mk(ps):
        if groups is None:
            return [dict(params=ps)]
        return [dict(params=ps[:2], **groups[0]), dict(params=ps[2:], **groups[1])]
    opt = ctx.opt(mk(ours), cls, **hyper, **(opts or {}))
    ref = getattr(torch.optim, cls)(mk(masters), **{"lr": LR, **hyper})
    scheds = []
    if sched:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref)]
    for s in range(steps):
        ctx.tick()
        _feed(ours, gs[s])
        for m, g in zip(masters, gs[s]):
            m.grad = g.to(ctx.tdev, dtype, copy=True).float()
        opt.step()
        ref.step()
        for sc in scheds:
            sc.step()
        opt.zero_grad()
        ref.zero_grad()
    opt.synchronize()
    if dtype == torch.float32:
        ctx.compare(res, f"{label}: parameters vs torch (per element)", snapshot(masters),
                    snapshot(ours), rtol=2e-6, atol=2e-7, exact=False)
    else:
        st = opt.state_dict()["state"]
        mine = [st[i]["master_param"].float().cpu() for i in range(len(ours))]
        ctx.compare(res, f"{label}: fp32 masters vs torch on fp32 masters", snapshot(masters),
                    mine, rtol=2e-6, atol=2e-7, exact=False)
        rounded = [m.detach().to(dtype).cpu() for m in masters]
        ctx.compare(res, f"{label}: {dtype} weights == round(torch master) (within 1 ulp)",
                    rounded,
                    snapshot(ours), rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10, atol=0,
                    exact=False)
    ctx.tick()
    st_ours = opt.state_dict()["state"]
    st_ref = ref.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        if key in st_ref[0]:
            ctx.compare(res, f"{label}: {key} vs torch",
                        [st_ref[i][key].cpu() for i in range(len(ours))],
                        [st_ours[i][key].float().cpu() for i in range(len(ours))], rtol=2e-5,
                        atol=2e-6, exact=False)
    return opt


def check_parity(ctx: Ctx, res: Result) -> None:
    _parity_case(ctx, res, "AdamW fp32", "AdamW", dict(weight_decay=0.1))
    _parity_case(ctx, res, "AdamW fp32 deferred", "AdamW", dict(weight_decay=0.1),
                 opts=dict(step_during_backward=False))
    _parity_case(ctx, res, "AdamW bf16 (fp32-master recipe)", "AdamW", dict(weight_decay=0.1),
                 dtype=torch.bfloat16)
    _parity_case(ctx, res, "Adam L2", "Adam", dict(weight_decay=0.1))
    _parity_case(ctx, res, "AdamW amsgrad", "AdamW", dict(weight_decay=0.1, amsgrad=True))
    _parity_case(ctx, res, "AdamW maximize", "AdamW", dict(weight_decay=0.1, maximize=True))
    _parity_case(ctx, res, "two groups + StepLR", "AdamW", {},
                 groups=[dict(lr=LR, weight_decay=0.1), dict(lr=LR / 3, weight_decay=0.0)],
                 sched=True)
    if not ctx.quick:   # the GPT-model L2-ratio cases (offload/bench/gpucheck_parity.py)
        from .gpucheck_parity import check_case
        for dt in (torch.float32, torch.bfloat16):
            ctx.tick()
            r = check_case(ctx.kind, dt, True, 2, ctx.steps, ctx.gpt_cfg)
            res.expect(r["ok"], f"GPT {r['dtype']} clip+accum2 L2 ratio vs torch",
                       rel=r["rel_diff"], tol=1e-4 if dt == torch.float32 else 2e-2)


# ------------------------------------------------------------------------ 04
def check_tiers(ctx: Ctx, res: Result) -> None:
    ref = run_gpt(ctx, torch.float32, {})
    cases = [("nvme", "eager", {}), ("nvme", "deferred", dict(step_during_backward=False)),
             ("mmap", "eager", {}), ("mmap", "deferred", dict(step_during_backward=False)),
             ("nvme", "staging_slots=1", dict(nvme_options=dict(staging_slots=1))),
             ("nvme", "staging_slots=3", dict(nvme_options=dict(staging_slots=3)))]
    if ctx.quick:
        cases = cases[:3]
    for state, label, opts in cases:
        ctx.tick()
        d = ctx.disk_dir(state)
        got = run_gpt(ctx, torch.float32, dict(state=state, nvme_dir=d, host_budget="64MiB",
                                               **opts),
                      amplify=True, close=False)
        info = got["opt"].storage_info()
        ctx.close(got["opt"])
        res.data.setdefault("storage_info", {})[f"{state} {label}"] = {k: info.get(k) for k in (
            "direct", "slots", "slot_bytes", "staging_bytes", "host_budget", "file_bytes")
                                                                       if k in info}
        ctx.compare(res, f"{state} {label} == ram (params)", ref["params"], got["params"])
        ctx.compare(res, f"{state} {label} == ram (state)", ref["state"], got["state"])
    direct = {k: v.get("direct") for k, v in res.data.get("storage_info", {}).items()}
    res.note(f"O_DIRECT: {sorted(set(map(str, direct.values())))} (tmpfs gives none)")


# ------------------------------------------------------------------------ 05
def check_moments(ctx: Ctx, res: Result) -> None:
    mm = 64   # compress even the small model's tensors
    losses = {}
    for moments in ("bf16", "8bit"):
        for state in (("ram",) if ctx.quick else ("ram", "nvme")):
            ctx.tick()
            opts = dict(moments=moments, moments_min_size=mm)
            extra = dict(state=state, nvme_dir=ctx.disk_dir(state)) if state != "ram" else {}
            _claim(ctx, res, f"moments={moments} state={state}", torch.float32, {**opts, **extra},
                   opts)
    for moments in ("fp32", "bf16", "8bit"):
        r = run_gpt(ctx, torch.float32, dict(moments=moments, moments_min_size=mm),
                    steps=ctx.steps + 2)
        losses[moments] = r["losses"]
    res.data["losses"] = losses
    for moments in ("bf16", "8bit"):
        a, b = losses["fp32"][-1], losses[moments][-1]
        res.expect(abs(a - b) <= 0.05 * abs(a), f"moments={moments} final loss within 5% of fp32",
                   fp32=a, got=b)


# ------------------------------------------------------------------------ 06
def check_accumulation(ctx: Ctx, res: Result) -> None:
    micro = 4
    data = ctx.gpt_batches(ctx.steps * micro)

    def run(mode: str):
        model = ctx.gpt()
        opts = dict(step_during_backward=False) if mode == "deferred" else {}
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, **opts)
            for s in range(ctx.steps):
                ctx.tick()
                for k in range(micro):
                    last = k == micro - 1
                    b = data[s * micro + k]
                    if mode == "no_sync" and not last:
                        with opt.no_sync():
                            model(*b).backward()
                        continue
                    if mode == "boundary":
                        opt.set_accumulation_boundary(last)
                    model(*b).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            return snapshot(model.parameters()), state_tensors(opt)
    ref = run("deferred")
    for mode in ("no_sync", "boundary"):
        got = run(mode)
        ctx.compare(res, f"eager {mode} x{micro} == deferred (params)", ref[0], got[0])
        ctx.compare(res, f"eager {mode} x{micro} == deferred (state)", ref[1], got[1])
    # eager: a second backward without no_sync must raise
    model = ctx.gpt()
    opt = ctx.opt(model.parameters(), weight_decay=0.1)
    if not opt.steps_during_backward:
        raise Skip("the default schedule does not step during backward here")
    err = None
    try:
        model(*data[0]).backward()
        opt.synchronize()
        model(*data[1]).backward()
        opt.step()
        opt.synchronize()
    except RuntimeError as e:
        err = str(e)
    res.expect(err is not None, "eager: a second backward without no_sync raises")
    if err:
        res.data["second_backward_error"] = err[:200]
