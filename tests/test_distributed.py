"""offload with torch.distributed on CPU (gloo, 2 processes): ZeRO-1 via ZeroRedundancyOptimizer,
FSDP2 fully_shard with DTensor parameters, gradient clipping across ranks, per-rank checkpoints.

Each test starts 2 processes; each process compares its result with single-process
torch.optim.AdamW on the full batch and writes a verdict file the test reads."""
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.bench.ranks import STEPS, WORLD
from offload.bench.ranks import batch as _batch
from offload.bench.ranks import close as _close
from offload.bench.ranks import local_batch as _local_batch
from offload.bench.ranks import model as _model
from offload.bench.ranks import reference as _reference


def _worker(rank, scenario, outdir, module=None):
    """Runs ``_<scenario>(rank, outdir)`` of this module (or of the test module named ``module``)."""
    try:
        torch.set_num_threads(1)
        # file rendezvous: no TCP port to pick, so no race with other processes on the machine
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}",
                                rank=rank, world_size=WORLD)
        scope = globals() if module is None else vars(__import__(module))
        scope["_" + scenario](rank, outdir)
        verdict = "ok"
    except BaseException:
        verdict = traceback.format_exc()
    with open(os.path.join(outdir, f"verdict{rank}"), "w") as f:
        f.write(verdict)
    if dist.is_initialized():
        if verdict == "ok":
            dist.barrier()  # no rank tears the group down while the other still uses it
        dist.destroy_process_group()


def _run(scenario, tmp_path, module=None):
    # forkserver: one server per test process imports torch once, and each rank is a fork of it (a fresh
    # single-threaded process, as with spawn, without a torch import per rank per test); the preload list
    # counts only when the server starts, so it names what every scenario needs, not this one's module
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(scenario, str(tmp_path), module), nprocs=WORLD, join=True,
                       start_method="forkserver")
    for r in range(WORLD):
        verdict = (tmp_path / f"verdict{r}").read_text()
        assert verdict == "ok", f"rank {r}:\n{verdict}"


# ---------------------------------------------------------------------------- ZeRO-1
def _zero1(rank, outdir):
    _zero1_run(rank, os.path.join(outdir, "ram"), {})
    # the same with each rank's shard of the state in its own NVMe store file
    _zero1_run(rank, os.path.join(outdir, "nvme"), {"storage": "nvme", "host_budget": 16384})


def _zero1_run(rank, outdir, state_kw):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.makedirs(outdir, exist_ok=True)
    if state_kw:
        state_kw = dict(state_kw, nvme_dir=outdir)

    def build(lr=1e-2):
        model = DDP(_model())
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=offload.AdamW, lr=lr,
                                      weight_decay=0.1, threads=1, **state_kw)
        return model, opt

    model, opt = build()
    owned = [p for g in opt.optim.param_groups for p in g["params"]]
    assert 0 < len(owned) < len(list(model.parameters())), "each rank must own a strict shard"
    for s in range(STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if s == 1:
            # one file per rank, each its own shard; async: written in the background, committed
            # collectively by the next step's pre-hook on every rank
            handle = offload.save_async(opt, os.path.join(outdir, "zero1"))
            saved = [p.detach().clone() for p in model.parameters()]
    assert handle.done() and handle.result() == os.path.join(outdir, "zero1")
    assert sum(bool(st) for st in opt.optim.state.values()) == len(owned)  # state only for this rank's shard
    ref, _ = _reference(STEPS)
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        _close(p.detach(), r, f"ZeRO-1 parameter {i}")

    # resume from the checkpoint on both ranks and continue: same result
    model2, opt2 = build(lr=0.5)  # the checkpoint's hyperparameters must win, on the wrapper too
    with torch.no_grad():
        for p, v in zip(model2.parameters(), saved):
            p.copy_(v)
    offload.load(opt2, os.path.join(outdir, "zero1"))
    assert opt2.param_groups[0]["lr"] == 1e-2
    for s in range(2, STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model2(x), y).backward()
        opt2.step()
        opt2.zero_grad()
    for i, (a, b) in enumerate(zip(model.parameters(), model2.parameters())):
        assert torch.equal(a, b), f"ZeRO-1 resumed parameter {i} differs"


@pytest.mark.timeout(90)
def test_zero1_matches_single_process_adamw(tmp_path):
    _run("zero1", tmp_path)


# ---------------------------------------------------------------------------- FSDP2
def _fsdp_model():
    from torch.distributed.fsdp import fully_shard
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _fsdp2(rank, outdir):
    from torch.distributed.tensor import DTensor
    clip = 0.05  # small enough that clipping is active on every step
    model = _fsdp_model()
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # the same run with NVMe state: each rank's local shards in its own state file
    model_nv = _fsdp_model()
    nvdir = os.path.join(outdir, f"nvme-rank{rank}")
    os.makedirs(nvdir)
    opt_nv = offload.AdamW(model_nv.parameters(), lr=1e-2, weight_decay=0.1, threads=1, storage="nvme",
                           nvme_dir=nvdir, host_budget=64 * 1024)
    storages = [p.to_local().data_ptr() for p in model.parameters()]
    ref, ref_norms = _reference(STEPS, clip=clip)
    for s in range(STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = opt.clip_grad_norm_(clip)
        assert abs(float(norm) - ref_norms[s]) <= 1e-5 * ref_norms[s], (s, float(norm), ref_norms[s])
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model_nv(x), y).backward()
        assert float(opt_nv.clip_grad_norm_(clip)) == float(norm)
        opt_nv.step()
        opt_nv.zero_grad()
        if s == 1:
            offload.save(opt, os.path.join(outdir, "fsdp2"))
            saved = [p.to_local().detach().clone() for p in model.parameters()]
    # the kernel wrote into the DTensors' own local storage (no gathered or detached copy)
    assert storages == [p.to_local().data_ptr() for p in model.parameters()]
    st = opt.state[next(iter(model.parameters()))]
    assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].to_local().numel() < st["exp_avg"].numel()
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        _close(p.full_tensor(), r, f"FSDP2 parameter {i}")
    for i, (a, b) in enumerate(zip(model.parameters(), model_nv.parameters())):
        assert torch.equal(a.to_local(), b.to_local()), f"FSDP2 + NVMe parameter {i} differs from RAM state"
    sd, sd_nv = opt.state_dict()["state"], opt_nv.state_dict()["state"]
    for k in sd:
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(sd_nv[k][key], DTensor) and torch.equal(sd[k][key].to_local(), sd_nv[k][key].to_local())
    assert len(os.listdir(nvdir)) == 1   # this rank's private state directory
    opt_nv.close()

    _fsdp2_resume(rank, model, saved, os.path.join(outdir, "fsdp2"), clip, "FSDP2")


def _fsdp2_resume(rank, model, saved, ckpt, clip, what, make=None, dtype=torch.float32, **opt_kw):
    """A fresh FSDP2 model (``make()``, by default _fsdp_model) with the weights ``saved`` after
    step 2 and its optimizer from ``ckpt``, continued to STEPS (inputs in ``dtype``): bitwise
    ``model``."""
    model2 = (make or _fsdp_model)()
    opt2 = offload.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1, threads=1, **opt_kw)
    with torch.no_grad():
        for p, v in zip(model2.parameters(), saved):
            p.to_local().copy_(v)
    offload.load(opt2, ckpt)
    for s in range(2, STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model2(x.to(dtype)).float(), y).backward()
        opt2.clip_grad_norm_(clip)
        opt2.step()
        opt2.zero_grad()
    for i, (a, b) in enumerate(zip(model.parameters(), model2.parameters())):
        assert torch.equal(a.to_local(), b.to_local()), f"{what} resumed parameter {i} differs"


def _fsdp2_moments(rank, outdir):
    """Compressed moments on FSDP2's local shards (DTensor parameters): close to single-process torch
    (a few steps of quantized moments), torch-layout DTensor moments in state_dict(), and offload.save
    / offload.load resume bitwise (the compressed bytes of each rank's shards)."""
    from torch.distributed.tensor import DTensor
    clip = 0.05
    p0 = [p.detach().clone() for p in _model().parameters()]
    ref, _ = _reference(STEPS, clip=clip)
    for fmt, bound in (("bf16", 0.02), ("8bit", 0.08)):
        model = _fsdp_model()
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1, moments=fmt,
                            moments_min_size=0)
        ckpt = os.path.join(outdir, f"fsdp2-{fmt}")
        for s in range(STEPS):
            x, y = _local_batch(s, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
            if s == 1:
                offload.save(opt, ckpt)
                saved = [p.to_local().detach().clone() for p in model.parameters()]
        for i, (p, r, a) in enumerate(zip(model.parameters(), ref, p0)):
            rel = float((p.full_tensor() - r).norm() / (r - a).norm())
            assert rel < bound, f"{fmt} FSDP2 parameter {i}: {rel:.3g} of the update from torch's"
        st = opt.state_dict()["state"][0]
        assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].dtype == torch.float32
        _fsdp2_resume(rank, model, saved, ckpt, clip, f"{fmt} FSDP2", moments=fmt, moments_min_size=0)
        # a held DTensor moment behaves like torch's live state (moments/handouts.py): an in-place write is
        # what the state holds from then on, and the next step refreshes it
        first = next(model.parameters())
        held = opt.state[first]["exp_avg"]
        assert isinstance(held, DTensor)
        held.to_local()[:3] = 0.0
        assert torch.equal(opt.state[first]["exp_avg"].to_local(), held.to_local())
        x, y = _local_batch(0, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        now = opt.state[first]["exp_avg"].to_local()
        assert torch.equal(now, held.to_local()) and not torch.equal(now[:3], torch.zeros(3))


@pytest.mark.timeout(90)
def test_fsdp2_compressed_moments(tmp_path):
    _run("fsdp2_moments", tmp_path)


@pytest.mark.timeout(90)
def test_fsdp2_local_shards_and_clipping_match_single_process(tmp_path):
    _run("fsdp2", tmp_path)
    files = sorted(os.listdir(tmp_path / "fsdp2"))
    assert len(files) == 1 + 2 * WORLD and files[0] == "index.json"
    assert sum(f.endswith(".safetensors") for f in files) == WORLD


# ---------------------------------------------------------------------------- FSDP2 + CPUOffloadPolicy
def _cpu_offload_model(dtype):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    model = _model().to(dtype)
    policy = CPUOffloadPolicy(pin_memory=False)   # pinned host memory needs CUDA
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def _fsdp2_cpu_offload(rank, outdir):
    """torch's own parameter offload (FSDP2 CPUOffloadPolicy: the shards live on the host) with
    offload.AdamW stepping the host shards: fp32 shards match single-process torch AdamW with the global
    norm clipped; bf16 shards get an fp32 master kept by offload, and resume from offload.save bitwise."""
    clip = 0.05
    ref, ref_norms = _reference(STEPS, clip=clip)
    for dtype in (torch.float32, torch.bfloat16):
        model = _cpu_offload_model(dtype)
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1)
        assert not opt.gpu_offload   # host shards: offload's host mode, whatever the mesh's device
        ckpt = os.path.join(outdir, f"cpu-offload-{dtype}")
        for s in range(STEPS):
            x, y = _local_batch(s, rank)
            torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            norm = opt.clip_grad_norm_(clip)
            if dtype == torch.float32:
                assert abs(float(norm) - ref_norms[s]) <= 1e-5 * ref_norms[s], (s, float(norm), ref_norms[s])
            opt.step()
            opt.zero_grad()
            if s == 1:
                offload.save(opt, ckpt)
                saved = [p.to_local().detach().clone() for p in model.parameters()]
        for i, (p, r) in enumerate(zip(model.parameters(), ref)):
            if dtype == torch.float32:
                _close(p.full_tensor(), r, f"FSDP2 CPUOffloadPolicy parameter {i}")
            else:   # bf16 forward and gradients: within bf16 rounding of the fp32 run
                torch.testing.assert_close(p.full_tensor().float(), r, rtol=2e-2, atol=2e-2)
        if dtype == torch.bfloat16:
            assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float32   # fp32 moments of bf16 shards
            _fsdp2_resume(rank, model, saved, ckpt, clip, "CPUOffloadPolicy bf16",
                          make=lambda: _cpu_offload_model(dtype), dtype=dtype)


@pytest.mark.timeout(90)
def test_fsdp2_cpu_offload_policy_with_offload_adamw(tmp_path):
    _run("fsdp2_cpu_offload", tmp_path)
