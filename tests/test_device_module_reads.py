"""Device parameters read by a module other than their owner (fake device).

``nn.MultiheadAttention`` reads ``out_proj.weight``/``.bias`` without running ``out_proj``, and so do
the torch.nn transformer layers built on it; custom blocks read a child's weight through ``F.linear``.
The next forward (and ``model.state_dict()`` right after ``step()``) must see the new weights in every
schedule: each result is compared bitwise with ``overlap=False``, which finishes the step inside
``step()``. The fake device poisons upload destinations until the copy lands, so a read that does
not wait sees NaN.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload
from offload.device import FakeDevice

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

SCHEDULES = {
    "sync": dict(overlap=False),
    "eager": dict(),
    "deferred": dict(step_during_backward=False),
    "clip": dict(max_grad_norm=1e9),
    "overflow": dict(check_overflow=True),
}


def _encoder():
    layer = dict(d_model=64, nhead=4, dim_feedforward=96, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoderLayer(**layer), nn.TransformerEncoderLayer(**layer))


class _ReadsChild(nn.Module):
    """A block that runs ``inner`` but only reads ``proj``'s weight (F.linear), twice per forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(48, 48)
        self.proj = nn.Linear(48, 48)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return F.linear(F.linear(h, self.proj.weight, self.proj.bias), self.proj.weight)


def _reads_child():
    return nn.Sequential(_ReadsChild(), nn.LayerNorm(48), _ReadsChild())


MODELS = {"encoder": (_encoder, (2, 6, 64)), "f_linear": (_reads_child, (4, 48))}


def _train(model_name, opts, steps=4, dtype=torch.float32, compute_lag=0.0):
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(dtype)
    dev = FakeDevice(max_delay=0.003, seed=1, compute_lag=compute_lag)
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=dev, bucket_mb=0.004, **opts)
    gen = torch.Generator().manual_seed(5)
    snaps = []
    for _ in range(steps):
        x = torch.randn(*shape, generator=gen).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        snaps.append({k: v.clone() for k, v in model.state_dict().items()})   # right after step()
        opt.zero_grad()
    opt.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    dev.check()
    return params, snaps


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("schedule", ["eager", "deferred", "clip", "overflow"])
def test_non_owner_reads_match_overlap_false_bitwise(model_name, schedule):
    ref_params, ref_snaps = _train(model_name, SCHEDULES["sync"])
    params, snaps = _train(model_name, SCHEDULES[schedule])
    for k, (a, b) in enumerate(zip(ref_params, params)):
        assert torch.equal(a, b), f"parameter {k} differs from overlap=False"
    for s, (a, b) in enumerate(zip(ref_snaps, snaps)):
        for key in a:
            assert torch.equal(a[key], b[key]), f"model.state_dict()[{key!r}] right after step {s} is stale"


def test_non_owner_reads_bf16_deferred():
    ref, _ = _train("encoder", SCHEDULES["sync"], steps=3, dtype=torch.bfloat16)
    got, _ = _train("encoder", SCHEDULES["deferred"], steps=3, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("schedule", ["eager", "deferred"])
def test_lagging_compute_stream(schedule):
    """Events recorded on the compute stream complete later (as on a GPU): copies that wait for them
    start late; results stay bitwise those of overlap=False."""
    ref, _ = _train("encoder", SCHEDULES["sync"], steps=3)
    got, _ = _train("encoder", SCHEDULES[schedule], steps=3, compute_lag=0.002)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
