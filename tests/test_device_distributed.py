"""Device parameters (the GPU-offload path, on the fake device) under torch.distributed: 2 gloo ranks.

The scenarios live in offload/bench/ranks.py (the GPU check runs them on CUDA): FSDP2 with clipping and
the overflow check, FSDP2 sharding only at the root, DDP with default options and
ZeroRedundancyOptimizer over DDP, each rank against single-process torch.optim.AdamW on the full batch
(tests/test_distributed.py's harness).
"""
import pytest

import offload
from offload.bench.ranks import ddp_device, fake, fsdp, model, train
from offload.bench.ranks import fsdp2_device_clip as _fsdp2_device_clip
from offload.bench.ranks import fsdp2_device_overflow as _fsdp2_device_overflow
from offload.bench.ranks import fsdp2_device_root as _fsdp2_device_root
from offload.bench.ranks import zero1_device as _zero1_device
from test_distributed import _run

pytestmark = pytest.mark.timeout(120)
MODULE = "test_device_distributed"


def _ddp_device(rank, outdir):
    ddp_device(rank, outdir)
    with pytest.raises(ValueError, match="several torch.distributed ranks"):
        offload.AdamW(model().parameters(), offload_device=fake(), step_during_backward=True)


def test_fsdp2_device_clipping_uses_the_global_norm(tmp_path):
    _run("fsdp2_device_clip", tmp_path, MODULE)


def test_fsdp2_device_overflow_skip_is_global(tmp_path):
    _run("fsdp2_device_overflow", tmp_path, MODULE)


def test_fsdp2_device_all_gathers_read_uploaded_shards(tmp_path):
    _run("fsdp2_device_root", tmp_path, MODULE)


def test_ddp_device_parameters_default_options(tmp_path):
    _run("ddp_device", tmp_path, MODULE)


def test_zero1_device_parameters_broadcast_after_uploads(tmp_path):
    _run("zero1_device", tmp_path, MODULE)


# ---------------------------------------------------------------------------- state stays on the host
def _dtensor_state_on_host(rank, outdir):
    """A mesh whose device type is not the host's (a CUDA mesh on a GPU machine, imitated here by
    relabelling the gloo mesh): opt.state and state_dict() wrap the host state without copying it to
    that device."""
    net = fsdp()
    dev = fake()
    opt = offload.AdamW(net.parameters(), lr=1e-2, threads=1, offload_device=dev, bucket_mb=0.001)
    train(net, opt, rank)
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
