"""test_atomic_device.py: the every-step-is-atomic rule (docs/failures.md) for device parameters
(GPU offload, driven by the CPU test device): validation errors change nothing; a failed device
copy or state I/O leaves the optimizer failed until load_state_dict, then training continues
bitwise. The synchronous schedule (overlap=False) with RAM and NVMe state, fp32 and 8-bit moments."""
import copy

import pytest
import torch

import offload
from offload import testing
from offload.device import CpuDevice
from atomic_util import assert_same, grads, snapshot, train
from conftest import configs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU_SYNC = dict(sides=("cpu",), schedules=("sync",), cover="all")   # configs(...) of this file (build)


class Fault(Exception):
    """The injected error."""


def build(tier, moments, d, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in (300, 50, 200)] + [torch.nn.Parameter(torch.randn(64).bfloat16())]
    if moments != "fp32":
        kw.update(moments=moments, moments_min_size=100)
    if tier != "ram":
        kw.update(storage=tier, nvme_dir=d, host_budget=65536)
    groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1}]
    kw = dict(dict(overlap=False, bucket_mb=0.002), **kw)
    return ps, offload.AdamW(groups, lr=0.01, offload_device=CpuDevice(), **kw)


_REF: dict = {}


def reference(tier, moments, d):
    if (tier, moments) not in _REF:
        ps, opt = build(tier, moments, d)
        train(ps, opt, 0, 4)
        _REF[tier, moments] = snapshot(ps, opt)
        opt.close()
    return _REF[tier, moments]


def _start(tier, moments, d, opts):
    ref = reference(tier, moments, d)
    ps, opt = build(tier, moments, d)
    opts.append(opt)
    train(ps, opt, 0, 2)
    grads(ps, 2)
    return ps, opt, ref


def _reload(ps, opt, weights, sd):
    with torch.no_grad():
        for p, w in zip(ps, weights):
            p.copy_(w)
    opt.load_state_dict(sd)


VALIDATION = {
    "lr nan": lambda ps, opt: opt.param_groups[1].__setitem__("lr", float("nan")) or {},
    "beta2 = 1": lambda ps, opt: opt.param_groups[1].__setitem__("betas", (0.9, 1.0)) or {},
    "gradient of another shape": lambda ps, opt: setattr(ps[2].grad, "data", torch.zeros(201)) or {},
    "grad_multiplier inf": lambda ps, opt: dict(grad_multiplier=float("inf")),
}


@pytest.mark.parametrize("cfg", configs(**CPU_SYNC))
@pytest.mark.parametrize("what", list(VALIDATION))
def test_validation_error_changes_nothing(cfg, what, tmp_path, opts):
    ps, opt, ref = _start(cfg.tier, cfg.moments, tmp_path, opts)
    group = copy.deepcopy({k: v for k, v in opt.param_groups[1].items() if k != "params"})
    kw = VALIDATION[what](ps, opt)
    before = snapshot(ps, opt)
    with pytest.raises((ValueError, RuntimeError)):
        opt.step(**kw)
    assert_same(snapshot(ps, opt), before)
    opt.param_groups[1].update(group)
    train(ps, opt, 2, 2)
    assert_same(snapshot(ps, opt), ref)


STAGES = {
    "device copy": lambda opt: (testing.device(opt), "_copy"),
    "side.arrive (gradients to host)": lambda opt: (testing.side(opt), "arrive"),
    "side.publish (new weights up)": lambda opt: (testing.side(opt), "publish"),
    "tier.release (write-back)": lambda opt: (testing.tier(opt), "release"),
}


@pytest.mark.parametrize("cfg", configs(**CPU_SYNC))
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("nth", [1, 3])
def test_failure_inside_the_step(cfg, stage, nth, tmp_path, opts, monkeypatch):
    ps, opt, ref = _start(cfg.tier, cfg.moments, tmp_path, opts)
    weights, sd = [p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict())
    obj, attr = STAGES[stage](opt)
    real, count = getattr(obj, attr), [0]

    def failing(*a, **k):
        count[0] += 1
        if count[0] == nth:
            raise Fault("injected")
        return real(*a, **k)
    monkeypatch.setattr(obj, attr, failing)
    try:
        opt.step()
    except Fault:
        monkeypatch.undo()
        with pytest.raises(offload.OptimizerFailedError, match="load the last checkpoint"):
            opt.step()
        with pytest.raises(offload.OptimizerFailedError):
            opt.state_dict()
        _reload(ps, opt, weights, sd)
        train(ps, opt, 2, 2)
    else:
        monkeypatch.undo()
        assert nth > 1, f"{stage} was not reached"
        train(ps, opt, 3, 1)
    assert_same(snapshot(ps, opt), ref)


def test_small_device_parameters_not_stepped_by_a_step_that_raises(tmp_path, opts):
    ps, opt = build("ram", "fp32", tmp_path, small_param_numel=60)   # parameter 1 (50 elements): on the device
    opts.append(opt)
    train(ps, opt, 0, 2)
    grads(ps, 2)
    opt.param_groups[0]["lr"] = float("nan")
    before = snapshot(ps, opt)
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()
    assert_same(snapshot(ps, opt), before)


@pytest.mark.parametrize("schedule", [dict(), dict(overlap=True, step_during_backward=False)])
def test_a_failed_optimizer_steps_nothing(schedule, tmp_path, opts, monkeypatch):
    # every later step() raises OptimizerFailedError before anything else: before validating (a bad
    # lr is not what it reports) and before stepping the small parameters torch steps on the device
    ps, opt = build("ram", "fp32", tmp_path, small_param_numel=60, **schedule)   # parameter 1: on the device
    opts.append(opt)
    train(ps, opt, 0, 2)
    monkeypatch.setattr(testing.side(opt), "publish", lambda *a, **k: (_ for _ in ()).throw(Fault("injected")))
    grads(ps, 2)
    with pytest.raises((Fault, offload.OptimizerFailedError), match="injected"):
        opt.step()
        opt.synchronize()
    monkeypatch.undo()
    grads(ps, 3)
    weights = [p.detach().clone() for p in ps]
    for lr in (float("nan"), 0.01):
        opt.param_groups[0]["lr"] = lr
        with pytest.raises(offload.OptimizerFailedError, match="injected.*load the last checkpoint"):
            opt.step()
        assert all(torch.equal(p, w) for p, w in zip(ps, weights))
