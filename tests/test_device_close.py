"""test_device_close.py: device parameters after ``opt.close()`` (fake device, every schedule and
tier). Each call that would step, synchronize, save or load the optimizer refuses at once, naming
the cause ("the optimizer was closed"), as a closed file does, and changes nothing; close() again,
zero_grad(), storage_info(), last_step_stats() and the model itself (forward, backward, its
state_dict, a new optimizer over it) go on working."""
import time

import pytest
import torch
import torch.nn as nn

import offload
from atomic_util import model_backward
from conftest import Config
from offload.schedule import worker

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]
CASES = {   # schedule x tier, each tier and schedule at least once
    "eager-ram": (Config("fake", "ram", "fp32", "eager"), {}),
    "deferred-nvme": (Config("fake", "nvme", "bf16", "deferred"), {}),
    "sync-mmap": (Config("fake", "mmap", "8bit", "sync"), {}),
    "delayed-ram": (Config("fake", "ram", "fp32", "deferred"),
                    dict(delay_updates=1, delay_after=0)),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


EXTRA = nn.Parameter(torch.ones(2))
REFUSED = {
    "step": lambda opt, sd, d: opt.step(),
    "synchronize": lambda opt, sd, d: opt.synchronize(),
    "state_dict": lambda opt, sd, d: opt.state_dict(),
    "load_state_dict": lambda opt, sd, d: opt.load_state_dict(sd),
    "add_param_group": lambda opt, sd, d: opt.add_param_group({"params": [EXTRA]}),
    "reload_params": lambda opt, sd, d: opt.reload_params(),
    "clip_grad_norm_": lambda opt, sd, d: opt.clip_grad_norm_(1.0),
    "offload.save": lambda opt, sd, d: offload.save(opt, d / "after"),
    "offload.load": lambda opt, sd, d: offload.load(opt, d / "before"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_calls_after_close_refuse_at_once_by_name(case, make_opt, tmp_path, monkeypatch):
    monkeypatch.setattr(worker, "_WAIT_S", 5.0)   # (waiting for the stopped worker: fails fast)
    cfg, kw = CASES[case]
    model = _model()
    opt = make_opt(cfg, model.parameters(), lr=0.01, **kw)
    for s in range(2):
        model_backward(model, s)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    offload.save(opt, tmp_path / "before")
    opt.close()
    weights = [p.detach().clone() for p in model.parameters()]
    model_backward(model, 2)   # the model works without the optimizer: its hooks are gone
    grads = [p.grad.clone() for p in model.parameters()]
    for name, call in REFUSED.items():
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="the optimizer was closed"):
            call(opt, sd, tmp_path)
        assert time.perf_counter() - t0 < 1.0, name
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), name
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), name
    assert not list((tmp_path / "after").iterdir())   # (save() made the directory: nothing in it)
    opt.close()   # a second close does nothing
    assert opt.last_step_stats(wait=True)["step"] >= 1
    opt.storage_info()
    opt.zero_grad(set_to_none=False)
    assert all(not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    model.load_state_dict(model.state_dict())
    new = make_opt(cfg, model.parameters(), lr=0.01, **kw)   # another optimizer trains the model
    new.load_state_dict(sd)
    model_backward(model, 3)
    new.step()
    new.synchronize()
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
