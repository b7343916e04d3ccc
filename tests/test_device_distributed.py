"""Device parameters (the GPU-offload path, on the fake device) under torch.distributed: 2 gloo ranks.

FSDP2 with clipping and the overflow check (the norm and the skip decision are global, not this
rank's shard), FSDP2 sharding only at the root (its all-gather reads every shard before any leaf
module runs), DDP with default options (the step waits for DDP's averaged gradients) and
ZeroRedundancyOptimizer over DDP (its broadcast right after step() reads the new weights). Each
rank compares with single-process torch.optim.AdamW on the full batch (tests/test_distributed.py's
harness). The fake device poisons upload destinations until the copy lands, so a collective that
reads a weight before its upload sees NaN.
"""
import os

import pytest
import torch

import offload
from offload.device import FakeDevice
from test_distributed import STEPS, _batch, _close, _local_batch, _model, _reference, _run

pytestmark = pytest.mark.timeout(120)
MODULE = "test_device_distributed"


def _fake():
    return FakeDevice(max_delay=0.004, seed=int(os.environ.get("RANK", "0")))


def _reference_skipping(skip_steps, clip=None):
    """torch.optim.AdamW on the full batch, steps in ``skip_steps`` skipped (their batch consumed)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(STEPS):
        x, y = _batch(s)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if s not in skip_steps:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _fsdp(per_layer=True):
    from torch.distributed.fsdp import fully_shard
    model = _model()
    if per_layer:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
    fully_shard(model)
    return model


def _train(model, opt, rank, inf_at=None, inf_rank=1, clip_method=None):
    norms = []
    for s in range(STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if s == inf_at and rank == inf_rank:
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
        if clip_method is not None:
            norms.append(float(opt.clip_grad_norm_(clip_method)))
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return norms


# ---------------------------------------------------------------------------- FSDP2
def _fsdp2_device_clip(rank, outdir):
    clip = 0.05   # active at every step
    ref, ref_norms = _reference(STEPS, clip=clip)
    for opts in (dict(max_grad_norm=clip), dict(max_grad_norm=clip, overlap=False)):
        model = _fsdp()
        dev = _fake()
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                            bucket_mb=0.001, **opts)
        _train(model, opt, rank)
        for i, (p, r) in enumerate(zip(model.parameters(), ref)):
            _close(p.full_tensor(), r, f"FSDP2 device parameter {i} with max_grad_norm ({opts})")
        opt.close()
        dev.check()
    # the clip_grad_norm_ method returns the global norm
    model = _fsdp()
    dev = _fake()
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                        bucket_mb=0.001, step_during_backward=False)
    norms = _train(model, opt, rank, clip_method=clip)
    for s, (a, b) in enumerate(zip(norms, ref_norms)):
        assert abs(a - b) <= 1e-5 * b, f"step {s}: clip_grad_norm_ returned {a}, the global norm is {b}"
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        _close(p.full_tensor(), r, f"FSDP2 device parameter {i} with clip_grad_norm_")
    opt.close()
    dev.check()


def test_fsdp2_device_clipping_uses_the_global_norm(tmp_path):
    _run("fsdp2_device_clip", tmp_path, MODULE)


def _fsdp2_device_overflow(rank, outdir):
    """An inf in rank 1's shard at step 2: every rank skips that step (one rank stepping would let the
    shards drift apart in step count)."""
    ref = _reference_skipping({2})
    model = _fsdp()
    dev = _fake()
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                        bucket_mb=0.001, check_overflow=True)
    _train(model, opt, rank, inf_at=2)
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        _close(p.full_tensor(), r, f"FSDP2 device parameter {i} after a skipped step")
    steps = {int(st["step"]) for st in opt.state_dict()["state"].values()}
    assert steps == {STEPS - 1}, f"rank {rank} step counts {steps}"
    opt.close()
    dev.check()


def test_fsdp2_device_overflow_skip_is_global(tmp_path):
    _run("fsdp2_device_overflow", tmp_path, MODULE)


def _fsdp2_device_root(rank, outdir):
    """Sharded at the root only: the root's pre-forward all-gathers every shard before any leaf runs."""
    ref, _ = _reference(STEPS)
    for opts in (dict(), dict(step_during_backward=False)):
        model = _fsdp(per_layer=False)
        dev = _fake()
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                            bucket_mb=0.001, **opts)
        _train(model, opt, rank)
        for i, (p, r) in enumerate(zip(model.parameters(), ref)):
            _close(p.full_tensor(), r, f"FSDP2 (root only) device parameter {i} ({opts})")
        assert all(opt.state[p]["exp_avg"].to_local().device.type == "cpu" for p in model.parameters())
        opt.close()
        dev.check()


def test_fsdp2_device_all_gathers_read_uploaded_shards(tmp_path):
    _run("fsdp2_device_root", tmp_path, MODULE)


# ---------------------------------------------------------------------------- DDP and ZeRO-1
def _ddp_device(rank, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref, _ = _reference(STEPS)
    model = DDP(_model())
    dev = _fake()
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                        bucket_mb=0.001)   # default options
    for s in range(STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.last_step_stats(wait=True)["waited_all"]   # step() waited for every upload (several ranks)
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        _close(p.detach(), r, f"DDP device parameter {i}")
    opt.close()
    dev.check()
    with pytest.raises(ValueError, match="several torch.distributed ranks"):
        offload.AdamW(model.parameters(), offload_device=_fake(), step_during_backward=True)


def test_ddp_device_parameters_default_options(tmp_path):
    _run("ddp_device", tmp_path, MODULE)


def _zero1_device(rank, outdir):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref, _ = _reference(STEPS)
    model = DDP(_model())
    dev = _fake()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=offload.AdamW, lr=1e-2, weight_decay=0.1,
                                  threads=1, offload_device=dev, bucket_mb=0.001)
    for s in range(STEPS):
        x, y = _local_batch(s, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()   # ZeRO broadcasts each rank's shard right after the inner step
        opt.zero_grad()
    opt.optim.synchronize()
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        _close(p.detach(), r, f"ZeRO-1 device parameter {i}")
    opt.optim.close()
    dev.check()


def test_zero1_device_parameters_broadcast_after_uploads(tmp_path):
    _run("zero1_device", tmp_path, MODULE)


# ---------------------------------------------------------------------------- state stays on the host
def _dtensor_state_on_host(rank, outdir):
    """A mesh whose device type is not the host's (a CUDA mesh on a GPU machine, imitated here by
    relabelling the gloo mesh): opt.state and state_dict() wrap the host state without copying it to
    that device."""
    model = _fsdp()
    dev = _fake()
    opt = offload.AdamW(model.parameters(), lr=1e-2, threads=1, offload_device=dev, bucket_mb=0.001)
    _train(model, opt, rank)
    p = next(iter(model.parameters()))
    p.device_mesh._device_type = "cuda"   # what from_local moves to: fails on a CPU-only torch
    try:
        st = opt.state_dict()["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].to_local().device.type == "cpu" and st[key].shape == p.shape
        assert opt.state[p]["exp_avg"].to_local().device.type == "cpu"
    finally:
        p.device_mesh._device_type = "cpu"
    opt.close()
    dev.check()


def test_fsdp2_state_is_wrapped_on_the_host(tmp_path):
    _run("dtensor_state_on_host", tmp_path, MODULE)
