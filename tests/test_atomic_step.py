"""test_atomic_step.py: fault injection into every place a step of host parameters can raise, in
every state tier (ram, nvme, mmap) with fp32, bf16 and 8-bit moments (and torch's fallback
parameters with fp32 RAM state), checked against the rule of docs/failures.md, bitwise: either the
failed call changed nothing (and training then continues exactly as without it), or every later
step and state read raises OptimizerFailedError until the state is loaded, after which training
continues exactly as an uninterrupted run from that checkpoint."""
import copy

import pytest
import torch

import offload
from offload.native import aio
from offload import testing
from offload.base.failstop import OptimizerFailedError
from offload.moments.format import moment_format
from atomic_util import assert_same, grads, snapshot, train
from conftest import configs

HOST = dict(sides=("host",), cover="all")   # configs(...) of this file: every tier x moment format
STEPS = 5          # reference run length; the fault is injected into step 2 (0-based)


class Fault(Exception):
    """The injected error."""


def build(tier, moments, d):
    """Two param groups of fp32 and bf16 parameters, several buckets each with nvme/mmap state; with
    fp32 RAM state also a float64 and a non-contiguous parameter (stepped by torch's code)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in (300, 50, 200)] + [torch.nn.Parameter(torch.randn(64).bfloat16())]
    if tier == "ram" and moments == "fp32":
        ps += [torch.nn.Parameter(torch.randn(6, dtype=torch.float64)), torch.nn.Parameter(torch.randn(5, 4).t())]
    kw = dict(moments=moments, moments_min_size=100) if moments != "fp32" else {}
    if tier != "ram":
        kw.update(storage=tier, nvme_dir=d, host_budget=16384 if tier == "nvme" else 4096)
    groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1}]
    return ps, offload.AdamW(groups, lr=0.01, **kw)


_REFERENCE: dict = {}


def reference(tier, moments, d):
    """Snapshots after every step of an uninterrupted run."""
    key = (tier, moments)
    if key not in _REFERENCE:
        ps, opt = build(tier, moments, d)
        snaps = []
        for s in range(STEPS):
            train(ps, opt, s, 1)
            snaps.append(snapshot(ps, opt))
        opt.close()
        _REFERENCE[key] = snaps
    return _REFERENCE[key]


def _setattr(obj, name, value):
    old = obj.__dict__.get(name, None) if hasattr(obj, "__dict__") else None
    setattr(obj, name, value)
    return lambda: (setattr(obj, name, old) if old is not None else delattr(obj, name))


def _clip_then_add(ps, opt) -> dict:
    opt.clip_grad_norm_(0.5)
    ps[0].grad.add_(1.0)   # accumulated into after the clip: the step refuses
    return {}


def _set_grad_data(p, t):
    p.grad.data = t


# ---- validation errors: (inject(ps, opt) -> step kwargs, undo(ps, opt), the expected error)
def _group1(key, value):
    return (lambda ps, opt: opt.param_groups[1].__setitem__(key, value) or {},
            lambda ps, opt, v=None: opt.param_groups[1].__setitem__(key, copy.deepcopy(VALID[key])))


VALID = dict(lr=0.01, betas=(0.9, 0.999), amsgrad=False, weight_decay=0.1, eps=1e-8)
VALIDATION = {
    "gradient of another shape": (lambda ps, opt: _set_grad_data(ps[3], torch.zeros(65, dtype=ps[3].dtype)) or {},
                                  None, RuntimeError),
    "gradient of another dtype": (lambda ps, opt: _set_grad_data(ps[2], torch.zeros(200, dtype=torch.float64)) or {},
                                  None, (RuntimeError, TypeError)),
    "gradient aliasing its parameter": (lambda ps, opt: setattr(ps[2], "grad", ps[2].detach()) or {}, None,
                                        RuntimeError),
    "lr nan": _group1("lr", float("nan")) + (ValueError,),
    "beta2 = 1": _group1("betas", (0.9, 1.0)) + (ValueError,),
    "negative weight_decay": _group1("weight_decay", -1.0) + (ValueError,),
    "negative eps": _group1("eps", -1.0) + (ValueError,),
    "amsgrad switched on": _group1("amsgrad", True) + (ValueError,),
    "grad_multiplier inf": (lambda ps, opt: dict(grad_multiplier=float("inf")), None, ValueError),
    "gradient modified after clip_grad_norm_": (lambda ps, opt: _clip_then_add(ps, opt), lambda ps, opt: opt.zero_grad(),
                                                RuntimeError),
}


def _continue(ps, opt, done: int, ref) -> None:
    """Train from step ``done`` to the end and compare with the uninterrupted run."""
    train(ps, opt, done, STEPS - done)
    assert_same(snapshot(ps, opt), ref[-1])


def _after_failure(ps, opt, before, ref, *, may_fail: bool, undo=None) -> None:
    """The rule, after a step raised: unchanged (then ``undo`` the cause), or failed until reloaded."""
    try:
        now = snapshot(ps, opt)
    except OptimizerFailedError as e:
        assert may_fail, f"a validation error left the optimizer failed: {e}"
        assert "load_state_dict" in str(e)
        grads(ps, 2)
        with pytest.raises(OptimizerFailedError, match="load the last checkpoint"):
            opt.step()
        with pytest.raises(OptimizerFailedError):
            opt.state_dict()
        with torch.no_grad():   # the checkpoint of the run: model weights and optimizer state
            for p, x in zip(ps, before["params"]):
                p.copy_(x)
        opt.load_state_dict(dict(state=copy.deepcopy(before["state"]),
                                 param_groups=[dict(g, params=list(range(sum(len(h["params"]) for h in
                                                                             opt.param_groups[:gi]),
                                                                         sum(len(h["params"]) for h in
                                                                             opt.param_groups[:gi + 1]))))
                                               for gi, g in enumerate(before["groups"])]))
        assert_same(snapshot(ps, opt), before)
        _continue(ps, opt, 2, ref)
        return
    assert_same(now, before)
    if undo is not None:
        undo(ps, opt)
    _continue(ps, opt, 2, ref)


def _start(cfg, tmp_path, opts):
    ref = reference(cfg.tier, cfg.moments, tmp_path)
    ps, opt = build(cfg.tier, cfg.moments, tmp_path)
    opts.append(opt)
    train(ps, opt, 0, 2)
    assert_same(snapshot(ps, opt), ref[1])
    grads(ps, 2)
    return ps, opt, ref


@pytest.mark.parametrize("cfg", configs(**HOST))
@pytest.mark.parametrize("what", list(VALIDATION))
def test_validation_error_changes_nothing(cfg, what, tmp_path, opts):
    inject, undo, exc = VALIDATION[what]
    ps, opt, ref = _start(cfg, tmp_path, opts)
    kw = inject(ps, opt)
    before = snapshot(ps, opt)
    with pytest.raises(exc):
        opt.step(**kw)
    _after_failure(ps, opt, before, ref, may_fail=False, undo=undo)


# ---- errors inside the step: the nth call of a stage raises
def _store_stage(obj_name, attr):
    return lambda opt: (getattr(testing.state_engine(opt), obj_name) if obj_name else testing.state_engine(opt), attr)


ENGINE_STAGES = {
    "tier.prefetch": _store_stage("tier", "prefetch"),
    "tier.acquire": _store_stage("tier", "acquire"),
    "tier.release (write-back)": _store_stage("tier", "release"),
    "tier.drain": _store_stage("tier", "drain"),
    "side.arrive": _store_stage("side", "arrive"),
    "side.publish": _store_stage("side", "publish"),
    "side.finish": _store_stage("side", "finish"),
    "registry.advance (step counters)": _store_stage("registry", "advance"),
    "registry.init_fresh": _store_stage("registry", "init_fresh"),
    "registry.commit": _store_stage("registry", "commit"),
    "kernel (fp32 buckets)": lambda opt: (moment_format("fp32"), "kernel"),
    "kernel (compressed buckets)": lambda opt: (moment_format(opt.moments), "kernel"),
    "opt.state views": _store_stage("views", "install"),
    "torch's code (fallback parameters)": lambda opt: (offload.optim.fallback, "_torch_adam"),
}


def _stage_cases():
    for cfg in (row.values[0] for row in configs(**HOST)):
        for name in ENGINE_STAGES:
            if name == "kernel (compressed buckets)" and cfg.moments == "fp32":
                continue
            if name.startswith("torch's code") and (cfg.tier, cfg.moments) != ("ram", "fp32"):
                continue   # (only build()'s ram fp32 optimizer has parameters torch's code steps)
            for nth in (1, 3):
                yield pytest.param(cfg, name, nth, id=f"{cfg.id}-{name}-{nth}")


def _failing(fn, nth, count):
    def wrapper(*a, **k):
        count[0] += 1
        if count[0] == nth:
            raise Fault(f"injected failure of call {nth}")
        return fn(*a, **k)
    return wrapper


@pytest.mark.parametrize("cfg,stage,nth", list(_stage_cases()))
def test_failure_inside_the_step(cfg, stage, nth, tmp_path, opts, monkeypatch):
    ps, opt, ref = _start(cfg, tmp_path, opts)
    before = snapshot(ps, opt)
    obj, attr = ENGINE_STAGES[stage](opt)
    count = [0]
    monkeypatch.setattr(obj, attr, _failing(getattr(obj, attr), nth, count))
    try:
        opt.step()
    except Fault:
        monkeypatch.undo()
        _after_failure(ps, opt, before, ref, may_fail=True)
        return
    monkeypatch.undo()
    assert nth > 1, f"{stage} was not reached"   # fewer than nth calls in this mode: the step completed
    assert_same(snapshot(ps, opt), ref[2])
    _continue(ps, opt, 3, ref)


@pytest.mark.parametrize("cfg", configs(**dict(HOST, tiers=("nvme",))))
@pytest.mark.parametrize("nth", [1, 2, 3, 4, 6])
def test_io_error(cfg, nth, tmp_path, opts):
    # the nth read or write system call of the step fails (EIO): reads of the first buckets, then
    # write-backs interleaved with the reads ahead
    ps, opt, ref = _start(cfg, tmp_path, opts)
    before = snapshot(ps, opt)
    testing.inject_io_fault(opt, aio.FAULT_EIO, nth)
    with pytest.raises(OSError) as ei:
        opt.step()
    assert "Input/output error" in str(ei.value)
    _after_failure(ps, opt, before, ref, may_fail=True)
