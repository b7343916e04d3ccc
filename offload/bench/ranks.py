"""bench/ranks.py: several torch.distributed ranks against one process - the tiny model, its batches
(each rank takes its share of the full batch), the single-process torch.optim.AdamW reference on the
full batch, and the comparison to rounding. Shared by the 2-rank gloo tests (tests/test_distributed.py,
tests/test_device_distributed.py) and by the GPU check.

The device-parameter scenarios (the GPU-offload path, on the fake device): FSDP2 with clipping and the
overflow check (the norm and the skip decision are global, not this rank's shard), FSDP2 sharding only
at the root (its all-gather reads every shard before any leaf module runs), DDP with default options
(the step waits for DDP's averaged gradients) and ZeroRedundancyOptimizer over DDP (its broadcast right
after step() reads the new weights). Each rank compares with single-process torch.optim.AdamW on the
full batch. The fake device poisons upload destinations until the copy lands, so a collective that
reads a weight before its upload sees NaN.
"""
import os

import torch

import offload
from offload.device import FakeDevice

WORLD = 2
STEPS = 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 24),
                               torch.nn.GELU(), torch.nn.Linear(24, 5))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * 4, 12, generator=g), torch.randn(WORLD * 4, 5, generator=g)


def reference(steps, clip=None):
    """Single-process torch.optim.AdamW on the full batch: what every rank must reproduce."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for s in range(steps):
        x, y = batch(s)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], norms


def local_batch(step, rank):
    x, y = batch(step)
    return x[rank::WORLD], y[rank::WORLD]


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")


def fake():
    return FakeDevice(max_delay=0.004, seed=int(os.environ.get("RANK", "0")))


def reference_skipping(skip_steps, clip=None):
    """torch.optim.AdamW on the full batch, steps in ``skip_steps`` skipped (their batch consumed)."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(STEPS):
        x, y = batch(s)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if s not in skip_steps:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def fsdp(per_layer=True):
    from torch.distributed.fsdp import fully_shard
    net = model()
    if per_layer:
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
    fully_shard(net)
    return net


def train(net, opt, rank, inf_at=None, inf_rank=1, clip_method=None):
    norms = []
    for s in range(STEPS):
        x, y = local_batch(s, rank)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if s == inf_at and rank == inf_rank:
            next(iter(net.parameters())).grad.to_local().view(-1)[0] = float("inf")
        if clip_method is not None:
            norms.append(float(opt.clip_grad_norm_(clip_method)))
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return norms


# ---------------------------------------------------------------------------- FSDP2
def fsdp2_device_clip(rank, outdir):
    clip = 0.05   # active at every step
    ref, ref_norms = reference(STEPS, clip=clip)
    for opts in (dict(max_grad_norm=clip), dict(max_grad_norm=clip, overlap=False)):
        net = fsdp()
        dev = fake()
        opt = offload.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                            bucket_mb=0.001, **opts)
        train(net, opt, rank)
        for i, (p, r) in enumerate(zip(net.parameters(), ref)):
            close(p.full_tensor(), r, f"FSDP2 device parameter {i} with max_grad_norm ({opts})")
        opt.close()
        dev.check()
    # the clip_grad_norm_ method returns the global norm
    net = fsdp()
    dev = fake()
    opt = offload.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                        bucket_mb=0.001, step_during_backward=False)
    norms = train(net, opt, rank, clip_method=clip)
    for s, (a, b) in enumerate(zip(norms, ref_norms)):
        assert abs(a - b) <= 1e-5 * b, f"step {s}: clip_grad_norm_ returned {a}, the global norm is {b}"
    for i, (p, r) in enumerate(zip(net.parameters(), ref)):
        close(p.full_tensor(), r, f"FSDP2 device parameter {i} with clip_grad_norm_")
    opt.close()
    dev.check()


def fsdp2_device_overflow(rank, outdir):
    """An inf in rank 1's shard at step 2: every rank skips that step (one rank stepping would let the
    shards drift apart in step count)."""
    ref = reference_skipping({2})
    net = fsdp()
    dev = fake()
    opt = offload.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                        bucket_mb=0.001, check_overflow=True)
    train(net, opt, rank, inf_at=2)
    for i, (p, r) in enumerate(zip(net.parameters(), ref)):
        close(p.full_tensor(), r, f"FSDP2 device parameter {i} after a skipped step")
    steps = {int(st["step"]) for st in opt.state_dict()["state"].values()}
    assert steps == {STEPS - 1}, f"rank {rank} step counts {steps}"
    opt.close()
    dev.check()


def fsdp2_device_root(rank, outdir):
    """Sharded at the root only: the root's pre-forward all-gathers every shard before any leaf runs."""
    ref, _ = reference(STEPS)
    for opts in (dict(), dict(step_during_backward=False)):
        net = fsdp(per_layer=False)
        dev = fake()
        opt = offload.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                            bucket_mb=0.001, **opts)
        train(net, opt, rank)
        for i, (p, r) in enumerate(zip(net.parameters(), ref)):
            close(p.full_tensor(), r, f"FSDP2 (root only) device parameter {i} ({opts})")
        assert all(opt.state[p]["exp_avg"].to_local().device.type == "cpu" for p in net.parameters())
        opt.close()
        dev.check()


# ---------------------------------------------------------------------------- DDP and ZeRO-1
def ddp_device(rank, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref, _ = reference(STEPS)
    net = DDP(model())
    dev = fake()
    opt = offload.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, threads=1, offload_device=dev,
                        bucket_mb=0.001)   # default options
    for s in range(STEPS):
        x, y = local_batch(s, rank)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.last_step_stats(wait=True)["waited_all"]   # step() waited for every upload (several ranks)
    for i, (p, r) in enumerate(zip(net.parameters(), ref)):
        close(p.detach(), r, f"DDP device parameter {i}")
    opt.close()
    dev.check()


def zero1_device(rank, outdir):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref, _ = reference(STEPS)
    net = DDP(model())
    dev = fake()
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=offload.AdamW, lr=1e-2, weight_decay=0.1,
                                  threads=1, offload_device=dev, bucket_mb=0.001)
    for s in range(STEPS):
        x, y = local_batch(s, rank)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()   # ZeRO broadcasts each rank's shard right after the inner step
        opt.zero_grad()
    opt.optim.synchronize()
    for i, (p, r) in enumerate(zip(net.parameters(), ref)):
        close(p.detach(), r, f"ZeRO-1 device parameter {i}")
    opt.optim.close()
    dev.check()
