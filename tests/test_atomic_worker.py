"""test_atomic_worker.py: the every-step-is-atomic rule (docs/failures.md) for device parameters in the
overlapped schedules, where the CPU worker thread (offload/schedule/backward.py, feedstep.py, worker.py,
bucket.py) steps the buckets: the eager schedule (buckets stepped during backward, the default) and
the deferred one (step_during_backward=False), on FakeDevice, with RAM, NVMe and mmap state, fp32,
bf16 and 8-bit moments. A failure injected into one of the worker's stages (gradients to the host,
the kernel, the write-back, the new weights up, the device copy), at its 1st or a later call, must
surface as an exception (at the step, the next forward/backward or synchronize()). Right after it
the model's weights load from a checkpoint taken before (no upload lands on them later); step(),
state_dict(), add_param_group() and, in the eager schedule, backward raise OptimizerFailedError,
every time, while zero_grad() and synchronize() work; after the optimizer's state is loaded too,
training is bitwise equal to an uninterrupted run. (The synchronous schedule, overlap=False, is
tests/test_atomic_device.py.)"""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import offload
from offload import testing
from offload.device import FakeDevice
from atomic_util import assert_same, every_call_refused, train_model, snapshot, uninterrupted
from conftest import configs, patch_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]
FAKE = [row.values[0] for row in configs(sides=("fake",), cover="all")]   # the nine tier x moments rows, in order
CKPT, MORE = 2, 2   # steps before the checkpoint, steps after it


class Fault(Exception):
    """The injected error."""


def build(cfg, d):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4))
    kw = cfg.schedule_kw
    if cfg.moments != "fp32":
        kw.update(moments=cfg.moments, moments_min_size=0)
    if cfg.tier != "ram":
        kw.update(storage=cfg.tier, nvme_dir=d, host_budget=65536)
    opt = offload.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, offload_device=FakeDevice(max_delay=0.001),
                        bucket_mb=0.001, **kw)
    return model, opt


_REF: dict = {}


def reference(cfg, d):
    return uninterrupted(_REF, cfg, lambda: build(cfg, d),
                         lambda model, opt: train_model(model, opt, 0, CKPT + MORE))


def _counting(real, count, nth):
    def failing(*a, **k):
        count[0] += 1
        if count[0] == nth:
            raise Fault("injected")
        return real(*a, **k)
    return failing


def _kernel(opt, monkeypatch, nth):
    """The native kernel call of offload/engine/bucket.py:step_bucket (its format's kernel)."""
    count = [0]
    patch_kernels(monkeypatch, lambda real: _counting(real, count, nth))
    return count


def _method(get, name):
    def inject(opt, monkeypatch, nth):
        obj, count = get(opt), [0]
        monkeypatch.setattr(obj, name, _counting(getattr(obj, name), count, nth))
        return count
    return inject


STAGES = {
    "kernel": _kernel,
    "side.arrive": _method(testing.side, "arrive"),
    "side.publish": _method(testing.side, "publish"),
    "tier.release": _method(testing.tier, "release"),
    "device copy": _method(testing.device, "_copy"),
}


def _mentions_fault(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, Fault) or "injected" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _cases():
    """Every stage x schedule x nth, twice; the nine modes rotate through these 40 slots, so that each
    stage meets 8 of them and each mode 4 or all 5 stages (40 cases instead of 180, to keep the file
    under 15 s)."""
    out = []
    for s, st in enumerate(STAGES):
        for c, sc in enumerate(("eager", "deferred")):
            for j, nth in enumerate((1, 1, 3, 3)):
                cfg = dataclasses.replace(FAKE[(8 * s + 4 * c + j) % len(FAKE)], schedule=sc)
                out.append(pytest.param(st, cfg, nth, id=f"{st}-{cfg.id}-nth{nth}"))
    return out


CASES = _cases()


@pytest.mark.parametrize("stage,cfg,nth", CASES)
def test_worker_failure(stage, cfg, nth, tmp_path, opts, monkeypatch):
    ref = reference(cfg, tmp_path)
    model, opt = build(cfg, tmp_path)
    opts.append(opt)
    train_model(model, opt, 0, CKPT)
    weights, sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    count = STAGES[stage](opt, monkeypatch, nth)
    raised = None
    try:
        train_model(model, opt, CKPT, MORE)
    except Exception as e:   # the failure surfaces at the step, the next forward/backward or synchronize()
        raised = e
    monkeypatch.undo()
    assert count[0] >= nth, f"{stage} was called {count[0]} times, fewer than {nth}"
    assert raised is not None, f"the failure of {stage} (call {nth}) never surfaced"
    assert _mentions_fault(raised), repr(raised)
    # recovery starts with the model's weights, right after the failure surfaced (no other call first):
    # nothing uploaded later may overwrite them
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.load_state_dict(weights)
    every_call_refused(model, opt, cfg.schedule)
    opt.load_state_dict(sd)
    train_model(model, opt, CKPT, MORE)
    assert_same(snapshot(list(model.parameters()), opt), ref)
