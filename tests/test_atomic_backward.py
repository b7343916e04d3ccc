"""test_atomic_backward.py: the every-step-is-atomic rule (docs/failures.md) for the default
device schedule, where buckets are stepped during backward (fake device, every tier and moment
format), when a backward does not complete its step: an out-of-memory error, an exception from an
autograd Function, an interrupt, an error inside offload's own gradient hook, a second backward
without no_sync(), zero_grad() instead of step(). What can be checked before the first bucket is
stepped (every group's hyperparameters, the parameters) refuses with nothing changed; otherwise
the optimizer is marked failed, names the error, refuses every call that steps or reads the state
(the next backward too, not with a misleading "second backward"), and loading a checkpoint
recovers it: training is then bitwise an uninterrupted run."""
import copy
import functools

import pytest
import torch
import torch.nn as nn

import offload
from atomic_util import (assert_same, every_call_refused, model_backward, train_model, snapshot,
                         uninterrupted)
from conftest import configs
from offload.schedule import feedstep
from tiny_models import on_backward

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]
EAGER = [row.values[0] for row in configs(sides=("fake",), cover="all")]   # tier x moments: nine
CKPT, MORE = 2, 2


class Fault(Exception):
    """The injected error."""


class Trip(nn.Module):
    """Identity whose backward raises ``error`` while it is set."""
    error = None

    def forward(self, x):
        return x if self.error is None else on_backward(x, functools.partial(_throw, self.error))


def _throw(error):
    raise error


def build(cfg, d):
    """Backward reaches group 0 (the last layer) first: its buckets are stepped before group 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), Trip(), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                          nn.Linear(24, 4), Trip())
    first = list(model[0].parameters()) + list(model[3].parameters())
    groups = [{"params": list(model[5].parameters())}, {"params": first, "weight_decay": 0.0}]
    kw = cfg.kwargs(d, bucket_mb=0.001)
    return model, offload.AdamW(groups, lr=0.01, weight_decay=0.1, **kw)


_REF: dict = {}


def reference(cfg, d):
    return uninterrupted(_REF, cfg, lambda: build(cfg, d),
                         lambda model, opt: train_model(model, opt, 0, CKPT + MORE))


def _trip(error):
    def run(model, opt, monkeypatch):
        model[1].error = error
        try:
            with pytest.raises(type(error)):
                model_backward(model, CKPT)
        finally:
            model[1].error = None
    return run


def _out_of_memory(model, opt, monkeypatch):
    """The usual way to skip a batch that does not fit: zero_grad() in the except block."""
    model[1].error = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    try:
        model_backward(model, CKPT)
    except torch.OutOfMemoryError:
        opt.zero_grad()
    finally:
        model[1].error = None


def _own_hook(model, opt, monkeypatch):
    count, real = [0], feedstep.check_grad

    def failing(*a):
        count[0] += 1
        if count[0] == 3:   # the third gradient: the last layer's bucket was stepped already
            raise Fault("injected")
        return real(*a)
    monkeypatch.setattr(feedstep, "check_grad", failing)
    with pytest.raises(Fault):
        model_backward(model, CKPT)
    monkeypatch.undo()


def _second_backward(model, opt, monkeypatch):
    model_backward(model, CKPT)
    with pytest.raises(RuntimeError, match="second backward"):
        model_backward(model, CKPT + 1)


def _zero_grad_instead_of_step(model, opt, monkeypatch):
    model_backward(model, CKPT)
    opt.zero_grad()


FAILS = {   # trigger, what the failure names
    "out of memory": (_out_of_memory,
                      r"raised part-way.*OutOfMemoryError: CUDA out of memory \(simulated\)"),
    "autograd function raises": (_trip(Fault("in backward")), "a backward raised part-way after"),
    "interrupt": (_trip(KeyboardInterrupt()), "a backward raised part-way after"),
    "offload's gradient hook": (_own_hook, "injected"),
    "second backward": (_second_backward, "second backward"),
    "zero_grad instead of step": (_zero_grad_instead_of_step,
                                  r"zero_grad\(\) discarded the gradients"),
}


def _cases():
    """Each trigger in three of the nine modes, each mode twice (18 cases instead of 54)."""
    rows = [(name, EAGER[(3 * k + j) % len(EAGER)]) for k, name in enumerate(FAILS)
            for j in range(3)]
    return [pytest.param(name, cfg, id=f"{name}-{cfg.id}") for name, cfg in rows]


@pytest.mark.parametrize("name,cfg", _cases())
def test_a_backward_that_does_not_complete_its_step(name, cfg, tmp_path, opts, monkeypatch):
    ref = reference(cfg, tmp_path)
    model, opt = build(cfg, tmp_path)
    opts.append(opt)
    train_model(model, opt, 0, CKPT)
    weights, sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    trigger, names = FAILS[name]
    trigger(model, opt, monkeypatch)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.load_state_dict(weights)   # recovery starts with them: no upload may land after
    with pytest.raises(offload.OptimizerFailedError, match=names):
        model_backward(model, 99)   # not a misleading "second backward"
    with pytest.raises(offload.OptimizerFailedError, match=names):
        opt.step()
    every_call_refused(model, opt, "eager")
    opt.load_state_dict(sd)
    train_model(model, opt, CKPT, MORE)
    assert_same(snapshot(list(model.parameters()), opt), ref)


def _non_contiguous(model, opt):
    w = model[0].weight
    w.data = w.data.t().contiguous().t()


NOTHING = {   # what is refused before the first bucket is stepped, or stops backward before it
    "nan lr in a later group": lambda model, opt: opt.param_groups[1].update(lr=float("nan")),
    "negative eps in a later group": lambda model, opt: opt.param_groups[1].update(eps=-1.0),
    "a parameter made non-contiguous": _non_contiguous,
    "raised before any gradient": lambda model, opt: setattr(model[6], "error", Fault("early")),
}


@pytest.mark.parametrize("cfg", EAGER[::4], ids=[c.id for c in EAGER[::4]])
@pytest.mark.parametrize("name", list(NOTHING))
def test_a_backward_refused_before_any_bucket_changes_nothing(name, cfg, tmp_path, opts):
    ref = reference(cfg, tmp_path)
    model, opt = build(cfg, tmp_path)
    opts.append(opt)
    train_model(model, opt, 0, CKPT)
    before = snapshot(list(model.parameters()), opt)
    group = {k: v for k, v in opt.param_groups[1].items() if k != "params"}
    w = model[0].weight.data
    NOTHING[name](model, opt)
    for _ in range(2):
        with pytest.raises((ValueError, RuntimeError, Fault)):
            model_backward(model, CKPT)
        opt.zero_grad()
    opt.param_groups[1].update(group)
    model[0].weight.data, model[6].error = w, None
    assert_same(snapshot(list(model.parameters()), opt), before)
    train_model(model, opt, CKPT, MORE)
    assert_same(snapshot(list(model.parameters()), opt), ref)
