"""bench/gpucheck_amp.py: checks 07-11 of ``bench/gpu_check.py`` - clipping (returned norm, the
method, torch clipping of device gradients in the deferred schedule), torch.amp.GradScaler
(injected overflow skips bitwise, the scale sequence, unscale_, the eager schedule refusing it),
bf16 autocast, release_grads (peak memory during backward, parity) and small_param_numel (parity,
state in state_dict).
"""
from __future__ import annotations

import contextlib

import torch

from .gpucheck_common import Ctx, Result, Skip, l2_dist, snapshot, state_tensors
from .gpucheck_train import mlp_loss, run_gpt
from .gpucheck_correct import _parity_case

CLIP = 0.05


def _total_norm(params) -> float:
    gs = [p.grad.detach().float() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])))


# ------------------------------------------------------------------------ 07
def check_clipping(ctx: Ctx, res: Result) -> None:
    data = ctx.gpt_batches(ctx.steps)

    def run(mode: str, **opts):
        model = ctx.gpt()
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, **opts)
            norms, mults = [], []
            for s in range(ctx.steps):
                ctx.tick()
                model(*data[s]).backward()
                ref_norm = _total_norm(model.parameters())
                if mode == "method":
                    norms.append((float(opt.clip_grad_norm_(CLIP)), ref_norm))
                elif mode == "torch":
                    norms.append((float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)),
                                  ref_norm))
                else:
                    norms.append((None, ref_norm))
                opt.step()
                st = opt.last_step_stats(wait=True)
                mults.append((st or {}).get("grad_multiplier"))
                opt.zero_grad()
            opt.synchronize()
            return dict(params=snapshot(model.parameters()), state=state_tensors(opt), norms=norms,
                        mults=mults)
    opt_c = run("option", max_grad_norm=CLIP)
    sync_c = run("option", max_grad_norm=CLIP, overlap=False)
    ctx.compare(res, "max_grad_norm deferred == overlap=False", sync_c["params"], opt_c["params"])
    worst = max(abs(m - CLIP / (n + 1e-6)) / (CLIP / (n + 1e-6))
                for (_, n), m in zip(opt_c["norms"], opt_c["mults"])
                if m is not None)
    res.expect(worst <= 1e-6, "max_grad_norm coefficient == max_norm / (torch norm + "
                              "1e-6) (rel 1e-6)", worst_rel=worst)
    meth = run("method", step_during_backward=False)
    worst = max(abs(a - b) / b for a, b in meth["norms"])
    res.expect(worst <= 1e-6, "clip_grad_norm_() returns torch's total norm (rel 1e-6)",
               worst_rel=worst)
    ctx.compare(res, "clip_grad_norm_() method == max_grad_norm option", opt_c["params"],
                meth["params"], rtol=1e-6, atol=1e-8)
    tor = run("torch", step_during_backward=False)
    tor_sync = run("torch", overlap=False)
    ctx.compare(res, "torch clip_grad_norm_ on device grads, deferred == overlap=False",
                tor_sync["params"], tor["params"])
    if not ctx.cuda:   # the same norm code on both sides here
        ctx.compare(res, "torch clip_grad_norm_ on device grads is picked up (== the "
                         "method, per element)",
                    meth["params"], tor["params"], rtol=1e-5, atol=1e-7, exact=False)
        return
    # on CUDA torch's norm sums in another order: the runs part by rounding, and more with each
    # step. Picked up means: as close to the method as rounding allows, and far closer than a run
    # not clipped
    init = snapshot(ctx.gpt().parameters())
    ctx.compare_moved(res, "torch clip_grad_norm_ on device grads is picked up (near the method)",
                      init, meth["params"], tor["params"], tol=1e-3)
    plain = run("none", step_during_backward=False)
    near, far = l2_dist(meth["params"], tor["params"]), l2_dist(meth["params"], plain["params"])
    res.expect(near * 10 < far, "torch clip_grad_norm_ run is >10x nearer the method than "
                                "an unclipped run",
               near=near, unclipped=far)


# ------------------------------------------------------------------------ 08
def _scaler(kind: str):
    try:
        return torch.amp.GradScaler(kind, init_scale=2.0 ** 10, growth_interval=2)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"torch.amp.GradScaler({kind!r}) is not available: {e}")


def _amp_run(ctx: Ctx, res: Result, dtype, autocast, inf_at: int, torch_opt=False, unscale=False,
             **opts):
    model = ctx.mlp(dtype)
    data = ctx.mlp_batches(ctx.steps + 1, dtype=dtype)
    scaler = _scaler(ctx.tdev.type)
    if torch_opt:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = ctx.opt(model.parameters(), weight_decay=0.1, **opts)
    scales, skipped_ok = [], None
    cm = ctx.amplified() if not torch_opt else contextlib.nullcontext()
    with cm:
        for s in range(ctx.steps + 1):
            ctx.tick()
            ac = (torch.autocast(ctx.tdev.type, dtype=torch.float16) if autocast
                  else contextlib.nullcontext())
            with ac:
                lo = mlp_loss(model, data[s])
            scaler.scale(lo).backward()
            if s == inf_at:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
                if not torch_opt:
                    opt.synchronize()
                before = (snapshot(model.parameters()), None if torch_opt else state_tensors(opt))
            if unscale:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            if s == inf_at:
                if not torch_opt:
                    opt.synchronize()
                after = (snapshot(model.parameters()), None if torch_opt else state_tensors(opt))
                skipped_ok = all(torch.equal(a.view(-1).view(torch.int8),
                                             b.view(-1).view(torch.int8))
                                 for a, b in zip(before[0] + (before[1] or []),
                                                 after[0] + (after[1] or [])))
            opt.zero_grad()
    if not torch_opt:
        opt.synchronize()
    return dict(params=snapshot(model.parameters()), scales=scales, skipped_ok=skipped_ok)


def _vs_torch(ctx: Ctx, res: Result, what: str, ref: list, got: list) -> None:
    """Ours vs torch's AdamW on the same device: per element where both run the same CPU arithmetic
    (the fake device); on CUDA torch's kernels round differently and fp16 autocast grows the
    differences with each step, so there the distance is measured against how far torch's run
    moved."""
    if not ctx.cuda:
        ctx.compare(res, what, ref, got, rtol=1e-4, atol=1e-5, exact=False)
        return
    ctx.compare_moved(res, what, snapshot(ctx.mlp(ref[0].dtype).parameters()), ref, got, tol=1e-2)


def check_gradscaler(ctx: Ctx, res: Result) -> None:
    k = 1
    # fp32 parameters under fp16 autocast: ours vs torch AdamW + GradScaler
    ref = _amp_run(ctx, res, torch.float32, True, k, torch_opt=True)
    for label, opts in (("deferred", dict(check_overflow=True)),
                        ("overlap=False", dict(check_overflow=True, overlap=False))):
        got = _amp_run(ctx, res, torch.float32, True, k, **opts)
        res.expect(got["skipped_ok"], f"fp32+fp16 autocast {label}: injected inf skips "
                                      "the step bitwise")
        res.expect(got["scales"] == ref["scales"], f"fp32+fp16 autocast {label}: scale "
                                                   "sequence == torch's",
                   ours=got["scales"], torch=ref["scales"])
        _vs_torch(ctx, res, f"fp32+fp16 autocast {label}: parameters vs torch AdamW",
                  ref["params"], got["params"])
    # the unscale_ variant (torch clipping after unscale_ on the device gradients)
    ref_u = _amp_run(ctx, res, torch.float32, True, k, torch_opt=True, unscale=True)
    got_u = _amp_run(ctx, res, torch.float32, True, k, unscale=True, check_overflow=True)
    res.expect(got_u["skipped_ok"], "unscale_ variant: injected inf skips the step bitwise")
    res.expect(got_u["scales"] == ref_u["scales"], "unscale_ variant: scale sequence == torch's",
               ours=got_u["scales"], torch=ref_u["scales"])
    _vs_torch(ctx, res, "unscale_ variant: parameters vs torch AdamW", ref_u["params"],
              got_u["params"])
    # fp16 parameters (torch's own AdamW cannot unscale fp16 gradients): deferred vs overlap=False
    a = _amp_run(ctx, res, torch.float16, False, k, check_overflow=True)
    b = _amp_run(ctx, res, torch.float16, False, k, check_overflow=True, overlap=False)
    res.expect(a["skipped_ok"], "fp16 parameters: injected inf skips the step bitwise")
    res.expect(a["scales"] == b["scales"],
               "fp16 parameters: same scale sequence in both schedules",
               deferred=a["scales"], sync=b["scales"])
    ctx.compare(res, "fp16 parameters: deferred == overlap=False", b["params"], a["params"])
    # the eager schedule must refuse GradScaler
    err = None
    try:
        _amp_run(ctx, res, torch.float32, True, -1, step_during_backward=True)
    except (RuntimeError, ValueError) as e:
        err = str(e)
    res.expect(err is not None, "eager schedule + GradScaler raises")
    res.data["eager_error"] = (err or "")[:200]


# ------------------------------------------------------------------------ 09
def check_bf16_autocast(ctx: Ctx, res: Result) -> None:
    ref = run_gpt(ctx, torch.float32, dict(overlap=False), autocast=torch.bfloat16)
    for label, opts in (("eager", {}), ("deferred", dict(step_during_backward=False))):
        got = run_gpt(ctx, torch.float32, opts, autocast=torch.bfloat16, amplify=True)
        ctx.compare(res, f"bf16 autocast {label} == overlap=False (params)", ref["params"],
                    got["params"])
        ctx.compare(res, f"bf16 autocast {label} == overlap=False (state)", ref["state"],
                    got["state"])
    res.expect(all(torch.isfinite(p).all() for p in ref["params"]),
               "bf16 autocast: finite parameters")


# ------------------------------------------------------------------------ 10
def check_release_grads(ctx: Ctx, res: Result) -> None:
    ref = run_gpt(ctx, torch.float32, {})
    got = run_gpt(ctx, torch.float32, dict(release_grads=True), amplify=True)
    ctx.compare(res, "release_grads=True == False (params)", ref["params"], got["params"])
    ctx.compare(res, "release_grads=True == False (state)", ref["state"], got["state"])
    if not ctx.cuda:
        res.note("fake device: no caching allocator, peak-memory comparison on CUDA only")
        return
    width = 2048
    peaks = {}
    for release in (False, True):
        model = ctx.mlp(width=width, depth=4)
        data = [(torch.randn(8, width, device="cuda"), torch.randn(8, width, device="cuda"))]
        opt = ctx.opt(model.parameters(), release_grads=release, bucket_mb=8)
        for s in range(3):
            lo = mlp_loss(model, data[0])
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            lo.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        peaks[release] = peak
        ctx.close(opt)
        del model, opt
    grad_bytes = sum(p.numel() * 4 for p in ctx.mlp(width=width, depth=4).parameters())
    res.data["backward_peak_bytes"] = dict(release_false=peaks[False], release_true=peaks[True],
                                           grad_bytes=grad_bytes)
    res.expect(peaks[True] <= peaks[False] - 0.25 * grad_bytes,
               "release_grads=True lowers the peak memory of backward by >= 1/4 of "
               "the gradient bytes",
               peak_false_mb=peaks[False] / 2 ** 20, peak_true_mb=peaks[True] / 2 ** 20,
               grads_mb=grad_bytes / 2 ** 20)


# ------------------------------------------------------------------------ 11
def check_small_params(ctx: Ctx, res: Result) -> None:
    opt = _parity_case(ctx, res, "small_param_numel=1024", "AdamW", dict(weight_decay=0.1),
                       opts=dict(small_param_numel=1024))
    st = opt.state_dict()["state"]
    n = sum(len(g["params"]) for g in opt.param_groups)
    small = [i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
             if p.numel() <= 1024]
    missing = [i for i in range(n) if "exp_avg" not in st.get(i, {})]
    res.expect(bool(small), "the case has small parameters", small=small)
    res.expect(not missing, "every parameter (small ones too) has state in state_dict()",
               missing=missing)
