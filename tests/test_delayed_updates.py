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
import torch.nn as nn

import offload
from offload import testing
from offload.device import CpuDevice, FakeDevice

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)

LR, WD, STEPS = 1e-2, 0.1, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.norm(torch.relu(self.a(x)))))).float().square().mean()


def make_net(dtype):
    torch.manual_seed(0)
    return Net().to(dtype)


def batches(n, accum=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(8, 16, generator=gen).to(dtype) for _ in range(accum)] for _ in range(n)]


def losses_of(model, micro, inf=False, scale=lambda loss: loss):
    out = []
    for k, x in enumerate(micro):
        loss = model(x)
        out.append(loss.item())
        if inf and k == len(micro) - 1:
            loss = loss * float("inf")
        scale(loss).backward()
    return out


def reference(kind, dtype, data, clip=None, inf_step=None, after=0, extrapolate=False):
    """The rule with a plain optimizer: ``model`` holds the weights forward sees, ``master`` the fp32
    masters. An update is exact (the model gets its weights at once) while fewer than ``after`` were
    applied before it (a skipped step is no update), else pending: the next step() gives the model its
    weights, w, or with ``extrapolate`` (when the update before was pending too) w + (w - w_before),
    computed in fp32 from the weights in the parameters' dtype; a skipped step gives them w itself."""
    model = make_net(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = (offload.AdamW(master, lr=LR, weight_decay=WD) if kind == "offload" else
           torch.optim.AdamW(master, lr=LR, weight_decay=WD, foreach=False))
    losses, updates, pending, before = [], 0, None, None
    for t, micro in enumerate(data):
        losses += losses_of(model, micro, inf_step == t)
        if pending is not None:   # step(): the pending update goes up
            with torch.no_grad():
                for p, w, e in zip(model.parameters(), *pending):
                    p.copy_(w if inf_step == t else e)
            pending = None
        held = updates >= after
        if inf_step != t:   # an overflow skips the update (the pending one still lands)
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
            if clip is not None:
                (opt.clip_grad_norm_ if kind == "offload" else
                 lambda c: torch.nn.utils.clip_grad_norm_(master, c))(clip)
            opt.step()
            updates += 1
            new = [m.detach().to(p.dtype, copy=True) for m, p in zip(master, model.parameters())]
            if not held:
                with torch.no_grad():
                    for p, w in zip(model.parameters(), new):
                        p.copy_(w)
            ext = new if not (extrapolate and before) else \
                [(w.float() + (w.float() - b.float())).to(w.dtype) for w, b in zip(new, before)]
            pending, before = ((new, ext), new) if held else (None, None)
        model.zero_grad(set_to_none=True)
    return losses, [m.detach() for m in master], opt


def ours(dtype, data, *, device=None, delay=1, clip=None, inf_step=None, scaler=None, accum_with=None,
         state_opts=None, bucket_mb=0.002, after=0, extrapolate=None):
    model = make_net(dtype)
    if delay:   # (after=None: the default warm-up)
        state_opts = dict(state_opts or {}, **({} if after is None else dict(delay_after=after)),
                          **({} if extrapolate is None else dict(delay_extrapolate=extrapolate)))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, bucket_mb=bucket_mb,
                        offload_device=device or FakeDevice(max_delay=0.002, seed=1), delay_updates=delay,
                        max_grad_norm=clip, check_overflow=inf_step is not None or scaler is not None,
                        **(state_opts or {}))
    losses, scale = [], (scaler.scale if scaler is not None else lambda loss: loss)
    for t, micro in enumerate(data):
        with (opt.no_sync() if accum_with == "no_sync" and len(micro) > 1 else _null()):
            losses += losses_of(model, micro[:-1], scale=scale)
        losses += losses_of(model, micro[-1:], inf_step == t, scale)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return model, opt, losses


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def assert_matches(model, opt, ref, exact=True):
    losses, master, ropt = ref
    opt.synchronize()   # completes the pending update: the device weights are the masters now
    sd, rsd = opt.state_dict()["state"], ropt.state_dict()["state"]
    for i, (p, m) in enumerate(zip(model.parameters(), master)):
        got_m = sd[i]["master_param"] if "master_param" in sd[i] else p.detach()
        for a, b, what in ((got_m, m, "master"), (p.detach(), m.to(p.dtype), "weight"),
                           (sd[i]["exp_avg"], rsd[i]["exp_avg"], "exp_avg"),
                           (sd[i]["exp_avg_sq"], rsd[i]["exp_avg_sq"], "exp_avg_sq")):
            if exact:
                assert torch.equal(a, b), f"param {i} {what}: max diff {(a.float() - b.float()).abs().max()}"
            else:
                torch.testing.assert_close(a.float(), b.float(), atol=2e-5 if what != "weight" or p.dtype ==
                                           torch.float32 else 1e-2, rtol=1e-4)
        assert float(sd[i]["step"]) == float(rsd[i]["step"])


def check_device(opt):
    dev = testing.device(opt)
    if isinstance(dev, FakeDevice):
        dev.check()


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
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
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
