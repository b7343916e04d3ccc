"""bench/gpucheck_writes.py: checks 12-15 of ``bench/gpu_check.py`` - user writes to the weights
(p.data after synchronize(), a write without it, model.load_state_dict between steps, save/resume),
parameters read by modules other than their owner (nn.TransformerEncoderLayer), torch.compile, and
forward/backward on a user CUDA stream.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

from .gpucheck_common import Ctx, Result, Skip, l2_dist, same_bits, snapshot, state_tensors
from .gpucheck_train import mlp_loss

SCHED = {"eager": dict(step_during_backward=True), "deferred": dict(step_during_backward=False),
         "sync": dict(overlap=False)}


def _loop(ctx: Ctx, model, opt, data, steps, loss=mlp_loss, between=None, torch_opt=False):
    for s in range(steps):
        ctx.tick()
        loss(model, data[s % len(data)]).backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(s, model, opt)
    if not torch_opt:
        opt.synchronize()


def _workers() -> int:
    import threading
    return sum(t.name.startswith("offload-backward") for t in threading.enumerate())


# ------------------------------------------------------------------------ 12
def check_user_writes(ctx: Ctx, res: Result) -> None:
    data = ctx.mlp_batches(ctx.steps)
    k = 1   # after this step the user writes

    def run(dtype, sched, how, torch_opt=False):
        model = ctx.mlp(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if torch_opt else \
            ctx.opt(model.parameters(), weight_decay=0.1, **SCHED[sched])

        def between(s, m, o):
            if s != k:
                return
            if not torch_opt:
                o.synchronize()
            with torch.no_grad():
                for p in m.parameters():
                    (p.data.mul_(0.5) if how == "data" else p.mul_(0.5))
        with ctx.amplified():
            _loop(ctx, model, opt, ctx.mlp_batches(ctx.steps, dtype=dtype), ctx.steps,
                  between=between, torch_opt=torch_opt)
        return snapshot(model.parameters())
    ref = run(torch.float32, None, "data", torch_opt=True)
    for sched in ("eager", "deferred", "sync"):
        got = run(torch.float32, sched, "data")
        ctx.compare(res, f"fp32 {sched}: p.data.mul_ after synchronize() kept (vs torch AdamW)",
                    ref, got, rtol=1e-4, atol=1e-6, exact=False)
    for sched in ("eager", "deferred"):
        vis = run(torch.bfloat16, sched, "visible")
        got = run(torch.bfloat16, sched, "data")
        ctx.compare(res, f"bf16 {sched}: p.data.mul_ == the same write through p.mul_ (bitwise)",
                    vis, got, exact=True)
    # a write without synchronize(): raises at the next use of that parameter; close() then still
    # works
    for sched in ("eager", "deferred"):
        model = ctx.mlp()
        with ctx.amplified():
            dev = ctx.offload_device()
            opt = ctx.opt(model.parameters(), weight_decay=0.1, offload_device=dev, **SCHED[sched])
            mlp_loss(model, data[0]).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            err = None
            try:
                mlp_loss(model, data[1]).backward()
                opt.step()
                opt.synchronize()
            except RuntimeError as e:
                err = str(e)
        res.data[f"write_without_synchronize_{sched}"] = (err or "no error")[:160]
        res.expect(err is not None and "synchronize" in err,
                   f"{sched}: a write without synchronize() raises")
        before = _workers()
        close_err = None
        try:
            ctx.close(opt)
        except Exception as e:  # noqa: BLE001
            close_err = f"{type(e).__name__}: {str(e)[:100]}"
        ctx.forget(opt)
        # the write raced the first step's copies on purpose: its hazards are expected
        ctx.forget(dev)
        res.expect(close_err is None and _workers() < before,
                   f"{sched}: close() after the reported write works (no raise, "
                   "worker thread ends)",
                   close_error=close_err, workers_before=before, workers_after=_workers())
    # model.load_state_dict between steps (after synchronize)
    m0 = ctx.mlp()
    saved = copy.deepcopy(m0.state_dict())

    def reload(s, m, o):
        if s == k:
            if hasattr(o, "synchronize"):
                o.synchronize()
            m.load_state_dict(saved)
    outs = {}
    for sched in ("sync", "eager", "deferred"):
        model = ctx.mlp()
        opt = ctx.opt(model.parameters(), weight_decay=0.1, **SCHED[sched])
        with ctx.amplified():
            _loop(ctx, model, opt, data, ctx.steps, between=reload)
        outs[sched] = snapshot(model.parameters())
    model = ctx.mlp()
    topt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _loop(ctx, model, topt, data, ctx.steps, between=reload, torch_opt=True)
    ctx.compare(res, "model.load_state_dict between steps (vs torch AdamW)",
                snapshot(model.parameters()), outs["sync"], rtol=1e-4, atol=1e-6, exact=False)
    for sched in ("eager", "deferred"):
        ctx.compare(res, f"model.load_state_dict between steps, {sched} == overlap=False",
                    outs["sync"], outs[sched])
    # save after 2 steps -> fresh model and optimizer -> load -> 2 more == 4 uninterrupted steps
    for dt in (torch.float32, torch.bfloat16):
        model = ctx.mlp(dt)
        data_d = ctx.mlp_batches(4, dtype=dt)
        opt = ctx.opt(model.parameters(), weight_decay=0.1)
        _loop(ctx, model, opt, data_d, 4)
        full = (snapshot(model.parameters()), state_tensors(opt))
        model = ctx.mlp(dt)
        opt = ctx.opt(model.parameters(), weight_decay=0.1)
        _loop(ctx, model, opt, data_d[:2], 2)
        msd = copy.deepcopy(model.state_dict())
        osd = copy.deepcopy(opt.state_dict())
        ctx.close(opt)
        model = ctx.mlp(dt)
        model.load_state_dict(msd)
        opt = ctx.opt(model.parameters(), weight_decay=0.1)
        opt.load_state_dict(osd)
        _loop(ctx, model, opt, data_d[2:], 2)
        ctx.compare(res, f"{dt}: resume after 2 steps == 4 steps (params)", full[0],
                    snapshot(model.parameters()), exact=True)
        ctx.compare(res, f"{dt}: resume after 2 steps == 4 steps (state)", full[1],
                    state_tensors(opt), exact=True)


# ------------------------------------------------------------------------ 13
def check_non_owner_reads(ctx: Ctx, res: Result) -> None:
    d, heads, ff, bucket = (1024, 16, 2048, 2.0) if ctx.cuda else (64, 4, 96, 0.004)
    layers = 3 if ctx.cuda else 2
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 6, d, generator=gen).to(ctx.tdev) for _ in range(ctx.steps)]

    def build():
        torch.manual_seed(0)
        layer = dict(d_model=d, nhead=heads, dim_feedforward=ff, dropout=0.0, batch_first=True)
        return nn.Sequential(*[nn.TransformerEncoderLayer(**layer)
                               for _ in range(layers)]).to(ctx.tdev)

    def run(opts):
        model = build()
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, bucket_mb=bucket, **opts)
            right_after = []
            for x in xs:
                ctx.tick()
                model(x).float().square().mean().backward()
                opt.step()
                right_after.append([v.detach().to("cpu", copy=True)
                                    for v in model.state_dict().values()])
                opt.zero_grad()
                opt.synchronize()
                synced = [v.detach().to("cpu", copy=True) for v in model.state_dict().values()]
                right_after[-1] = (right_after[-1], synced)
        return snapshot(model.parameters()), right_after
    t0 = time.time()
    ref, _ = run(SCHED["sync"])
    res.data["seconds"] = {"overlap=False": round(time.time() - t0, 2)}
    for label, opts in (("deferred", SCHED["deferred"]),
                        ("max_grad_norm", dict(max_grad_norm=1e9)), ("eager", SCHED["eager"])):
        t0 = time.time()
        got, snaps = run(opts)
        res.data["seconds"][label] = round(time.time() - t0, 2)
        ctx.compare(res, f"TransformerEncoderLayer stack, {label} == overlap=False", ref, got)
        bad = [s for s, (a, b) in enumerate(snaps)
               if not all(torch.equal(x, y) for x, y in zip(a, b))]
        res.expect(not bad, f"{label}: model.state_dict() right after step() == weights "
                            "after synchronize()",
                   steps_differing=bad)


# ------------------------------------------------------------------------ 14
def check_compile(ctx: Ctx, res: Result) -> None:
    backend = "inductor" if ctx.cuda else "aot_eager"   # no C++ codegen on the 2-core CPU run
    res.note(f"backend {backend}")
    data = ctx.mlp_batches(ctx.steps)

    from torch._dynamo.utils import counters
    graphs = {}

    def run(opts, compiled=True, mode=None):
        torch._dynamo.reset()
        counters.clear()
        model = ctx.mlp()
        fwd = torch.compile(model, backend=backend, mode=mode) if compiled else model
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, **opts)
            for s in range(ctx.steps):
                ctx.tick()
                mlp_loss(fwd, data[s]).backward()
                opt.step()
                opt.zero_grad()
            # no synchronize(): step() must have waited
            right_after = snapshot(model.parameters())
            opt.synchronize()
        graphs[tuple(sorted(opts.items()))] = (
            counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        return snapshot(model.parameters()), right_after
    t0 = time.time()
    ref, _ = run(SCHED["sync"])
    res.data["first_compile_s"] = round(time.time() - t0, 1)
    # inductor may pick other kernel configs (another reduction order) each time it compiles: a
    # second compiled overlap=False run says whether compiled runs can agree bitwise here at all
    again, _ = run(SCHED["sync"]) if ctx.cuda else (ref, None)
    exact = all(same_bits(a, b) for a, b in zip(ref, again))
    init = snapshot(ctx.mlp().parameters())
    noise = l2_dist(ref, again) / max(l2_dist(ref, init), 1e-30)
    res.data["two compiled overlap=False runs: bitwise, distance over moved"] = (exact, noise)
    for label in ("eager", "deferred"):
        got, right_after = run(SCHED[label])
        if exact:
            ctx.compare(res, f"compiled model, {label} == overlap=False", ref, got)
        else:
            # as near to overlap=False as a second compile of it is (a stale weight is ~1/steps
            # off)
            ctx.compare_moved(res, f"compiled model, {label} near overlap=False (within 10x two "
                                   "compiles' spread)",
                              init, ref, got, tol=max(1e-4, 10 * noise))
        ctx.compare(res, f"compiled model, {label}: weights right after step() are the final ones",
                    got, right_after, exact=True)
        n, breaks = graphs[tuple(sorted(SCHED[label].items()))]
        res.expect(n >= 1 and breaks == 0, f"compiled model, {label}: compiled, "
                                           "without graph breaks",
                   graphs=n, graph_breaks=breaks)
    if not ctx.cuda:
        res.note("reduce-overhead (CUDA graphs) smoke test on CUDA only")
        return
    plain, _ = run(SCHED["sync"], compiled=False)
    try:
        got, _ = run({}, mode="reduce-overhead")
    except Exception as e:  # noqa: BLE001 - refusing is an accepted outcome
        res.note(f"reduce-overhead refused: {type(e).__name__}: {str(e)[:120]}")
        res.expect(True, "reduce-overhead: refused")
        return
    ctx.compare(res, "reduce-overhead: correct (vs uncompiled overlap=False, per element)", plain,
                got, rtol=1e-3, atol=1e-5, exact=False)


# ------------------------------------------------------------------------ 15
def check_user_stream(ctx: Ctx, res: Result) -> None:
    if not ctx.cuda:
        raise Skip("CUDA only: the fake device has no streams")
    data = ctx.mlp_batches(ctx.steps)

    def run(opts, on_stream):
        model = ctx.mlp()
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, **opts)
            s = torch.cuda.Stream()
            for k in range(ctx.steps):
                if on_stream:
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        mlp_loss(model, data[k]).backward()
                        opt.step()
                        opt.zero_grad()
                    torch.cuda.current_stream().wait_stream(s)
                else:
                    mlp_loss(model, data[k]).backward()
                    opt.step()
                    opt.zero_grad()
            opt.synchronize()
            torch.cuda.synchronize()
        return snapshot(model.parameters())
    ref = run(SCHED["sync"], False)
    for label in ("eager", "deferred", "sync"):
        ctx.compare(res, f"forward/backward/step inside torch.cuda.stream(s), {label} == "
                         "overlap=False default stream",
                    ref, run(SCHED[label], True))
