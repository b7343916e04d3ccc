"""test_gpu_api.py: GPU-offload (fake device, offload/device/fake.py) reporting and refusals:
last_step_stats in every mode, the Chrome trace, option validation, a worker failure that surfaces
instead of hanging.

Parameters are CPU tensors that the pipeline treats as device tensors: every gradient goes down and
every weight goes up through background "streams" with random delays, and the fake device poisons copy
destinations and checks copy sources, so an ordering bug shows up as NaNs or as a recorded hazard.
"""
import pytest
import torch

import offload
from offload.bench.gpt import random_batch
from offload.device import FakeDevice
from conftest import patch_kernels
from pipeline_util import CFG, _trace_spans, make_net, ours, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


# ------------------------------------------------------------------------------------ telemetry / API
@pytest.mark.timeout(60)
def test_stats_and_chrome_trace(tmp_path):
    model, opt = train(ours(trace=True), steps=3)
    st = opt.last_step_stats()
    assert st["step"] == 3 and st["buckets"] == len(opt.storage_info()["bucket_param_bytes"])
    assert st["d2h_bytes"] > 0 and st["h2d_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert st["d2h_s"] > 0 and st["kernel_s"] > 0 and st["h2d_s"] > 0 and st["nvme_s"] == 0
    assert st["exposed_s"] > 0 and st["overlapped"] and not st["skipped"]
    names = {name.split(" ")[0] for name, _, _ in _trace_spans(opt, tmp_path / "t.json")}
    assert {"d2h", "adam", "h2d", "step()"} <= names, names


def test_options_are_validated():
    model = make_net(torch.float32)
    with pytest.raises(TypeError, match="bucket_size"):
        offload.AdamW(model.parameters(), offload_device=FakeDevice(), bucket_size=3)
    with pytest.raises(TypeError, match="only apply to GPU offload"):
        offload.AdamW(model.parameters(), bucket_mb=3)
    with pytest.raises(ValueError, match="step_during_backward"):
        offload.AdamW(model.parameters(), offload_device=FakeDevice(), step_during_backward=True, max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="only available in GPU-offload mode"):
        offload.AdamW(model.parameters()).reload_params()
    # a bucket under one byte would read as "no bucket limit": one bucket for the whole model
    with pytest.raises(ValueError, match=r"bucket_mb=1e-07 is under one byte"):
        offload.AdamW(model.parameters(), offload_device=FakeDevice(), bucket_mb=1e-7)


def test_last_step_stats_in_every_mode(tmp_path):
    """Host params with RAM or NVMe state report the same keys as GPU offload; nvme_s is filled."""
    for kw in ({}, dict(storage="nvme", nvme_dir=tmp_path), dict(storage="mmap", nvme_dir=tmp_path),
               dict(offload_device=FakeDevice(), storage="nvme", nvme_dir=tmp_path), dict(offload_device=FakeDevice()),
               dict(offload_device=FakeDevice(), overlap=False)):
        p = torch.nn.Parameter(torch.randn(5000))
        opt = offload.AdamW([p], **kw)
        assert opt.last_step_stats() is None
        for _ in range(2):
            p.grad = torch.randn(5000)
            opt.step()
        st = opt.last_step_stats(wait=True)
        assert set(st) >= {"step", "d2h_s", "kernel_s", "h2d_s", "nvme_s", "exposed_s", "skipped"}, (kw, st)
        assert st["step"] == 2 and st["kernel_s"] > 0 and not st["skipped"], kw
        if kw.get("storage") == "nvme":
            assert st["nvme_s"] > 0, kw
        opt.close()


@pytest.mark.timeout(60)
def test_worker_failure_surfaces_instead_of_hanging(monkeypatch):
    model = make_net(torch.float32)
    opt = ours()(model)
    def boom(*a, **k):
        raise ValueError("injected kernel failure")
    patch_kernels(monkeypatch, lambda real: boom)  # the kernel call of the worker's bucket body
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        model(idx, tgt, use_aux=True).backward()
        opt.step()
        model(idx, tgt, use_aux=True)   # the next forward waits for uploads: must raise, not hang
        opt.synchronize()
