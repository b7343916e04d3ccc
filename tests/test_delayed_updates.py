"""tests/test_delayed_updates.py: ``delay_updates=1`` (offload/schedule/delayed.py) against a plain reference of its rule.

The rule (docs/gpu.md): the forward and backward of iteration t see every update but the one still
pending, so with w_t the master weights after update t, w_t = AdamW(w_{t-1}, g_t) and g_t is computed
on w_{t-1} for t <= delay_after + 1 (the first delay_after updates are exact), on w_{t-2} after that.
``reference`` writes that rule out with a plain optimizer over fp32 masters:
with offload's host (CPU-mode) AdamW, the same kernel, the device run must match bitwise (losses of
every iteration, weights, moments); with ``torch.optim.AdamW`` it matches to rounding (the two kernels
differ in the last bit). The parameters are on a FakeDevice (random copy delays, NaN poison, hazard
checks) or a CpuDevice; several buckets, so the pipeline's per-bucket order matters.
"""
import math

import pytest
import torch

import offload
from delayed_util import (LR, STEPS, WD, assert_matches, assert_same_run, batches, check_device,
                          losses_of, make_net, ours, reference)
from offload.device import CpuDevice, FakeDevice

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


# ------------------------------------------------------------------------------------ the rule
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,where", [(torch.float32, "ram"), (torch.bfloat16, "ram"), (torch.float32, "nvme"),
                                         (torch.float32, "cpu-device")])
def test_matches_the_reference_rule(dtype, where, tmp_path):
    data = batches(STEPS, dtype=dtype)
    state_opts = dict(storage="nvme", nvme_dir=str(tmp_path), host_budget="1MiB") if where == "nvme" else None
    model, opt, losses = ours(dtype, data, state_opts=state_opts,
                              device=CpuDevice() if where == "cpu-device" else None)
    ref = reference("offload", dtype, data)
    assert losses == ref[0]   # every forward saw the rule's weights, bitwise
    assert_matches(model, opt, ref)
    assert_matches(model, opt, reference("torch", dtype, data), exact=False)
    check_device(opt)
    exact = ours(dtype, data, delay=0)[2]
    assert exact[:1] == losses[:1] and exact[1] != losses[1]   # the second forward: w_1 exact, w_0 delayed
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,after,inf_step,ext", [(torch.float32, 2, None, False), (torch.bfloat16, 3, 1, False),
                                                      (torch.float32, 1, None, True), (torch.bfloat16, 1, 3, True)])
def test_exact_warm_up_then_delayed(dtype, after, inf_step, ext):
    """delay_after: the first ``after`` updates exact (a skipped step is no update), then one step of
    delay; delay_extrapolate: the stale forwards on the weights extrapolated."""
    data, clip = batches(STEPS + 2, dtype=dtype), (None if inf_step is None else 0.05)
    model, opt, losses = ours(dtype, data, after=after, clip=clip, inf_step=inf_step, extrapolate=ext)
    ref = reference("offload", dtype, data, clip=clip, inf_step=inf_step, after=after, extrapolate=ext)
    assert losses == ref[0]
    assert_matches(model, opt, ref)
    check_device(opt)
    exact = ours(dtype, data, delay=0, clip=clip, inf_step=inf_step)[2]
    k = after + 1 + (inf_step is not None and inf_step <= after)   # the first forward without the last update
    assert exact[:k] == losses[:k] and exact[k] != losses[k]
    opt.close()


def test_default_warm_up_is_exact():
    data = batches(3)
    assert ours(torch.float32, data, after=None)[2] == ours(torch.float32, data, delay=0)[2]


@pytest.mark.timeout(60)
def test_clipping_and_overflow_skip():
    data = batches(STEPS)
    model, opt, losses = ours(torch.float32, data, clip=0.05, inf_step=3)
    ref = reference("offload", torch.float32, data, clip=0.05, inf_step=3)
    assert losses == ref[0]
    assert_matches(model, opt, ref)
    assert opt.last_step_stats(wait=True)["skipped"] is False
    check_device(opt)


@pytest.mark.timeout(60)
def test_grad_scaler_with_a_skipped_step():
    """Power-of-two loss scales are exact: the scaled run is the reference of the unscaled gradients."""
    data = batches(STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    model, opt, losses = ours(torch.float32, data, inf_step=2, scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 11   # doubled after steps 0-1, halved by step 2, doubled after 3-4
    ref = reference("offload", torch.float32, data, inf_step=2)
    assert [x for x in losses if math.isfinite(x)] == [x for x in ref[0] if math.isfinite(x)]
    assert_matches(model, opt, ref)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["no_sync", "plain"])
def test_gradient_accumulation(how):
    data = batches(4, accum=3)
    model, opt, losses = ours(torch.float32, data, accum_with=how)
    ref = reference("offload", torch.float32, data)
    assert losses == ref[0]
    assert_matches(model, opt, ref)


# ------------------------------------------------------------------------------------ checkpoints, close
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,after", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 4)])
def test_checkpoint_holds_the_pending_update_and_resumes_bitwise(dtype, after, tmp_path):
    """(after=4: saved in the exact warm-up; both runs switch to the delay at the same step)"""
    data = batches(STEPS, dtype=dtype)
    model, opt, _ = ours(dtype, data[:3], after=after)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}   # completes the pending update
    offload.save(opt, str(tmp_path / "ckpt"))
    sd = opt.state_dict()["state"]
    assert all(float(s["step"]) == 3 for s in sd.values())   # update 3 included
    if dtype == torch.bfloat16:   # the weights saved are round(the masters saved): one consistent step
        for i, p in enumerate(saved_model.values()):
            assert torch.equal(p, sd[i]["master_param"].to(dtype))
    # (the uninterrupted run continues from here; its next forward sees update 3, as the resumed one does)
    rest = []
    for micro in data[3:]:
        rest += losses_of(model, micro)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    fresh = make_net(dtype)
    fresh.load_state_dict(saved_model)
    opt2 = offload.AdamW(fresh.parameters(), lr=LR, weight_decay=WD, bucket_mb=0.002,
                         offload_device=FakeDevice(max_delay=0.002, seed=3), delay_updates=1,
                         delay_after=after)
    offload.load(opt2, str(tmp_path / "ckpt"))
    rest2 = []
    for micro in data[3:]:
        rest2 += losses_of(fresh, micro)
        opt2.step()
        opt2.zero_grad()
    opt2.synchronize()
    assert rest == rest2
    assert_same_run(model, opt, fresh, opt2)
    opt.close()
    opt2.close()


@pytest.mark.timeout(60)
def test_close_applies_the_pending_update():
    data = batches(3)
    model, opt, _ = ours(torch.float32, data, device=FakeDevice(max_delay=0.005, seed=2))
    opt.close()   # right after step(): the pending update lands on the device first
    _, master, _ = reference("offload", torch.float32, data)
    for p, m in zip(model.parameters(), master):
        assert torch.equal(p.detach(), m)


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("opts,match", [
    (dict(overlap=False), "overlap"), (dict(step_during_backward=True), "step_during_backward"),
    (dict(small_param_numel=64), "small_param_numel"), (dict(delay_updates=2), "0 \\(exact\\) or 1"),
    (dict(delay_after=-1), "delay_after must be"), (dict(delay_updates=0, delay_after=5), "delay_updates=1 only")])
def test_refused_combinations_name_the_alternative(opts, match):
    kw = dict(delay_updates=1)
    kw.update(opts)
    with pytest.raises(ValueError, match=match):
        offload.AdamW(make_net(torch.float32).parameters(), offload_device=FakeDevice(), **kw)


def test_host_parameters_refuse_it():
    with pytest.raises(TypeError, match="delay_updates"):
        offload.AdamW(make_net(torch.float32).parameters(), delay_updates=1)
