"""test_gpu_results.py: GPU-offload pipeline (fake device, offload/device/fake.py): results against
torch.optim.AdamW (fp32), the CPU mode of offload.AdamW (bitwise, same kernel) and between the schedules;
gradient accumulation, release_grads, clipping and grad multipliers, overflow steps and GradScaler, the
state_dict round trip with torch, parameters small enough to be stepped on the device, Adam with L2
and amsgrad, the synchronous CPU device.

Parameters are CPU tensors that the pipeline treats as device tensors: every gradient goes down and
every weight goes up through background "streams" with random delays, and the fake device poisons copy
destinations and checks copy sources, so an ordering bug shows up as NaNs or as a recorded hazard.
"""
import pytest
import torch

import offload
from offload.bench.gpt import param_groups, random_batch
from offload.device import FakeDevice
from offload.testing import device, device_schedule
from conftest import SCHEDULES, configs
from pipeline_util import CFG, FAKE, LR, SCHED, assert_same, cpu_mode, make_net, ours, torch_ref, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


# ------------------------------------------------------------------------------------ results
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(schedules=SCHEDULES, **FAKE))
def test_fp32_matches_torch_and_cpu_mode(cfg):
    got = train(ours(**cfg.schedule_kw))
    assert_same(got, train(cpu_mode))                      # same kernel: bitwise
    assert_same(got, train(torch_ref), exact=False)        # torch's AdamW: rounding only


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(schedules=SCHEDULES, **FAKE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_cpu_mode_bitwise(cfg, dtype):
    got = train(ours(**cfg.schedule_kw), dtype=dtype)
    assert_same(got, train(cpu_mode, dtype=dtype))
    assert "master_param" in next(iter(got[1].state_dict()["state"].values()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(schedules=SCHEDULES, **FAKE))
def test_grad_accumulation_with_no_sync(cfg):
    got = train(ours(**cfg.schedule_kw), accum=3)
    assert_same(got, train(cpu_mode, accum=3))
    assert_same(got, train(torch_ref, accum=3), exact=False)


@pytest.mark.timeout(60)
def test_accumulation_boundary_flag_equals_no_sync():
    def factory(model):
        opt = ours(**SCHED["eager"])(model)
        return opt
    model = make_net(torch.float32)
    opt = factory(model)
    gen = torch.Generator().manual_seed(123)
    for it in range(3):
        opt.set_accumulation_boundary(False)
        for micro in range(3):
            if micro == 2:
                opt.set_accumulation_boundary(True)
            idx, tgt = random_batch(CFG, 2, "cpu", gen)
            model(idx, tgt, use_aux=(it % 2 == 0)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert_same((model, opt), train(cpu_mode, steps=3, accum=3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(schedules=("deferred", "sync"), **FAKE))
def test_second_backward_without_no_sync_accumulates(cfg):
    assert_same(train(ours(**cfg.schedule_kw), two_backwards=True), train(cpu_mode, two_backwards=True))


@pytest.mark.timeout(60)
def test_second_backward_in_eager_mode_raises():
    with pytest.raises(RuntimeError, match="no_sync"):
        train(ours(**SCHED["eager"], bucket_mb=100), two_backwards=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(schedules=SCHEDULES, **FAKE))
def test_release_grads(cfg):
    model = make_net(torch.float32)
    opt = ours(release_grads=True, **cfg.schedule_kw)(model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(1))
    model(idx, tgt, use_aux=True).backward()
    if cfg.schedule == "eager":   # released as soon as copied (deferred: in step(), the staging ring is a few buckets)
        assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert_same(train(ours(release_grads=True, **cfg.schedule_kw)), train(cpu_mode))


# ------------------------------------------------------------------------------------ clipping
@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
def test_max_grad_norm_matches_torch_clipping(overlap):
    got = train(ours(overlap=overlap, max_grad_norm=0.05))
    assert not device_schedule(got[1]).eager
    ref = train(torch_ref, torch_clip=0.05)
    assert_same(got, ref, exact=False, atol=1e-5, rtol=1e-4)
    unclipped = train(torch_ref)
    assert not torch.allclose(ref[0].gpt.wte.weight, unclipped[0].gpt.wte.weight, atol=1e-4)  # clipping was active


@pytest.mark.timeout(60)
def test_clip_grad_norm_method_returns_total_norm_and_clips():
    model = make_net(torch.float32)
    opt = ours(step_during_backward=False)(model)
    ref_model = make_net(torch.float32)
    ref = torch_ref(ref_model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    for m in (model, ref_model):
        m(idx, tgt, use_aux=True).backward()
    n1 = opt.clip_grad_norm_(0.05)
    n2 = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    torch.testing.assert_close(n1, n2, rtol=1e-5, atol=0)
    opt.step()
    ref.step()
    opt.synchronize()
    assert_same((model, opt), (ref_model, ref), exact=False)


@pytest.mark.timeout(60)
def test_torch_clip_on_device_grads_is_seen_in_deferred_mode():
    # torch.nn.utils.clip_grad_norm_ rescales the device gradients after they were sent: recopied
    got = train(ours(step_during_backward=False), torch_clip=0.05)
    assert_same(got, train(torch_ref, torch_clip=0.05), exact=False, atol=1e-5, rtol=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(schedules=("deferred", "sync"), **FAKE))
def test_step_grad_multiplier(cfg):
    def run(factory):
        model = make_net(torch.float32)
        opt = factory(model)
        gen = torch.Generator().manual_seed(4)
        for it in range(3):
            idx, tgt = random_batch(CFG, 2, "cpu", gen)
            (model(idx, tgt, use_aux=True) * 8.0).backward()
            opt.step(grad_multiplier=0.125)
            opt.zero_grad()
        opt.synchronize()
        return model, opt
    assert_same(run(ours(**cfg.schedule_kw)), run(cpu_mode))


def _after_one_backward():
    """An offload optimizer in the default (eager) mode whose model has just run one backward."""
    model = make_net(torch.float32)
    opt = ours()(model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    model(idx, tgt, use_aux=True).backward()
    return model, opt


@pytest.mark.timeout(60)
def test_eager_mode_refuses_grad_multiplier():
    model, opt = _after_one_backward()
    with pytest.raises(RuntimeError, match="step_during_backward=False"):
        opt.step(grad_multiplier=0.5)


@pytest.mark.timeout(60)
def test_eager_mode_refuses_late_clipping():
    model, opt = _after_one_backward()
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        opt.clip_grad_norm_(1.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed after they were sent"):
        opt.step()


# ------------------------------------------------------------------------------------ overflow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overflow_step_is_skipped_exactly(overlap, dtype):
    got = train(ours(overlap=overlap, check_overflow=True), dtype=dtype, inf_step=3)
    ref = train(cpu_mode, dtype=dtype, inf_step=3)   # the reference never calls step() at step 3
    assert_same(got, ref)
    stats = got[1].last_step_stats(wait=True)
    assert stats is not None and not stats["skipped"]


@pytest.mark.timeout(60)
def test_skipped_step_reports_skipped():
    model = make_net(torch.float32)
    opt = ours(check_overflow=True)(model)
    before = [p.detach().clone() for p in model.parameters()]
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    (model(idx, tgt, use_aux=True) * float("inf")).backward()
    opt.step()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state_dict()["state"] == {}
    assert opt.last_step_stats(wait=True)["skipped"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_grad_scaler(explicit_unscale):
    def run(factory):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        model = make_net(torch.float32)
        opt = factory(model)
        gen = torch.Generator().manual_seed(123)
        for it in range(6):
            idx, tgt = random_batch(CFG, 2, "cpu", gen)
            loss = model(idx, tgt, use_aux=(it % 2 == 0))
            if it == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if explicit_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if isinstance(opt, offload.AdamW):
            opt.synchronize()
            device(opt).check()
        return (model, opt), scaler.get_scale()

    got, s1 = run(ours(check_overflow=True))
    ref, s2 = run(torch_ref)
    assert s1 == s2
    assert_same(got, ref, exact=False)


@pytest.mark.timeout(60)
def test_grad_scaler_in_eager_mode_raises():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model = make_net(torch.float32)
    opt = ours()(model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    scaler.scale(model(idx, tgt, use_aux=True)).backward()
    with pytest.raises(RuntimeError, match="check_overflow"):
        scaler.step(opt)


# ------------------------------------------------------------------------------------ state
@pytest.mark.timeout(60)
def test_state_dict_round_trip_with_torch():
    model, opt = train(ours(), steps=3)
    sd = opt.state_dict()
    ref_model = make_net(torch.float32)
    ref_model.load_state_dict(model.state_dict())
    ref = torch_ref(ref_model)
    ref.load_state_dict(sd)
    # and back: a fresh offload optimizer loads torch's state
    model2 = make_net(torch.float32)
    model2.load_state_dict(model.state_dict())
    opt2 = ours()(model2)
    opt2.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(9)
    _train_alike((model2, opt2), (ref_model, ref), [random_batch(CFG, 2, "cpu", gen) for _ in range(2)])


def _train_alike(ours_pair, ref_pair, batches):
    """A training step of each (model, optimizer) pair on every batch, then their weights and state
    compared (after offload's device work has drained)."""
    for idx, tgt in batches:
        for m, o in (ours_pair, ref_pair):
            m(idx, tgt, use_aux=True).backward()
            o.step()
            o.zero_grad()
    ours_pair[1].synchronize()
    assert_same(ours_pair, ref_pair, exact=False)


# ------------------------------------------------------------------------------------ small params
@pytest.mark.timeout(60)
@pytest.mark.parametrize("opts", [dict(), dict(max_grad_norm=0.05), dict(check_overflow=True, overlap=False)])
def test_small_params_stepped_on_device(opts):
    clip = opts.get("max_grad_norm")
    inf = 3 if opts.get("check_overflow") else None
    got = train(ours(small_param_numel=128, **opts), torch_clip=None, inf_step=inf)
    small = [p for p in got[0].parameters() if p.numel() <= 128]
    assert small and len(small) < len(list(got[0].parameters()))
    # small parameters reserve no host state: exactly their fp32 master + moments less than without them
    full = ours(**opts)(make_net(torch.float32)).storage_info()["file_bytes"]
    assert got[1].storage_info()["file_bytes"] <= full - 3 * 4 * sum(p.numel() for p in small)
    for p in small:   # their state is torch's, in the parameter dtype, no master
        assert "master_param" not in got[1].state[p] and got[1].state[p]["exp_avg"].dtype == p.dtype
    ref = train(torch_ref, torch_clip=clip, inf_step=inf)
    assert_same(got, ref, exact=False, atol=1e-5, rtol=1e-4)   # state of small params included


@pytest.mark.timeout(60)
def test_small_params_state_dict_round_trip():
    model, opt = train(ours(small_param_numel=128), steps=2)
    sd = opt.state_dict()
    model2 = make_net(torch.float32)
    model2.load_state_dict(model.state_dict())
    opt2 = ours(small_param_numel=128)(model2)
    opt2.load_state_dict(sd)
    ref_model = make_net(torch.float32)
    ref_model.load_state_dict(model.state_dict())
    ref = torch_ref(ref_model)
    ref.load_state_dict(sd)
    _train_alike((model2, opt2), (ref_model, ref), [random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(3))])


# ------------------------------------------------------------------------------------ variants
@pytest.mark.timeout(60)
def test_cpu_device_synchronous_copies():
    from offload.device import CpuDevice

    def factory(model):
        return offload.AdamW(param_groups(model, 0.1), lr=LR, offload_device=CpuDevice(), bucket_mb=0.004)
    assert_same(train(factory), train(cpu_mode))


@pytest.mark.timeout(60)
def test_adam_l2_and_amsgrad_match_torch():
    def ours_adam(model):
        return offload.Adam(param_groups(model, 0.1), lr=LR, amsgrad=True, offload_device=FakeDevice(seed=3),
                            bucket_mb=0.004)

    def ref_adam(model):
        return torch.optim.Adam(param_groups(model, 0.1), lr=LR, amsgrad=True)
    got = train(ours_adam)
    assert "max_exp_avg_sq" in next(iter(got[1].state_dict()["state"].values()))
    assert_same(got, train(ref_adam), exact=False)
