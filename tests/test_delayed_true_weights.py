"""tests/test_delayed_true_weights.py: with ``delay_extrapolate=True`` the weights predicted for a
delayed forward never stand in for the true ones (offload/schedule/delayed.py).

A delayed forward runs on predicted weights, w + (w - w_before). Whatever needs the current weights
completes the pending update and must then find round(master) on the device: also for a parameter
the last update did not step (no gradient: frozen for a while, an unused expert), which still shows
the prediction of an earlier update. Each way the prediction could be taken for the weights is a
test: the forwards after such an update (the rule of docs/gpu.md, written out in
delayed_util.reference), ``synchronize()`` and every call that completes the pending update, a
checkpoint and the run resumed from it, a state deleted while an update is pending (its fresh
master is read from the parameter), and a parameter written while an update is pending (its master
would be re-read from it). Every tier and moment format; fp32 and bf16 parameters.
"""
import pytest
import torch

import offload
from conftest import configs
from delayed_util import (LR, WD, assert_matches, assert_same_run, batches, check_device,
                          make_net, moment_opts, ours, reference, tier_opts, train)

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)

DELAYED = configs(sides=("fake",), schedules=("deferred",), cover="all")   # tiers x moment formats
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# parameters 0 (a.weight: a bucket of its own in fp32) and 6 (c.weight: shares its bucket) without a
# gradient in some iterations, among them the last
FROZEN = {3: {0, 6}, 6: {0}, 9: {0, 6}}
STEPS = 10


def assert_true_weights(params, masters, what):
    for i, (p, m) in enumerate(zip(params, masters)):
        got = p.detach()
        diff = (got.float() - m.float()).abs().max()
        assert torch.equal(got, m.to(got.dtype)), f"{what}: parameter {i}: {diff} off round(master)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", DELAYED)
def test_parameters_without_a_gradient_follow_the_rule(cfg, dtype, tmp_path):
    """The forward after an update that did not step a parameter runs on its true weights (the
    prediction of that parameter was one update on, and that update did not come); a skipped step
    and ``synchronize()`` give them back too."""
    data = batches(STEPS, dtype=dtype)
    model, opt, losses = ours(dtype, data, state_opts=tier_opts(cfg, tmp_path), extrapolate=True,
                              frozen=FROZEN, inf_step=7)
    ref = reference("offload", dtype, data, extrapolate=True, frozen=FROZEN, inf_step=7,
                    opt_kw=moment_opts(cfg))
    assert losses == ref[0]
    assert_matches(model, opt, ref)
    assert_true_weights(model.parameters(), ref[1], "after synchronize()")
    check_device(opt)
    opt.close()


def _reader(how, model, opt, dtype, tmp_path):
    """Call ``how``, one of the calls that complete the pending update; the weights it gives."""
    if how == "model.state_dict":
        return list(model.state_dict().values())
    if how == "add_param_group":
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(3, dtype=dtype))]))
    elif how == "save":
        offload.save(opt, str(tmp_path / "ckpt"))
    elif how in ("synchronize", "state_dict", "close", "reload_params"):
        getattr(opt, how)()
    elif how == "zero_grad(set_to_none=False)":
        opt.zero_grad(set_to_none=False)
    elif how == "last_step_stats(wait=True)":
        opt.last_step_stats(wait=True)
    return list(model.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["synchronize", "model.state_dict", "state_dict", "save", "close",
                                 "reload_params", "zero_grad(set_to_none=False)",
                                 "last_step_stats(wait=True)", "add_param_group"])
def test_what_completes_the_pending_update_gives_the_true_weights(how, dtype, tmp_path):
    data = batches(STEPS, dtype=dtype)
    model, opt, _ = ours(dtype, data, extrapolate=True, frozen=FROZEN)
    masters = reference("offload", dtype, data, extrapolate=True, frozen=FROZEN)[1]
    assert_true_weights(_reader(how, model, opt, dtype, tmp_path), masters, how)
    if how != "close":
        assert_true_weights(model.parameters(), masters, f"the model after {how}")
        sd = opt.state_dict()["state"]
        for i, (p, m) in enumerate(zip(model.parameters(), masters)):   # (reload_params reads them)
            assert torch.equal(sd[i].get("master_param", p).float(), m), f"master {i} after {how}"
    opt.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", DELAYED)
def test_resumed_run_is_the_uninterrupted_one(cfg, dtype, tmp_path):
    """A checkpoint saved after an update that did not step two parameters (shown predicted before
    it), then the run resumed from it: bitwise the run that went on (docs/gpu.md)."""
    data = batches(8, dtype=dtype)
    model, opt, _ = ours(dtype, data[:3], state_opts=tier_opts(cfg, tmp_path / "a"),
                         extrapolate=True, frozen={2: {0, 6}})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    offload.save(opt, str(tmp_path / "ckpt"))
    rest = train(model, opt, data[3:])
    opt.synchronize()
    fresh = make_net(dtype)
    fresh.load_state_dict(saved)
    kw = cfg.kwargs(tmp_path / "b", bucket_mb=0.002, delay_updates=1, delay_after=0,
                    delay_extrapolate=True)
    opt2 = offload.AdamW(fresh.parameters(), lr=LR, weight_decay=WD, **kw)
    offload.load(opt2, str(tmp_path / "ckpt"))
    assert train(fresh, opt2, data[3:]) == rest
    opt2.synchronize()
    assert_same_run(model, opt, fresh, opt2)
    opt.close()
    opt2.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", DELAYED)
@pytest.mark.parametrize("which", ["all", "one"])
def test_state_deleted_while_an_update_is_pending(which, cfg, dtype, tmp_path):
    """``opt.state.clear()`` / ``del opt.state[p]`` between backward and step(): the pending update
    is completed first, so a fresh master is the parameter's true weight (round(master) in bf16),
    never the prediction on the device nor a copy still landing."""
    data = batches(7, dtype=dtype)
    idx = list(range(8)) if which == "all" else [6]

    def delete(t, model, opt):
        if t == 4:
            if which == "all":
                opt.state.clear()
            else:
                del opt.state[list(model.parameters())[6]]
    model, opt, losses = ours(dtype, data, state_opts=tier_opts(cfg, tmp_path), extrapolate=True,
                              between=delete)
    ref = reference("offload", dtype, data, extrapolate=True, clear={4: idx},
                    opt_kw=moment_opts(cfg))
    assert losses == ref[0]
    assert_matches(model, opt, ref)
    check_device(opt)   # (no copy read a parameter while another wrote it)
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extrapolate", [True, False])
def test_parameter_written_while_an_update_is_pending_is_refused(extrapolate, dtype):
    """A parameter written in place between step() and the next one (without ``synchronize()``)
    was written over the weights the forward saw, not over the masters: step() refuses it by name,
    changing nothing; after ``synchronize()`` the run goes on as the rule says."""
    data = batches(6, dtype=dtype)

    def write(t, model, opt):
        if t == 3:
            with torch.no_grad():
                model.c.weight.add_(0)   # moves its version counter, not its values
            with pytest.raises(RuntimeError, match="parameter 6 of group 0 was written .*pending"):
                opt.step()
            opt.synchronize()
    model, opt, losses = ours(dtype, data, extrapolate=extrapolate, between=write)
    ref = reference("offload", dtype, data, extrapolate=extrapolate, sync={3})
    assert losses == ref[0]
    assert_matches(model, opt, ref)
    check_device(opt)
    opt.close()
