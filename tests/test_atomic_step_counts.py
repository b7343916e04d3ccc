"""test_atomic_step_counts.py: the ``step`` entries of opt.state, written or replaced between
steps. The parameters stepped by torch's code (float64: offload/optim/fallback.py) take what
torch.optim.AdamW's code takes, with torch's results bit for bit, and what torch refuses (a plain
number, a step whose bias correction divides by zero, a bool or complex tensor) is refused before
anything is stepped. The native kernel takes a whole number of steps: a NaN, negative, fractional,
infinite or huge count, or an entry that is no one-element real tensor, is refused by name before
anything changes (docs/failures.md), in every tier and moment format, for host parameters and for
device parameters in every schedule; training then goes on bitwise as a run that never had it."""
import pytest
import torch
import torch.nn as nn

import offload
from atomic_util import assert_same, grads, model_step, snapshot, tiny_model, train, train_model
from conftest import Config, configs

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]
F64 = torch.float64


# ------------------------------------------------------------------------ stepped by torch's code
def fallback_run(kw):
    """float64 parameters (torch's code) beside fp32 ones (the kernel), in two groups."""
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(n, generator=g, dtype=dt)) for n, dt in
          ((300, torch.float32), (20, F64), (30, F64), (200, torch.float32))]
    groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1}]
    return ps, offload.AdamW(groups, lr=0.01, **kw)


HOST = [Config("host", *r) for r in (("ram", "fp32"), ("nvme", "8bit"), ("mmap", "bf16"))]
TORCH_REFUSES = {   # torch's own code raises on these, part-way through its loop
    "a float": 3.0, "an int": 3, "None": None,
    "-1: step 0 after the increment": torch.tensor(-1.0),
    "-5: a negative bias correction": torch.tensor(-5.0),
    "a bool tensor": torch.tensor(True), "a complex tensor": torch.tensor(3.0 + 0j),
    "two elements": torch.tensor([3.0, 3.0]),
    "uint8 255: 0 after the increment": torch.tensor(255, dtype=torch.uint8),
}


@pytest.mark.parametrize("cfg", HOST, ids=lambda c: c.id)
@pytest.mark.parametrize("bad", list(TORCH_REFUSES))
def test_fallback_step_torch_refuses_is_refused_before_anything_changes(cfg, bad, tmp_path, opts):
    (ps, opt), (ref, ropt) = (fallback_run(cfg.kwargs(tmp_path / d, host_budget=16384))
                              for d in ("a", "b"))
    opts += [opt, ropt]
    train(ps, opt, 0, 2)
    train(ref, ropt, 0, 4)
    good, v = opt.state[ps[2]]["step"], TORCH_REFUSES[bad]
    opt.state[ps[2]]["step"] = v.clone() if isinstance(v, torch.Tensor) else v   # after group 0's
    before = snapshot(ps, opt)
    grads(ps, 2)
    with pytest.raises(ValueError, match="state 'step' of parameter 0 of group 1"):
        opt.step()
    assert_same(snapshot(ps, opt), before)
    opt.state[ps[2]]["step"] = good
    train(ps, opt, 2, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


TORCH_TAKES = {"nan": torch.tensor(float("nan")), "inf": torch.tensor(float("inf")),
               "2.5": torch.tensor(2.5), "0": torch.tensor(0.0), "int64": torch.tensor(3),
               "float64": torch.tensor(3.0, dtype=F64), "shape (1,)": torch.tensor([3.0]),
               "1e30": torch.tensor(1e30)}


@pytest.mark.parametrize("value", list(TORCH_TAKES))
def test_fallback_step_torch_takes_gives_torchs_answer(value, opts):
    ps, opt = fallback_run({})
    opts.append(opt)
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    topt = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "weight_decay": 0.1}],
                             lr=0.01)
    for s in range(3):
        for o, qs in ((opt, ps), (topt, ref)):
            if s == 2:
                o.state[qs[2]]["step"] = TORCH_TAKES[value].clone()
            grads(qs, s)
            o.step()
    for a, b in zip(ps[1:3], ref[1:3]):
        assert_same(dict(params=[a], state=dict(opt.state[a]), coef=1.0),
                    dict(params=[b], state=dict(topt.state[b]), coef=1.0))


# ------------------------------------------------------------------------------ the native kernel
NAN, INF = float("nan"), float("inf")
NATIVE_REFUSES = {   # ("fill", v): written into the counter in place; ("put", v): in its place
    "nan": ("fill", NAN), "-1": ("fill", -1.0), "2.5": ("fill", 2.5), "inf": ("fill", INF),
    "1e30": ("fill", 1e30), "nan, replaced": ("put", torch.tensor(NAN)),
    "-5, replaced": ("put", torch.tensor(-5.0)), "2.5 as a float": ("put", 2.5),
    "two elements": ("put", torch.tensor([3.0, 3.0])), "None": ("put", None),
    "a bool tensor": ("put", torch.tensor(True)), "a string": ("put", "3"),
    "a complex tensor": ("put", torch.tensor(3.0 + 0j)),
}
FEW = ("nan", "-5, replaced")   # in every configuration; the others in two
NATIVE = [row.values[0] for row in configs(schedules=("sync", "deferred", "eager"))]
BOTH = [Config("host", "ram", "fp32"), Config("fake", "nvme", "8bit", "eager")]
DELAYED = Config("fake", "ram", "fp32", "deferred")
CASES = [pytest.param(c, b, {}, id=f"{c.id}-{b}") for c in NATIVE for b in NATIVE_REFUSES
         if b in FEW or c in BOTH]
CASES += [pytest.param(DELAYED, b, dict(delay_updates=1, delay_after=1),
                       id=f"fake-ram-fp32-delayed-{b}") for b in FEW]


def refused_then_bitwise(make_opt, cfg, p_of, spoil, match, **kw):
    """Two runs of tiny_model (configuration ``cfg``, keywords ``kw``), two steps each; then
    ``spoil(opt, p)`` edits opt.state of ``p = p_of(model)`` in one: its next step raises ``match``
    and changes nothing; after the undo ``spoil`` returned, it trains on as the other run. The
    error raised."""
    model, ref = tiny_model(), tiny_model()
    opt, ropt = (make_opt(cfg, m.parameters(), lr=0.01, weight_decay=0.1, **kw)
                 for m in (model, ref))
    ps = list(model.parameters())
    for m, o in ((model, opt), (ref, ropt)):
        train_model(m, o, 0, 2)
    # (the snapshots around the refusal, the spoiled count undone: state_dict() refuses it too)
    before = snapshot(ps, opt)
    undo = spoil(opt, p_of(model))
    with pytest.raises((ValueError, KeyError), match=match) as ei:
        model_step(model, opt, 2)   # (the eager schedule: raised by backward)
    opt.zero_grad()
    opt.synchronize()
    undo()
    assert_same(snapshot(ps, opt), before)
    for m, o in ((model, opt), (ref, ropt)):
        train_model(m, o, 2, 2)
    assert_same(snapshot(ps, opt), snapshot(list(ref.parameters()), ropt))
    return ei.value


def put(opt, p, key, v):
    """opt.state[p][key] = v (a copy); returns the undo."""
    good = opt.state[p][key]
    opt.state[p][key] = v.clone() if isinstance(v, torch.Tensor) else v
    return lambda: opt.state[p].__setitem__(key, good)


@pytest.mark.parametrize("cfg,bad,over", CASES)
def test_native_step_count_refused_before_anything_changes(cfg, bad, over, make_opt):
    how, v = NATIVE_REFUSES[bad]

    def spoil(opt, p):
        if how == "put":
            return put(opt, p, "step", v)
        good = float(opt.state[p]["step"])
        opt.state[p]["step"].fill_(v)   # written through the view of the counter
        return lambda: opt.state[p]["step"].fill_(good)
    err = refused_then_bitwise(make_opt, cfg, lambda m: m[2].weight,   # (after the last layer's)
                               spoil, "parameter 2 of group 0", **over)
    assert "'step'" in str(err)


# --------------------------------------- small parameters: stepped on the device by torch's code
SMALL_REFUSED = {   # torch's foreach/fused Adam raises on these part-way (after other parameters)
    "a float": 3.0, "-1: step 0 after the increment": torch.tensor(-1.0),
    "two elements": torch.tensor([3.0, 3.0]), "an int64 tensor": torch.tensor(3),
    "exp_avg of another shape": torch.zeros(3),
}


@pytest.mark.parametrize("schedule", ["sync", "deferred", "eager"])
@pytest.mark.parametrize("bad", list(SMALL_REFUSED))
def test_small_parameter_state_torch_refuses_is_refused_first(schedule, bad, make_opt):
    key = "exp_avg" if bad.startswith("exp_avg") else "step"
    refused_then_bitwise(make_opt, Config("fake", "ram", "fp32", schedule),
                         lambda m: m[4].bias,   # 4 elements: stepped on the device
                         lambda opt, p: put(opt, p, key, SMALL_REFUSED[bad]),
                         f"state '{key}' of parameter 5 of group 0", small_param_numel=64)
