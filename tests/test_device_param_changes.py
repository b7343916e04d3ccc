"""test_device_param_changes.py: device parameters changed behind the optimizer's back between
steps: a model cast to another dtype after the optimizer was built (``model.float()`` of a bf16
model, ``model.double()``) and a parameter made non-contiguous (``W.data = W.data.t()
.contiguous().t()``). Every step refuses by name, in every schedule, tier and moment format (fake
device), before anything is read from the parameters or written to them or to the state: the fp32
masters keep their precision, and once the change is undone training goes on bitwise as if it had
never been made. Also a cast racing a step in flight: memory-safe, refused, recoverable."""
import copy

import pytest
import torch
import torch.nn as nn

from atomic_util import assert_same, grads, model_step, train_model, snapshot, train
from conftest import Config, configs

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]
CFGS = configs(sides=("fake",), schedules=("eager", "deferred", "sync"))   # tier x moments: once
CASTS = [(torch.bfloat16, "float"), (torch.bfloat16, "double"), (torch.float32, "double")]


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)).to(dtype)


def _reference(make_opt, cfg, dtype, **kw):
    model = _model(dtype)
    opt = make_opt(cfg, model.parameters(), lr=0.01, **kw)
    train_model(model, opt, 0, 2)
    train_model(model, opt, 2, 2)   # (delay_updates=1: synchronize() completes the pending update)
    return snapshot(list(model.parameters()), opt)


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("dtype,cast", CASTS, ids=[f"{str(d)[6:]}-{c}" for d, c in CASTS])
def test_a_cast_model_is_refused_and_nothing_changes(cfg, dtype, cast, make_opt):
    ref = _reference(make_opt, cfg, dtype)
    model = _model(dtype)
    opt = make_opt(cfg, model.parameters(), lr=0.01)
    train_model(model, opt, 0, 2)
    before = snapshot(list(model.parameters()), opt)
    getattr(model, cast)()
    for _ in range(2):   # at every step (eager: the backward that would step buckets raises)
        named = rf"parameter 0 of group 0 changed dtype \({dtype} -> .*cast the parameters back"
        with pytest.raises(RuntimeError, match=named):
            model_step(model, opt, 2)
        opt.zero_grad()
    model.to(dtype)   # back: the same values, and the masters kept their fp32 precision
    assert_same(snapshot(list(model.parameters()), opt), before)
    train_model(model, opt, 2, 2)
    assert_same(snapshot(list(model.parameters()), opt), ref)


def test_the_state_of_a_cast_model_moves_to_a_new_optimizer(make_opt):
    """The refusal's other way out: a new optimizer for the cast model, loaded with the old one's
    state_dict() (taken after the refusal: the fp32 masters are still more precise than bf16)."""
    cfg = CFGS[0].values[0]
    model = _model(torch.bfloat16)
    opt = make_opt(cfg, model.parameters(), lr=0.01)
    train_model(model, opt, 0, 2)
    model.float()
    with pytest.raises(RuntimeError, match="changed dtype"):
        model_step(model, opt, 2)
    opt.zero_grad()
    sd = opt.state_dict()
    assert any(not torch.equal(st["master_param"], st["master_param"].bfloat16().float())
               for st in sd["state"].values())
    opt.close()
    new = make_opt(cfg, model.parameters(), lr=0.01)
    new.load_state_dict(sd)
    got = new.state_dict()["state"]
    for i, st in sd["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][key], st[key]), (i, key)
    train_model(model, new, 2, 1)


def test_a_cast_model_with_delayed_updates(make_opt):
    """delay_updates=1 (its own schedule): refused as in the others, then bitwise."""
    cfg, kw = Config("fake", "ram", "fp32", "deferred"), dict(delay_updates=1, delay_after=0)
    ref = _reference(make_opt, cfg, torch.bfloat16, **kw)
    model = _model(torch.bfloat16)
    opt = make_opt(cfg, model.parameters(), lr=0.01, **kw)
    train_model(model, opt, 0, 2)
    model.float()
    with pytest.raises(RuntimeError, match="parameter 0 of group 0 changed dtype"):
        model_step(model, opt, 2)
    opt.zero_grad()
    model.bfloat16()
    train_model(model, opt, 2, 2)
    assert_same(snapshot(list(model.parameters()), opt), ref)


RACING = {"eager": {}, "deferred": dict(step_during_backward=False),
          "delayed": dict(delay_updates=1, delay_after=0)}


@pytest.mark.parametrize("schedule", list(RACING))
def test_a_cast_racing_a_step_in_flight_is_refused_and_memory_safe(schedule, make_opt):
    """model.float() right after step(), while the CPU worker still steps (delay_updates: always,
    the pending update): no kernel writes past a staging slot sized for bf16 (the process used to
    abort), no weights go into the cast parameters, a call raises naming the parameter, and
    loading the last checkpoint recovers bitwise."""
    from offload.device import FakeDevice
    cfg = Config("fake", "ram", "fp32", "deferred")
    kw = dict(RACING[schedule], offload_device=FakeDevice(min_delay=0.005, max_delay=0.01, seed=0))
    ref = _reference(make_opt, cfg, torch.bfloat16, **kw)
    model = _model(torch.bfloat16)
    kw["offload_device"] = FakeDevice(min_delay=0.005, max_delay=0.01, seed=0)
    opt = make_opt(cfg, model.parameters(), lr=0.01, **kw)
    train_model(model, opt, 0, 2)
    weights, sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model_step(model, opt, 2)   # returns with its CPU step in flight
    model.float()
    with pytest.raises(RuntimeError, match=r"parameter \d of group 0 "):
        opt.synchronize()
    model.bfloat16()
    for _ in range(len(weights)):   # the rest of the race is reported (once per parameter), then
        # synchronize() returns
        try:
            opt.synchronize()
            break
        except RuntimeError as e:
            assert "parameter" in str(e), e
    opt.load_state_dict(sd)
    model.load_state_dict(weights)
    train_model(model, opt, 2, 2)
    assert_same(snapshot(list(model.parameters()), opt), ref)


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_non_contiguous_parameter_is_refused_at_every_step(cfg, dtype, make_opt):
    """Contiguous gradients (set by hand) for a parameter whose .data was made non-contiguous: the
    new weights would be uploaded into a temporary copy and lost while the state advanced."""
    model = _model(dtype)
    opt = make_opt(cfg, model.parameters(), lr=0.01)
    params = list(model.parameters())
    train(params, opt, 0, 4)
    opt.synchronize()
    ref = snapshot(params, opt)
    model = _model(dtype)
    params = list(model.parameters())
    opt = make_opt(cfg, params, lr=0.01)
    train(params, opt, 0, 2)
    opt.synchronize()
    before = snapshot(params, opt)
    w = model[0].weight
    w.data = w.data.t().contiguous().t()
    for s in (2, 3):   # at every step
        grads(params, s)
        named = r"parameter 0 of group 0 is not contiguous \(strides \(1, 24\)\)"
        with pytest.raises(RuntimeError, match=named):
            opt.step()
            opt.synchronize()
        assert_same(snapshot(params, opt), before)
    w.data = w.data.contiguous()
    train(params, opt, 2, 2)
    opt.synchronize()
    assert_same(snapshot(params, opt), ref)
