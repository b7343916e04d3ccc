"""bench/ranks.py: several torch.distributed ranks against one process - the tiny model, its
batches (each rank takes its share of the full batch), the single-process torch.optim.AdamW
reference on the full batch, and the comparison to rounding. Shared by the 2-rank gloo tests
(tests/test_distributed.py, tests/test_device_distributed.py) and by the GPU check.

The device-parameter scenarios (the GPU-offload path: CUDA parameters, or CPU tensors driven
through the fake device; :class:`Rig`), each with and without clipping: DDP with default options
(the step waits for DDP's averaged gradients), ZeroRedundancyOptimizer over DDP (its broadcast
right after step() reads the new weights), FSDP2 per layer and at the root only (the root's
all-gather reads every shard before any leaf module runs), FSDP2 with max_grad_norm,
clip_grad_norm_ and the overflow check (the norm and the skip decision are global, not this rank's
shard). Each rank compares with single-process torch.optim.AdamW on the full batch on the same
device, to rounding (:func:`close`); DDP and ZeRO-1 replicas must also agree bit for bit across
ranks. The fake device poisons upload destinations until the copy lands, so a collective that
reads a weight before its upload sees NaN.
"""
import torch
import torch.distributed as dist

import offload
from offload.device import FakeDevice

WORLD = 2
STEPS = 4
CLIP = 0.05      # small enough that clipping is active at every step
RTOL, ATOL = 2e-5, 2e-6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 24),
                               torch.nn.GELU(), torch.nn.Linear(24, 5))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * 4, 12, generator=g), torch.randn(WORLD * 4, 5, generator=g)


def reference(steps, clip=None, device="cpu", skip=()):
    """Single-process torch.optim.AdamW on the full batch: what every rank must reproduce (on
    ``device``; the steps in ``skip`` are skipped, their batch consumed)."""
    net = model().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for s in range(steps):
        x, y = (t.to(device) for t in batch(s))
        torch.nn.functional.mse_loss(net(x), y).backward()
        if s not in skip:
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], norms


def local_batch(step, rank, device="cpu"):
    x, y = batch(step)
    return x[rank::WORLD].to(device), y[rank::WORLD].to(device)


def close(a, b, what):
    """Equal to rounding: rtol RTOL, atol ATOL per element (the 2-rank runs reduce the gradients in
    another order than the one process does)."""
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def fake(rank=0):
    return FakeDevice(max_delay=0.004, seed=rank)


class Rig:
    """Where one rank runs a scenario: CUDA parameters on this process's GPU, stepped by offload's
    GPU mode (``offload_device`` left to its default), or CPU tensors driven through a fake
    device."""

    def __init__(self, rank: int, cuda: bool = False):
        self.rank, self.cuda = rank, cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else \
            torch.device("cpu")
        self.worst = 0.0     # the largest |difference| to the reference
        self._fakes = []

    def options(self, **opts) -> dict:
        """offload.AdamW's keyword arguments (also ZeroRedundancyOptimizer's)."""
        dev = None
        if not self.cuda:
            dev = fake(self.rank)
            self._fakes.append(dev)
        return dict(lr=1e-2, weight_decay=0.1, threads=1, bucket_mb=0.001, offload_device=dev,
                    **opts)

    def opt(self, params, **opts):
        return offload.AdamW(params, **self.options(**opts))

    def model(self):
        return model().to(self.device)

    def reference(self, clip=None, skip=()):
        return reference(STEPS, clip=clip, device=self.device, skip=skip)

    def compare(self, got, ref, what) -> None:
        """Every tensor of ``got`` within rounding of ``ref`` (:func:`close`); ``got`` is computed
        in full before the first assertion, so that a failing rank does not leave the other one
        waiting in a collective."""
        got = [t.detach() for t in got]
        assert len(got) == len(ref), f"{what}: {len(got)} tensors, the reference has {len(ref)}"
        for a, b in zip(got, ref):
            self.worst = max(self.worst, float((a.double() - b.double()).abs().max()))
        for i, (a, b) in enumerate(zip(got, ref)):
            close(a, b, f"{what} parameter {i}")

    def finish(self, opt) -> None:
        """``opt`` ran in GPU mode with its state on the host; closed, the fake devices checked."""
        assert opt.gpu_offload, "offload did not run in its GPU mode"
        for st in opt.state.values():
            ea = st.get("exp_avg")
            where = None if ea is None else getattr(ea, "to_local", lambda: ea)().device.type
            assert where == "cpu", f"opt.state[p]['exp_avg'] is on {where}, not on the host"
        opt.close()
        self.release()

    def release(self) -> None:
        for dev in self._fakes:
            dev.check()
            dev.close()
        self._fakes.clear()

    def data(self, **extra) -> dict:
        return dict(max_abs_diff=self.worst, rtol=RTOL, atol=ATOL, **extra)


def replicas_agree(params, what) -> None:
    """Every rank holds the same bits (DDP, ZeRO-1: the replicas of each parameter)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    same = all(torch.equal(every[0].view(torch.int32), e.view(torch.int32)) for e in every[1:])
    assert same, f"{what}: the ranks' parameters differ"


def fsdp(rig=None, per_layer=True):
    from torch.distributed.fsdp import fully_shard
    net = model() if rig is None else rig.model()
    if per_layer:
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
    fully_shard(net)
    return net


def train(net, opt, rank, inf_at=None, inf_rank=1, clip_method=None, device="cpu",
          clip_model=None):
    """STEPS steps on this rank's share of each batch; ``clip_method``: opt.clip_grad_norm_ before
    each step (returns the norms it gave), ``clip_model``: torch.nn.utils.clip_grad_norm_ of the
    model."""
    norms = []
    for s in range(STEPS):
        x, y = local_batch(s, rank, device)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if s == inf_at and rank == inf_rank:
            next(iter(net.parameters())).grad.to_local().view(-1)[0] = float("inf")
        if clip_method is not None:
            norms.append(float(opt.clip_grad_norm_(clip_method)))
        if clip_model is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip_model)
        opt.step()
        opt.zero_grad()
    return norms


# ---------------------------------------------------------------------------- DDP and ZeRO-1
def ddp(rig: Rig, clip=None) -> dict:
    """DDP with default options, or with max_grad_norm (each rank holds every averaged
    gradient)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref, _ = rig.reference(clip=clip)
    net = DDP(rig.model())
    opt = rig.opt(net.parameters(), **({} if clip is None else dict(max_grad_norm=clip)))
    train(net, opt, rig.rank, device=rig.device)
    assert opt.last_step_stats(wait=True)["waited_all"]   # step() waited for every upload
    opt.synchronize()
    rig.compare(net.parameters(), ref, "DDP" + (" with max_grad_norm" if clip else ""))
    replicas_agree(net.parameters(), "DDP")
    rig.finish(opt)
    try:
        offload.AdamW(net.parameters(), **rig.options(step_during_backward=True))
        refused = None
    except ValueError as e:
        refused = str(e)
    rig.release()
    assert refused and "several torch.distributed ranks" in refused, \
        f"step_during_backward=True: {refused}"
    return rig.data()


def ddp_clip(rig: Rig) -> dict:
    return ddp(rig, clip=CLIP)


def zero1(rig: Rig, clip=None) -> dict:
    """ZeroRedundancyOptimizer over DDP; ``clip``: torch.nn.utils.clip_grad_norm_ of the whole
    model before step() (each rank's optimizer sees its partition only: docs/distributed.md)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref, _ = rig.reference(clip=clip)
    net = DDP(rig.model())
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=offload.AdamW, **rig.options())
    train(net, opt, rig.rank, device=rig.device, clip_model=clip)   # broadcast right after step()
    opt.optim.synchronize()
    rig.compare(net.parameters(), ref, "ZeRO-1" + (" with clip_grad_norm_" if clip else ""))
    replicas_agree(net.parameters(), "ZeRO-1")
    rig.finish(opt.optim)
    return rig.data()


def zero1_clip(rig: Rig) -> dict:
    return zero1(rig, clip=CLIP)


# ---------------------------------------------------------------------------- FSDP2
def _fsdp2_run(rig, what, ref, per_layer=True, clip_method=None, inf_at=None, **opts):
    net = fsdp(rig, per_layer)
    opt = rig.opt(net.parameters(), **opts)
    norms = train(net, opt, rig.rank, inf_at=inf_at, clip_method=clip_method, device=rig.device)
    opt.synchronize()
    rig.compare([p.full_tensor() for p in net.parameters()], ref, f"FSDP2 {what} {opts}")
    sd = opt.state_dict()["state"]
    where = {sd[k][key].to_local().device.type for k in sd for key in ("exp_avg", "exp_avg_sq")}
    assert where == {"cpu"}, f"FSDP2 {what}: state_dict() moments on {where}, not on the host"
    steps = {int(st["step"]) for st in sd.values()}
    rig.finish(opt)
    return norms, steps


def fsdp2(rig: Rig) -> dict:
    """Without clipping: sharded per layer, and at the root only (its pre-forward all-gathers every
    shard before any leaf module runs), stepping after backward."""
    ref, _ = rig.reference()
    _fsdp2_run(rig, "per layer", ref)
    _fsdp2_run(rig, "root only", ref, per_layer=False)
    _fsdp2_run(rig, "root only", ref, per_layer=False, step_during_backward=False)
    return rig.data()


def fsdp2_clip(rig: Rig) -> dict:
    """max_grad_norm (with and without overlap) and the clip_grad_norm_ method: the global norm."""
    ref, ref_norms = rig.reference(clip=CLIP)
    for opts in (dict(max_grad_norm=CLIP), dict(max_grad_norm=CLIP, overlap=False)):
        _fsdp2_run(rig, "max_grad_norm", ref, **opts)
    norms, _ = _fsdp2_run(rig, "clip_grad_norm_", ref, clip_method=CLIP,
                          step_during_backward=False)
    for s, (a, b) in enumerate(zip(norms, ref_norms)):
        assert abs(a - b) <= 1e-5 * b, \
            f"step {s}: clip_grad_norm_ returned {a}, the global norm is {b}"
    return rig.data(norms=norms)


def fsdp2_overflow(rig: Rig) -> dict:
    """An inf in rank 1's shard at step 2: every rank skips that step (one rank stepping would let
    the shards drift apart in step count)."""
    ref, _ = rig.reference(skip={2})
    _, steps = _fsdp2_run(rig, "after a skipped step", ref, inf_at=2, check_overflow=True)
    assert steps == {STEPS - 1}, f"rank {rig.rank} step counts {steps}"
    return rig.data()


# every scenario, in the order the GPU check runs them
SCENARIOS = {"ddp": ddp, "ddp_clip": ddp_clip, "zero1": zero1, "zero1_clip": zero1_clip,
             "fsdp2": fsdp2, "fsdp2_clip": fsdp2_clip, "fsdp2_overflow": fsdp2_overflow}
