"""bench/gpucheck_dist.py: checks 16-18 of ``bench/gpu_check.py`` - FSDP2 and DDP with world size 1
(NCCL on CUDA, gloo on the fake device; a file store in a temp dir, destroyed after the check)
against the plain model with overlap=False, and robustness: a process that exits right after
step(), a kernel failure in the worker surfacing at the next forward, create/close cycles keeping
RSS and threads flat.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import torch

from .gpucheck_common import Ctx, Result, Skip, local, snapshot
from .gpucheck_train import mlp_loss

SCHED = {"eager": dict(step_during_backward=True), "deferred": dict(step_during_backward=False),
         "default": {}, "sync": dict(overlap=False)}


def _init_pg(ctx: Ctx) -> None:
    import torch.distributed as dist
    if not dist.is_available():
        raise Skip("torch.distributed is not available")
    backend = "nccl" if ctx.cuda else "gloo"
    store = os.path.join(ctx.disk_dir("pg"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def _plain_ref(ctx: Ctx, data):
    model = ctx.mlp()
    opt = ctx.opt(model.parameters(), weight_decay=0.1, overlap=False)
    for s in range(ctx.steps):
        mlp_loss(model, data[s]).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return snapshot(model.parameters())


# ------------------------------------------------------------------------ 16
def check_fsdp2(ctx: Ctx, res: Result) -> None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise Skip(f"FSDP2 (torch.distributed.fsdp.fully_shard) is not available: {e}")
    data = ctx.mlp_batches(ctx.steps)
    ref = _plain_ref(ctx, data)
    _init_pg(ctx)
    for label in ("eager", "deferred"):
        ctx.tick()
        model = ctx.mlp()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        nparams = sum(p.numel() for p in model.parameters())
        ctx.sync()
        mem0 = torch.cuda.memory_allocated() if ctx.cuda else 0
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, **SCHED[label])
            for s in range(ctx.steps):
                ctx.tick()
                mlp_loss(model, data[s]).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
        full = [p.full_tensor().detach().cpu() if hasattr(p, "full_tensor") else p.detach().cpu()
                for p in model.parameters()]
        ctx.compare(res, f"FSDP2 {label} == plain model overlap=False", ref, full)
        p0 = next(iter(model.parameters()))
        st = opt.state.get(p0, {})
        ea = st.get("exp_avg")
        where = None if ea is None else local(ea).device.type
        res.expect(where == "cpu", f"FSDP2 {label}: opt.state[p]['exp_avg'] is on the CPU",
                   device=where)
        if ctx.cuda:
            ctx.sync()
            grown = torch.cuda.memory_allocated() - mem0
            res.expect(grown < 4 * nparams, f"FSDP2 {label}: GPU memory did not grow by ~12 "
                                            "B/param after the steps",
                       grown_bytes=grown, params=nparams)
        ctx.close(opt)


# ------------------------------------------------------------------------ 17
def check_ddp(ctx: Ctx, res: Result) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    data = ctx.mlp_batches(ctx.steps)
    ref = _plain_ref(ctx, data)
    _init_pg(ctx)
    for label in ("default", "deferred"):
        ctx.tick()
        inner = ctx.mlp()
        model = DDP(inner)
        err = None
        with ctx.amplified():
            opt = ctx.opt(model.parameters(), weight_decay=0.1, **SCHED[label])
            try:
                for s in range(ctx.steps):
                    mlp_loss(model, data[s]).backward()
                    opt.step()
                    opt.zero_grad()
                opt.synchronize()
            except RuntimeError as e:
                err = f"{type(e).__name__}: {str(e)[:160]}"
        res.expect(err is None, f"DDP {label} options: trains without error", error=err)
        if err is None:
            ctx.compare(res, f"DDP {label} options == plain model overlap=False", ref,
                        snapshot(inner.parameters()))
            res.data[f"ddp_{label}_steps_during_backward"] = bool(opt.steps_during_backward)
        else:
            ctx.forget(opt)


# ------------------------------------------------------------------------ 18
_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, offload
    from offload.device import FakeDevice
    cuda = sys.argv[1] == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).to(dev)
    opt = offload.AdamW(model.parameters(), bucket_mb=0.1,
                        offload_device=None if cuda else FakeDevice(max_delay=0.01))
    model(torch.randn(8, 256, device=dev)).square().mean().backward()
    opt.step()
    print("stepped", flush=True)
""")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def check_robustness(ctx: Ctx, res: Result) -> None:
    # a process that exits right after step() (uploads and the worker still busy) exits 0
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, ctx.kind], capture_output=True,
                           text=True, timeout=90, cwd=root, env={**os.environ, "PYTHONPATH": root})
        rc, tail = r.returncode, (r.stdout + r.stderr)[-300:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout (90 s)", ""
    res.expect(rc == 0, "a process that exits right after step() returns 0", rc=rc,
               seconds=round(time.time() - t0, 1), output=tail if rc != 0 else "")
    # the kernel raises in the worker: the next forward raises within 1 s, close() works
    def boom(*a, **k):
        raise RuntimeError("kernel failure injected by gpu_check")
    data = ctx.mlp_batches(3)
    model = ctx.mlp()
    opt = ctx.opt(model.parameters(), weight_decay=0.1, **SCHED["eager"])
    mlp_loss(model, data[0]).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    from offload.moments.format import FORMATS, moment_format
    for name in FORMATS:   # the kernel entry of every moment format: the bucket body's native call
        ctx.patch(moment_format(name), "kernel", boom)
    res.data["patched_kernels"] = list(FORMATS)
    raised, dt = None, None
    try:
        mlp_loss(model, data[1]).backward()
        opt.step()
        opt.zero_grad()
        t1 = time.time()
        mlp_loss(model, data[2]).backward()
        opt.step()
        ctx.sync()
    except Exception as e:  # noqa: BLE001
        raised = f"{type(e).__name__}: {str(e)[:120]}"
        dt = time.time() - t1 if "t1" in locals() else 0.0
    res.expect(raised is not None and dt is not None and dt <= 1.0,
               "a kernel failure in the worker: the next forward/backward raises within 1 s",
               error=raised, seconds=dt)
    done = {}
    th = threading.Thread(target=lambda: done.update(ok=_try_close(ctx, opt)), daemon=True)
    th.start()
    th.join(15)
    res.expect(done.get("ok") is True, "close() after the worker failed returns "
                                       "(within 15 s, no hang)",
               outcome=done.get("ok", "still running after 15 s"))
    ctx.unpatch()
    # create/close cycles keep RSS and the thread count flat
    cycles = 4 if ctx.quick else 10

    def cycle():
        m = ctx.mlp()
        dev = ctx.offload_device()
        o = ctx.opt(m.parameters(), weight_decay=0.1, offload_device=dev)
        mlp_loss(m, data[0]).backward()
        o.step()
        o.zero_grad()
        o.synchronize()
        ctx.close(o)
        ctx.close(dev)
        ctx.sync()
    cycle()
    import gc
    gc.collect()
    rss0, th0 = _rss(), threading.active_count()
    for _ in range(cycles):
        ctx.tick()
        cycle()
    gc.collect()
    time.sleep(0.2)
    rss1, th1 = _rss(), threading.active_count()
    res.expect(th1 <= th0, f"{cycles} create/close cycles: thread count flat", before=th0,
               after=th1)
    res.expect(rss1 - rss0 < 64 * 2 ** 20, f"{cycles} create/close cycles: RSS grows < 64 MiB",
               growth_mib=(rss1 - rss0) / 2 ** 20)
    if ctx.cuda:
        try:
            torch.cuda.host_memory_stats
            res.data["host_memory_stats"] = {k: v
                                             for k, v in torch.cuda.host_memory_stats().items()
                                             if "allocated" in k and "current" in k}
        except Exception:  # noqa: BLE001
            pass
        err = None
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            err = str(e)
        res.expect(err is None, "final torch.cuda.synchronize() is clean", error=err)


def _try_close(ctx: Ctx, opt):
    try:
        ctx.close(opt)
        return True
    except Exception as e:  # noqa: BLE001
        ctx.forget(opt)
        return f"raised {type(e).__name__}: {str(e)[:100]}"
