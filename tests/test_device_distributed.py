"""Device parameters (the GPU-offload path, on the fake device) under torch.distributed: 2 gloo
ranks.

The scenarios live in offload/bench/ranks.py (the GPU check runs the same ones on CUDA): DDP with
default options and with max_grad_norm, ZeroRedundancyOptimizer over DDP with and without clipping,
FSDP2 per layer and at the root only, FSDP2 with clipping and with the overflow check, each rank
against single-process torch.optim.AdamW on the full batch (tests/test_distributed.py's harness).
"""
import pytest
import torch

import offload
from offload.bench import ranks
from test_distributed import _run

pytestmark = pytest.mark.timeout(120)
MODULE = "test_device_distributed"


def _scenario(name):
    return lambda rank, outdir: ranks.SCENARIOS[name](ranks.Rig(rank))


# the harness (test_distributed._run) runs _<name>(rank, outdir) of this module on each rank
_ddp, _ddp_clip = _scenario("ddp"), _scenario("ddp_clip")
_zero1, _zero1_clip = _scenario("zero1"), _scenario("zero1_clip")
_fsdp2, _fsdp2_clip, _fsdp2_overflow = _scenario("fsdp2"), _scenario("fsdp2_clip"), \
    _scenario("fsdp2_overflow")


def test_fsdp2_device_clipping_uses_the_global_norm(tmp_path):
    _run("fsdp2_clip", tmp_path, MODULE)


def test_fsdp2_device_overflow_skip_is_global(tmp_path):
    _run("fsdp2_overflow", tmp_path, MODULE)


def test_fsdp2_device_all_gathers_read_uploaded_shards(tmp_path):
    _run("fsdp2", tmp_path, MODULE)


def test_ddp_device_parameters_default_options(tmp_path):
    _run("ddp", tmp_path, MODULE)


def test_ddp_device_parameters_max_grad_norm(tmp_path):
    _run("ddp_clip", tmp_path, MODULE)


def test_zero1_device_parameters_broadcast_after_uploads(tmp_path):
    _run("zero1", tmp_path, MODULE)


def test_zero1_device_parameters_with_the_model_clipped(tmp_path):
    _run("zero1_clip", tmp_path, MODULE)


# ---------------------------------------------------------------------------- state stays on the host
def _dtensor_state_on_host(rank, outdir):
    """A mesh whose device type is not the host's (a CUDA mesh on a GPU machine, imitated here by
    relabelling the gloo mesh): opt.state and state_dict() wrap the host state without copying it to
    that device."""
    net = ranks.fsdp()
    dev = ranks.fake(rank)
    opt = offload.AdamW(net.parameters(), lr=1e-2, threads=1, offload_device=dev, bucket_mb=0.001)
    ranks.train(net, opt, rank)
    opt.synchronize()
    p = next(iter(net.parameters()))
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


# ---------------------------------------------------------------------------- ZeRO-1: a partition's norm
def _zero1_partition_norm_refused(rank, outdir):
    """Under ZeroRedundancyOptimizer each rank's offload.AdamW holds its partition of the parameters:
    a norm it computes (max_grad_norm=, check_overflow=True, clip_grad_norm_) is its partition's, not
    the model's, and each rank would clip by another coefficient (or skip other steps). Refused by
    name; torch's clip_grad_norm_ of the whole model before step() is the way (docs/distributed.md)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    rig = ranks.Rig(rank)
    net = DDP(rig.model())
    for opts in (dict(max_grad_norm=0.05), dict(check_overflow=True)):
        with pytest.raises(ValueError, match="ZeroRedundancyOptimizer.*partition"):
            ZeroRedundancyOptimizer(net.parameters(), optimizer_class=offload.AdamW, **rig.options(**opts))
    rig.release()
    host = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=offload.AdamW, lr=1e-2)
    x, y = ranks.local_batch(0, rank)
    torch.nn.functional.mse_loss(net(x), y).backward()
    with pytest.raises(RuntimeError, match="ZeroRedundancyOptimizer.*partition"):
        host.optim.clip_grad_norm_(0.05)
    # (a plain offload.AdamW of the same process keeps its clip_grad_norm_)
    plain = offload.AdamW(rig.model().parameters(), lr=1e-2)
    assert float(plain.clip_grad_norm_(1.0)) == 0.0


def test_zero1_partition_norm_is_refused(tmp_path):
    _run("zero1_partition_norm_refused", tmp_path, MODULE)
