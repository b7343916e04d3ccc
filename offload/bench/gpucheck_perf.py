"""bench/gpucheck_perf.py: the performance section of ``bench/gpu_check.py`` - a GPT
(offload/bench/gpt.py; 350M bf16 on CUDA, the tiny preset on the fake device) timed per variant
with CUDA events and wall time: a no-optimizer baseline, torch AdamW fused, offload eager /
deferred+clip / overlap=False / NVMe / 8-bit moments / the delayed update (the offload variants
built by offload/bench/train.py from a Namespace its own parser makes), then the profiler's copy
kinds and copy/compute overlap, last_step_stats vs the profiler, thread and bucket sweeps, the cost
of synchronize() fingerprints, peak memory vs offload.plan, trace lanes, and torchao / DeepSpeed
peers when importable (never installed here). Exposed time = iteration - baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from .gpt import GPT, PRESETS, param_groups, random_batch
from .gpucheck_common import Ctx, Result, Skip
from .gpucheck_profile import profile_summary

MB = 1 << 20


def perf_setup(ctx: Ctx, res: Result) -> None:
    from . import train
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    preset = ctx.args.perf_preset or ("350m" if ctx.cuda else "tiny")
    bucket = 32.0 if ctx.cuda else 0.05
    ns = p.parse_args(["--device", "cuda" if ctx.cuda else "cpu", "--preset", preset,
                       "--bucket-mb", str(bucket),
                       "--state", "nvme", "--nvme-dir", ctx.disk_dir("perf"), "--host-budget",
                       "1GiB"])
    train.apply_defaults(ns)
    cfg = PRESETS[preset]
    P = ctx.perf
    P.update(ns=ns, cfg=cfg, dtype=torch.bfloat16, rows={}, batch=ns.batch if ctx.cuda else 2)
    P["warmup"], P["iters"] = (3, 8) if ctx.cuda else ((1, 2) if ctx.quick else (1, 3))
    if ctx.cuda:   # batch so that forward+backward takes ~100-200 ms
        t = _time(ctx, None, batch=8, warmup=1, iters=2)["iter_ms"] / 1e3
        P["batch"] = int(max(4, min(64, round(8 * 0.15 / max(t, 1e-3) / 4) * 4)))
        res.note(f"batch 8 -> {t * 1e3:.0f} ms, using batch {P['batch']}")
    P["probe"] = train.copy_probe(ctx.tdev, int(bucket * MB))
    res.data.update(preset=preset,
                    params=sum(x.numel() for x in GPT(cfg).parameters()) if not ctx.cuda else None,
                    batch=P["batch"], probe_gbps=P["probe"], namespace=vars(ns))
    res.info_only = True
    res.note(f"GPT {preset}, bf16, batch {P['batch']}, bucket {bucket} MB, "
             f"{P['warmup']}+{P['iters']} iterations")


def _need(ctx: Ctx) -> dict:
    if "cfg" not in ctx.perf:
        raise Skip("perf_setup did not run")
    return ctx.perf


def _time(ctx: Ctx, make_opt, batch=None, warmup=None, iters=None, profile=False,
          sync_each=False) -> dict:
    P = ctx.perf
    cfg, dev = P["cfg"], ctx.tdev
    torch.manual_seed(0)
    model = GPT(cfg).to(device=dev, dtype=P.get("dtype", torch.bfloat16))
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    made = make_opt(model) if make_opt is not None else None
    opt, dev_obj = made if isinstance(made, tuple) else (made, None)
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(cfg, batch or P["batch"], dev, gen) for _ in range(2)]
    warmup = P["warmup"] if warmup is None else warmup
    iters = P["iters"] if iters is None else iters
    stats, ev_ms = [], []

    def one(i):
        if ctx.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        model(*batches[i % 2]).backward()
        if opt is not None:
            if sync_each and hasattr(opt, "synchronize"):
                opt.synchronize()
            opt.step()
            opt.zero_grad(set_to_none=True)
            st = opt.last_step_stats() if hasattr(opt, "last_step_stats") else None
            if st is not None:
                stats.append(st)
        else:
            model.zero_grad(set_to_none=True)
        if ctx.cuda:
            b.record()
            return a, b
    try:
        for i in range(warmup):
            ctx.tick()
            one(i)
        ctx.sync()
        t0 = time.perf_counter()
        evs = []
        prof = None
        if profile:
            from torch.profiler import ProfilerActivity, profile as tprof
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
            prof = tprof(activities=acts)
            prof.__enter__()
        for i in range(iters):
            ctx.tick()
            evs.append(one(i))
        ctx.sync()
        if opt is not None and hasattr(opt, "synchronize"):
            opt.synchronize()
        wall = (time.perf_counter() - t0) / iters
        if prof is not None:
            prof.__exit__(None, None, None)
        if ctx.cuda:
            ev_ms = [a.elapsed_time(b) for a, b in evs]
        out = dict(iter_ms=statistics.median(ev_ms) if ev_ms else wall * 1e3, wall_ms=wall * 1e3)
        if ctx.cuda:
            out.update(peak_alloc_gb=torch.cuda.max_memory_allocated() / 1e9,
                       peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
        steady = [s for s in stats if s.get("step", 0) > warmup] or stats
        if steady:
            for k in ("d2h_s", "h2d_s", "kernel_s", "exposed_s", "nvme_s"):
                out[k] = statistics.median(s.get(k, 0.0) for s in steady)
            for k in ("d2h", "h2d"):
                byt, sec = (sum(s.get(f"{k}_bytes", 0) for s in steady),
                            sum(s.get(f"{k}_s", 0) for s in steady))
                out[f"{k}_gbps"] = byt / sec / 1e9 if sec > 0 else None
        if prof is not None:
            out["profile"] = profile_summary(ctx, prof,
                                             keep=profile if isinstance(profile, str) else "")
        if opt is not None and hasattr(opt, "storage_info"):
            out["storage_info"] = {k: v for k, v in opt.storage_info().items()
                                   if isinstance(v, (int, float, str, bool))}
        return out
    finally:
        if opt is not None and hasattr(opt, "close"):
            opt.close()
        if dev_obj is not None:
            dev_obj.close()


def _offload(ctx: Ctx, **opts):
    import offload
    from offload.device import CudaDevice, FakeDevice
    P = ctx.perf

    def make(model):
        dev = (CudaDevice(ctx.tdev) if ctx.cuda
               else FakeDevice(max_delay=0.0, poison=False, check=False))
        o = offload.AdamW(param_groups(model, 0.1), lr=1e-4, offload_device=dev,
                          **{"bucket_mb": P["ns"].bucket_mb, **opts})
        return o, dev
    return make


def _train_variant(ctx: Ctx, variant: str):
    from . import train
    P = ctx.perf

    def make(model):
        return train.make_optimizer(variant, model, ctx.tdev, P["ns"])
    return make


def _row(ctx: Ctx, res: Result, name: str, make, **kw) -> dict:
    P = _need(ctx)
    r = _time(ctx, make, **kw)
    base = P["rows"].get("baseline")
    if base and name != "baseline":
        r["exposed_ms"] = r["iter_ms"] - base["iter_ms"]
        r["exposed_pct"] = 100 * r["exposed_ms"] / r["iter_ms"]
    tf = P["rows"].get("torch_fused")
    if tf and name != "torch_fused":
        r["vs_torch_fused"] = r["iter_ms"] / tf["iter_ms"]
    P["rows"][name] = r
    res.data.update(r)
    res.info_only = True
    parts = [f"iter {r['iter_ms']:.1f} ms (wall {r['wall_ms']:.1f})"]
    if "exposed_ms" in r:
        parts.append(f"exposed {r['exposed_ms']:.1f} ms = {r['exposed_pct']:.0f}%")
    if r.get("vs_torch_fused"):
        parts.append(f"x{r['vs_torch_fused']:.2f} torch fused")
    for k in ("d2h", "h2d"):
        g = r.get(f"{k}_gbps")
        pr = P["probe"].get(k)
        if g:
            parts.append(f"{k.upper()} {g:.1f} GB/s"
                         + (f" ({100 * g / pr:.0f}% of pinned probe)" if ctx.cuda and pr else ""))
    if r.get("kernel_s") is not None:
        parts.append(f"kernel {r['kernel_s'] * 1e3:.1f} ms")
    if ctx.cuda:
        parts.append(f"peak {r['peak_alloc_gb']:.2f} GB")
        # the GPU timeline misses host time (e.g. the final synchronize())
        if r["wall_ms"] > 1.2 * r["iter_ms"]:
            parts.append(f"WALL {r['wall_ms'] / r['iter_ms']:.1f}x the GPU timeline: the host "
                         "blocked outside it")
    res.note(", ".join(parts))
    return r


def perf_baseline(ctx, res):
    _row(ctx, res, "baseline", None)


def perf_torch_fused(ctx, res):
    _row(ctx, res, "torch_fused", _train_variant(ctx, "torch-fused"))


def perf_eager(ctx, res):
    _row(ctx, res, "offload_eager", _train_variant(ctx, "offload-overlap"))


def perf_clip(ctx, res):
    _row(ctx, res, "offload_deferred_clip", _train_variant(ctx, "offload-clip"))


def perf_sync(ctx, res):
    _row(ctx, res, "offload_sync", _train_variant(ctx, "offload-sync"))


def perf_nvme(ctx, res):
    # every step reads and writes the whole state (4.3 GB at 350M) through a 1 GiB host budget: 3+8
    # iterations did not fit in 40 s on one drive, so fewer here than in the RAM rows
    few = {"warmup": 1, "iters": 2} if ctx.cuda else {}
    _row(ctx, res, "offload_nvme", _train_variant(ctx, "offload-nvme"), **few)


def perf_8bit(ctx, res):
    _row(ctx, res, "offload_8bit", _offload(ctx, moments="8bit"))


def perf_delayed(ctx, res):
    # the schedule that runs the CPU step during the next forward and backward (one step of
    # staleness): delayed from the second update on, so every timed iteration is a delayed one
    _row(ctx, res, "offload_delayed", _offload(ctx, delay_updates=1, delay_after=1))


def perf_profiler(ctx, res):
    _need(ctx)
    for name, make in (("eager", _offload(ctx)),
                       ("deferred_clip", _offload(ctx, max_grad_norm=1.0))):
        r = _time(ctx, make, warmup=2 if ctx.cuda else 1, iters=2,
                  profile=name if ctx.cuda else True)
        prof = r.get("profile", {})
        res.data[name] = r
        if not ctx.cuda:
            continue
        res.expect(prof.get("pageable", 0) == 0,
                   f"{name}: no pageable memcpy in steady iterations",
                   kinds=prof.get("copy_kinds"))
        res.note(f"{name}: D2H overlap {prof.get('d2h_overlap')}, H2D overlap "
                 f"{prof.get('h2d_overlap')}; stats d2h {r.get('d2h_s', 0) * 2e3:.1f} ms vs "
                 f"profiler {prof.get('d2h_ms', 0):.1f} ms (2 iters)")
    if not ctx.cuda:
        res.info_only = True
        res.note("fake device: the profiler sees no CUDA copies; timings recorded only")


def _sweep(ctx, res, key, values, label):
    _need(ctx)
    out = {}
    for v in values:
        ctx.tick()
        r = _time(ctx, _offload(ctx, **{key: v}))
        out[str(v)] = dict(iter_ms=r["iter_ms"], kernel_ms=(r.get("kernel_s") or 0) * 1e3,
                           exposed_s=r.get("exposed_s"))
    res.data[label] = out
    res.info_only = True
    res.note(", ".join(f"{label}={k}: {v['iter_ms']:.1f} ms (kernel {v['kernel_ms']:.1f})"
                       for k, v in out.items()))


def perf_threads(ctx, res):
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    vals = [t for t in (16, 14, 12, 8) if t <= n] or [n]
    if not ctx.cuda:
        vals = sorted({1, n}, reverse=True)
    _sweep(ctx, res, "threads", vals, "threads")


def perf_buckets(ctx, res):
    _sweep(ctx, res, "bucket_mb", (8, 32, 128) if ctx.cuda else (0.02, 0.05, 0.2), "bucket_mb")


def perf_fingerprints(ctx, res):
    _need(ctx)
    a = _time(ctx, _offload(ctx))
    b = _time(ctx, _offload(ctx), sync_each=True)
    res.data.update(plain_ms=a["iter_ms"], with_synchronize_ms=b["iter_ms"])
    res.info_only = True
    res.note(f"synchronize() before every step: {b['iter_ms']:.1f} ms vs {a['iter_ms']:.1f} "
             "ms per iteration")


def perf_memory(ctx, res):
    P = _need(ctx)
    import offload
    model = GPT(P["cfg"]).to(dtype=torch.bfloat16)
    base, eager = P["rows"].get("baseline"), P["rows"].get("offload_eager")
    act = None
    if ctx.cuda and base:
        wbytes = sum(p.numel() * 2 for p in model.parameters())
        act = max(0, int(base["peak_alloc_gb"] * 1e9 - 2 * wbytes))
    plan = offload.plan(model, device="cuda" if ctx.cuda else "cpu", param_dtype="bf16",
                        bucket_bytes=int(P["ns"].bucket_mb * MB), activation_bytes=act)
    res.data["plan"] = dict(gpu=plan.total("gpu"), host=plan.total("host"))
    res.info_only = True
    if ctx.cuda and eager:
        res.data["measured_peak_gb"] = eager["peak_alloc_gb"]
        res.note(f"planned GPU {plan.total('gpu') / 1e9:.2f} GB (activations "
                 f"{act / 1e9 if act else 0:.2f}) vs measured peak {eager['peak_alloc_gb']:.2f} "
                 "GB; torch fused peak "
                 f"{P['rows'].get('torch_fused', {}).get('peak_alloc_gb', float('nan')):.2f} GB; "
                 f"planned host {plan.total('host') / 1e9:.2f} GB")
    else:
        res.note(f"planned host {plan.total('host') / 1e6:.1f} MB (no GPU peak to compare here)")


def perf_trace(ctx, res):
    _need(ctx)
    import offload
    from offload.device import CudaDevice, FakeDevice
    model = GPT(ctx.perf["cfg"]).to(device=ctx.tdev, dtype=torch.bfloat16)
    dev = CudaDevice(ctx.tdev) if ctx.cuda else FakeDevice(max_delay=0.0)
    opt = offload.AdamW(model.parameters(), lr=1e-4, offload_device=dev, trace=True,
                        bucket_mb=ctx.perf["ns"].bucket_mb)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):   # at the timed rows' batch: the timeline of their iterations
            model(*random_batch(ctx.perf["cfg"], ctx.perf["batch"], ctx.tdev, gen)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        path = os.path.join(ctx.out_dir or ctx.disk_dir("trace"), "offload_trace.json")
        opt.export_chrome_trace(path)
        with open(path) as f:
            evs = json.load(f)
        evs = evs.get("traceEvents", evs) if isinstance(evs, dict) else evs
        lanes = {}
        for e in evs:
            text = json.dumps(e)
            for k in ("D2H", "H2D", "d2h", "h2d"):
                if k in text:
                    lanes[k.upper()] = lanes.get(k.upper(), 0) + 1
        res.data.update(events=len(evs), lanes=lanes)
        res.info_only = True
        res.note(f"Chrome trace: {len(evs)} events, D2H/H2D events {lanes}")
    finally:
        opt.close()
        dev.close()


def perf_peers(ctx, res):
    if not ctx.cuda:
        raise Skip("peers (torchao CPUOffloadOptimizer, DeepSpeedCPUAdam) need CUDA")
    _need(ctx)
    ran = []
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception as e:  # noqa: BLE001
        res.note(f"torchao not importable ({type(e).__name__})")
    else:
        for og in (False, True):
            ctx.tick()
            _row(ctx, res, f"torchao_offload_gradients_{og}",
                 lambda m, og=og: CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW,
                                                      offload_gradients=og, lr=1e-4))
            ran.append(f"torchao(offload_gradients={og})")
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        res.note("deepspeed not importable")
    elif importlib.util.find_spec("deepspeed.ops.adam.cpu_adam_op") is None:
        res.note("DeepSpeedCPUAdam op is not prebuilt (a JIT build is not attempted here)")
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        _row(ctx, res, "deepspeed_cpu_adam", lambda m: DeepSpeedCPUAdam(m.parameters(), lr=1e-4))
        ran.append("DeepSpeedCPUAdam")
    if not ran:
        raise Skip("; ".join(res.notes) or "no peer importable")


def perf_summary(ctx, res):
    P = _need(ctx)
    res.info_only = True
    res.data["rows"] = {k: {kk: vv for kk, vv in v.items() if kk != "profile"}
                        for k, v in P["rows"].items()}
    res.note(" | ".join(f"{k} {v['iter_ms']:.1f} ms"
                        + (f" (+{v['exposed_ms']:.1f})" if "exposed_ms" in v else "")
                        for k, v in P["rows"].items()))
