"""A step() of device parameters that raises changes nothing (fake device): a pending clip coefficient
from clip_grad_norm_ survives a step refused for a bad hyperparameter, and the corrected step gives
the result of a run that never made the bad call."""
import math

import pytest
import torch
import torch.nn as nn

import offload
from offload.device import FakeDevice

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]


def _run(bad_call: bool, **opts):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    dev = FakeDevice(max_delay=0.001)
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=dev, bucket_mb=0.001, **opts)
    gen = torch.Generator().manual_seed(3)
    norms = []
    for it in range(3):
        model(torch.randn(4, 16, generator=gen)).square().mean().backward()
        norms.append(float(opt.clip_grad_norm_(0.01)))   # active: the coefficient is < 1
        if bad_call and it == 1:
            opt.param_groups[0]["lr"] = math.nan
            with pytest.raises(ValueError, match="learning rate"):
                opt.step()
            opt.param_groups[0]["lr"] = 1e-2
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = [p.detach().clone() for p in model.parameters()]
    opt.close()
    dev.check()
    return out, norms


@pytest.mark.parametrize("opts", [dict(step_during_backward=False), dict(overlap=False)])
def test_refused_step_keeps_the_pending_clip_coefficient(opts):
    ref, ref_norms = _run(False, **opts)
    got, norms = _run(True, **opts)
    assert norms == ref_norms
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
