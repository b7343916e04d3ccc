"""GPU-offload pipeline driven on CPU through the fake device (offload/device.py).

Parameters are CPU tensors that the pipeline treats as device tensors: every gradient goes down
and every weight goes up through background "streams" with random delays, and the fake device
poisons copy destinations and checks copy sources, so an ordering bug shows up as NaNs or as a
recorded hazard. Results are compared with torch.optim.AdamW (fp32), with the CPU mode of
offload.AdamW (bitwise, same kernel) and between the overlapped and non-overlapped schedules.
"""
import contextlib
import tempfile

import pytest
import torch
import torch.nn as nn

import offload
from offload.bench.gpt import GPT, PRESETS, param_groups, random_batch
from offload.device import FakeDevice
from offload.testing import bookkeeping_sizes, device, device_schedule, trace_spans
from conftest import SCHEDULES, Config, configs
from tiny_models import slow_backward

CFG = PRESETS["tiny"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


LR = 1e-2
FAKE = dict(sides=("fake",), tiers=("ram",), moments=("fp32",))   # configs(...) of this file: the schedules vary
SCHED = {c: Config("fake", schedule=c).schedule_kw for c in SCHEDULES}   # schedule -> its constructor options


class Net(nn.Module):
    """Tiny GPT (tied head, norms, biases) plus a layer used only on even steps (no grad otherwise)."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CFG)
        self.aux = nn.Linear(CFG.d_model, CFG.d_model)

    def forward(self, idx, tgt, use_aux):
        loss = self.gpt(idx, tgt)
        if use_aux:
            loss = loss + self.aux(self.gpt.ln_f.weight.detach().float().to(self.aux.weight.dtype)).float().square().mean()
        return loss


def make_net(dtype):
    torch.manual_seed(0)
    return Net().to(dtype)


def ours(dev_seed=0, max_delay=0.002, bucket_mb=0.004, **opts):
    def factory(model):
        dev = FakeDevice(max_delay=max_delay, seed=dev_seed)
        return offload.AdamW(param_groups(model, 0.1), lr=LR, offload_device=dev, bucket_mb=bucket_mb, **opts)
    return factory


def torch_ref(model):
    return torch.optim.AdamW(param_groups(model, 0.1), lr=LR)


def cpu_mode(model):
    return offload.AdamW(param_groups(model, 0.1), lr=LR)


def train(factory, dtype=torch.float32, steps=6, accum=1, torch_clip=None, inf_step=None, scaler=None,
          two_backwards=False, use_no_sync=True, after_step=None, before_step=None):
    model = make_net(dtype)
    opt = factory(model)
    gen = torch.Generator().manual_seed(123)
    for it in range(steps):
        for micro in range(accum):
            last = micro == accum - 1
            ctx = opt.no_sync() if (use_no_sync and not last and hasattr(opt, "no_sync")) else contextlib.nullcontext()
            idx, tgt = random_batch(CFG, 2, "cpu", gen)
            with ctx:
                loss = model(idx, tgt, use_aux=(it % 2 == 0))
                if inf_step == it and last:
                    loss = loss * float("inf")
                if scaler is not None:
                    loss = scaler.scale(loss)
                loss.backward()
                if two_backwards:
                    model(idx, tgt, use_aux=False).backward()
        if before_step is not None:
            before_step(model, opt)
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif inf_step == it and not getattr(opt, "gpu_offload", False):
            pass  # the reference skips the step whose gradients are not finite
        else:
            opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model, opt)
    if isinstance(opt, offload.AdamW):
        opt.synchronize()
        if opt.gpu_offload:
            device(opt).check()
    return model, opt


def assert_same(a, b, exact=True, atol=1e-6, rtol=1e-5, state=True):
    (ma, oa), (mb, ob) = a, b
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.isfinite(pa).all(), name
        if exact:
            assert torch.equal(pa, pb), f"{name}: max diff {(pa.float() - pb.float()).abs().max().item()}"
        else:
            torch.testing.assert_close(pa, pb, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    if not state:
        return
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    assert sa, "no optimizer state to compare"
    for k in sa:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "step"):
            # torch has no master_param; every other key must be on both sides
            if key in sb[k] or (key in sa[k] and key != "master_param"):
                ta = sa[k][key].float()
                tb = sb[k][key].float().to(ta.device)
                if exact:
                    assert torch.equal(ta, tb), f"state {k} {key}"
                else:
                    torch.testing.assert_close(ta, tb, atol=atol, rtol=rtol)


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


@pytest.mark.timeout(60)
def test_eager_mode_refuses_grad_multiplier():
    model = make_net(torch.float32)
    opt = ours()(model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    model(idx, tgt, use_aux=True).backward()
    with pytest.raises(RuntimeError, match="step_during_backward=False"):
        opt.step(grad_multiplier=0.5)


@pytest.mark.timeout(60)
def test_eager_mode_refuses_late_clipping():
    model = make_net(torch.float32)
    opt = ours()(model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    model(idx, tgt, use_aux=True).backward()
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


# ------------------------------------------------------------------------------------ races
@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [0, 1])
def test_race_uneven_buckets_random_delays_many_steps(seed):
    class Uneven(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.a = nn.Linear(3, 5)
            self.b = nn.Linear(5, 400)
            self.c = nn.Linear(400, 3)
            self.d = nn.Linear(3, 3)

        def forward(self, x):
            return self.d(torch.tanh(self.c(torch.relu(self.b(self.a(x)))))).square().mean()

    def run(opts):
        torch.manual_seed(seed)
        model = Uneven().to(torch.bfloat16)
        opt = offload.AdamW(model.parameters(), lr=1e-3, offload_device=FakeDevice(max_delay=0.004, seed=seed),
                            bucket_mb=0.0005, **opts)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(25):
            model(torch.randn(4, 3, generator=gen).to(torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        device(opt).check()
        return model, opt

    sizes = run({})[1].storage_info()["bucket_param_bytes"]
    assert max(sizes) > 50 * min(sizes)
    base = run(dict(overlap=False))
    for opts in (dict(), dict(step_during_backward=False), dict(release_grads=True)):
        assert_same(run(opts), base)


def test_fake_device_detects_hazards():
    dev = FakeDevice(max_delay=0.05)
    src = torch.arange(8, dtype=torch.float32)
    dst = torch.zeros(8)
    ev = dev.copy_to_host([(dst, src)], None)
    assert torch.isnan(dst).all()             # reading before the copy completed gives poison
    src[0] = 100.0                            # overwritten while the copy is in flight
    ev.synchronize()
    with pytest.raises(AssertionError, match="overwritten while in use"):
        dev.check()
    dev.close()


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
    for _ in range(2):
        idx, tgt = random_batch(CFG, 2, "cpu", gen)
        for m, o in ((ref_model, ref), (model2, opt2)):
            m(idx, tgt, use_aux=True).backward()
            o.step()
            o.zero_grad()
    opt2.synchronize()
    assert_same((model2, opt2), (ref_model, ref), exact=False)


# ------------------------------------------------------------------------------------ telemetry / API
@pytest.mark.timeout(60)
def test_stats_and_chrome_trace(tmp_path):
    model, opt = train(ours(trace=True), steps=3)
    st = opt.last_step_stats()
    assert st["step"] == 3 and st["buckets"] == len(opt.storage_info()["bucket_param_bytes"])
    assert st["d2h_bytes"] > 0 and st["h2d_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert st["d2h_s"] > 0 and st["kernel_s"] > 0 and st["h2d_s"] > 0 and st["nvme_s"] == 0
    assert st["exposed_s"] > 0 and st["overlapped"] and not st["skipped"]
    names = {name.split(" ")[0] for name, _, _ in _trace_spans(opt, tmp_path / "t.json")}
    assert {"d2h", "adam", "h2d", "step()"} <= names, names


def test_options_are_validated():
    model = make_net(torch.float32)
    with pytest.raises(TypeError, match="bucket_size"):
        offload.AdamW(model.parameters(), offload_device=FakeDevice(), bucket_size=3)
    with pytest.raises(TypeError, match="only apply to GPU offload"):
        offload.AdamW(model.parameters(), bucket_mb=3)
    with pytest.raises(ValueError, match="step_during_backward"):
        offload.AdamW(model.parameters(), offload_device=FakeDevice(), step_during_backward=True, max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="only available in GPU-offload mode"):
        offload.AdamW(model.parameters()).reload_params()


def test_last_step_stats_in_every_mode(tmp_path):
    """Host params with RAM or NVMe state report the same keys as GPU offload; nvme_s is filled."""
    for kw in ({}, dict(storage="nvme", nvme_dir=tmp_path), dict(storage="mmap", nvme_dir=tmp_path),
               dict(offload_device=FakeDevice(), storage="nvme", nvme_dir=tmp_path), dict(offload_device=FakeDevice()),
               dict(offload_device=FakeDevice(), overlap=False)):
        p = torch.nn.Parameter(torch.randn(5000))
        opt = offload.AdamW([p], **kw)
        assert opt.last_step_stats() is None
        for _ in range(2):
            p.grad = torch.randn(5000)
            opt.step()
        st = opt.last_step_stats(wait=True)
        assert set(st) >= {"step", "d2h_s", "kernel_s", "h2d_s", "nvme_s", "exposed_s", "skipped"}, (kw, st)
        assert st["step"] == 2 and st["kernel_s"] > 0 and not st["skipped"], kw
        if kw.get("storage") == "nvme":
            assert st["nvme_s"] > 0, kw
        opt.close()


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_torch():
    from offload.bench.gpucheck import run_checks
    results = run_checks("cuda", steps=4, quick=True)
    assert results and all(r["ok"] for r in results), results


# ------------------------------------------------------------------------------------ bench / gpu_check
@pytest.mark.timeout(120)
def test_gpu_check_logic_on_fake_device():
    from offload.bench.gpucheck import run_checks
    res = run_checks("fake", steps=3, quick=True)
    assert len(res) == 9 and all(r["ok"] for r in res), res
    assert max(r["rel_diff"] for r in res if r["dtype"] == "float32") < 1e-5


@pytest.mark.timeout(120)
def test_gpu_check_script_without_cuda_exits_cleanly():
    import subprocess
    import sys
    from pathlib import Path
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the script would run the real check")
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and "no CUDA device" in r.stdout


@pytest.mark.timeout(120)
def test_train_bench_runs_on_cpu(tmp_path, capsys):
    import json
    from offload.bench import train
    out = tmp_path / "t.json"
    assert train.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--reps", "1", "--warmup", "1",
                       "--bucket-mb", "0.01", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fake device" in text and "offload-overlap" in text
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert res["offload-overlap"]["iter_s"] > 0 and res["offload-sync"]["exposed_s"] is not None
    assert "offload-nvme" not in res   # only with --state nvme|mmap
    assert train.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--reps", "1", "--warmup", "1",
                       "--bucket-mb", "0.01", "--state", "nvme", "--nvme-dir", str(tmp_path), "--host-budget", "1MiB",
                       "--variants", "offload-nvme", "--json", str(out)]) == 0
    nv = json.loads(out.read_text())["results"][0]
    assert nv["variant"] == "offload-nvme" and nv["bound"] > 0 and nv["io_s"] > 0 and nv["host_bytes"] <= 2**20
    assert "target <= 1.15" in capsys.readouterr().out


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
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(3))
    for m, o in ((model2, opt2), (ref_model, ref)):
        m(idx, tgt, use_aux=True).backward()
        o.step()
        o.zero_grad()
    opt2.synchronize()
    assert_same((model2, opt2), (ref_model, ref), exact=False)


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


@pytest.mark.timeout(60)
def test_worker_failure_surfaces_instead_of_hanging(monkeypatch):
    from offload.step import bucket
    model = make_net(torch.float32)
    opt = ours()(model)
    def boom(*a, **k):
        raise ValueError("injected kernel failure")
    monkeypatch.setattr(bucket, "step_table", boom)  # the kernel call of the worker's bucket body
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        model(idx, tgt, use_aux=True).backward()
        opt.step()
        model(idx, tgt, use_aux=True)   # the next forward waits for uploads: must raise, not hang
        opt.synchronize()


# ------------------------------------------------------------------------------------ overlap is real
class _Deep(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x):
        x = slow_backward(self.layers[0](x), 0.15)   # the early layers' backward takes long
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _trace_spans(opt, path):
    import json
    opt.export_chrome_trace(str(path))
    ev = json.loads(path.read_text())["traceEvents"]
    return [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X"]


@pytest.mark.timeout(60)
def test_buckets_are_stepped_during_backward(tmp_path):
    model = _Deep()
    opt = offload.AdamW(model.parameters(), lr=1e-3, offload_device=FakeDevice(max_delay=0.0, seed=0),
                        bucket_mb=0.02, trace=True)
    assert len(opt.storage_info()["bucket_param_bytes"]) >= 4
    model(torch.randn(8, 64)).backward()
    opt.step()
    opt.synchronize()
    spans = _trace_spans(opt, tmp_path / "t.json")
    t_step = next(a for name, a, _ in spans if name.startswith("step()"))
    # the last layers' buckets were stepped while the first layer's backward was still running
    assert sum(a < t_step for name, a, _ in spans if name.startswith("adam")) >= 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opts", [dict(step_during_backward=False), dict(max_grad_norm=1e3),
                                  dict(check_overflow=True, storage="nvme", host_budget=256 * 1024)])
def test_forward_waits_only_for_the_buckets_it_reads(opts, tmp_path):
    """step() returns while uploads are in flight; a module's forward waits (in upload order) for the
    buckets holding its parameters, the later buckets keep uploading. Without that wait the first
    layer would read the fake device's poison (NaN) of an upload not done yet."""
    model = _Deep()
    dev = FakeDevice(max_delay=0.0, seed=0)
    if opts.get("storage") == "nvme":
        opts = dict(opts, nvme_dir=tmp_path)
    opt = offload.AdamW(model.parameters(), lr=1e-3, offload_device=dev, bucket_mb=0.02, **opts)
    x = torch.randn(8, 64)
    model(x).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    dev.min_delay, dev.max_delay = 0.03, 0.05   # every copy 30-50 ms: the last buckets are surely in flight
    model(x).backward()
    opt.step()
    out = model.layers[0](x)                 # needs only the first bucket(s)
    first, last = model.layers[0].weight.clone(), model.layers[-1].weight.clone()
    assert torch.isfinite(out).all() and torch.isfinite(first).all()
    assert torch.isfinite(model(x)).all()    # every module waited for its own buckets
    opt.synchronize()
    assert torch.equal(first, model.layers[0].weight)      # the first layer had its new weights
    assert not torch.equal(last, model.layers[-1].weight)  # the last one was still uploading (old or poison)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    dev.check()


@pytest.mark.timeout(60)
def test_bookkeeping_stays_bounded_without_reading_stats():
    model, opt = train(ours(), steps=12)
    kept = bookkeeping_sizes(opt)
    assert kept["copy_events"] <= 4 * len(opt.storage_info()["bucket_param_bytes"])
    assert kept["step_records"] <= 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", configs(schedules=("eager", "sync"), **FAKE))
def test_parameters_written_after_construction_are_picked_up(dtype, cfg):
    # e.g. model.load_state_dict(pretrained) after the optimizer was built
    torch.manual_seed(7)
    pretrained = Net().to(dtype).state_dict()

    def factory_then_load(opts):
        def factory(model):
            opt = ours(**opts)(model)
            model.load_state_dict(pretrained)
            return opt
        return factory

    def load_then_cpu(model):
        model.load_state_dict(pretrained)
        return cpu_mode(model)
    got = train(factory_then_load(cfg.schedule_kw), dtype=dtype, steps=3)
    assert_same(got, train(load_then_cpu, dtype=dtype, steps=3))


def _write_through_data(partial, steps, visible=False):
    """Weight decay by hand / weight clipping as users write it, after synchronize() (docs/gpu.md),
    between steps (not after the last: a master that no step adopted yet is compared too).
    ``visible``: through the parameter instead of p.data (its version counter moves)."""
    done = []

    def write(model, opt):
        done.append(1)
        if len(done) == steps:
            return
        if isinstance(opt, offload.AdamW):
            opt.synchronize()
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                t = p if visible else p.data
                if partial and k % 2:
                    t.clamp_(-0.05, 0.05)   # changes some elements only
                else:
                    t.mul_(0.99)
    return write


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype,partial", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                           (torch.bfloat16, True)])
@pytest.mark.parametrize("cfg", configs(schedules=SCHEDULES, **FAKE))
def test_writes_through_data_after_synchronize_are_kept(cfg, dtype, partial):
    # p.data.mul_() moves no version counter: before the device fingerprints the next step overwrote
    # it with round(master) (a reverted write); torch's AdamW and the host path keep it
    # 5 steps: the layer used on even steps only is stepped last, so its master adopted the writes on
    # both sides (the host path adopts at the parameter's next step, the device path at the next backward)
    def write():
        return _write_through_data(partial, steps=5)
    got = train(ours(**cfg.schedule_kw), dtype=dtype, steps=5, after_step=write())
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, after_step=write()))
    if dtype == torch.float32:
        assert_same(got, train(torch_ref, steps=5, after_step=write()), exact=False)


def _write_then(then, steps, visible):
    """A write after synchronize() (_write_through_data), then ``then(opt)``: calls that synchronize
    or reload internally must not make the write look like our own weights."""
    write = _write_through_data(False, steps, visible)

    def after(model, opt):
        write(model, opt)
        then(opt)
    return after


def _sd_round_trip(opt):
    opt.load_state_dict(opt.state_dict())


def _save_load(opt):
    d = tempfile.mkdtemp(prefix="offload-wt-")
    offload.save(opt, d)
    offload.load(opt, d)


def _add_group(opt):
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(300))], "lr": 1e-3})


@pytest.mark.timeout(90)
@pytest.mark.parametrize("then", [lambda opt: opt.synchronize(), lambda opt: opt.state_dict(), _sd_round_trip,
                                  _save_load, _add_group],
                         ids=["synchronize", "state_dict", "load_state_dict", "save_load", "add_param_group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("visible", [False, True], ids=["p.data", "p"])
def test_writes_survive_later_synchronizing_calls(dtype, then, visible):
    # a second synchronize() (or state_dict(), offload.save, load_state_dict, which synchronize) used
    # to take new fingerprints that included the write, and add_param_group / load_state_dict
    # restarted the version tracking: the next upload then reverted the write
    got = train(ours(**SCHED["eager"]), dtype=dtype, steps=5, after_step=_write_then(then, 5, visible))
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, after_step=_write_then(then, 5, visible)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_schedule_keeps_writes_made_between_backward_and_step(dtype):
    # deferred: nothing is stepped before step(), so a write after synchronize() that follows
    # backward must be what step() updates, as with torch (the eager schedule has stepped by then)
    def write():
        return _write_through_data(True, steps=5)
    got = train(ours(**SCHED["deferred"]), dtype=dtype, steps=5, before_step=write())
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, before_step=write()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_schedule_keeps_writes_through_the_parameter_between_backward_and_step(dtype):
    # a write that moves the version counter (no synchronize() needed: backward uploads nothing in
    # the deferred schedule) must be what step() updates too
    def write(model, opt):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.99)
    # 5 steps: the layer used on even steps only is stepped last, so both sides adopted the writes
    got = train(ours(**SCHED["deferred"]), dtype=dtype, steps=5, before_step=write)
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, before_step=write))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native", [True, False])   # CPU tensors: native; a GPU's: torch's ops (forced here)
def test_fingerprints_see_every_kind_of_change(native):
    from offload.params.fingerprint import fingerprints
    torch.manual_seed(0)
    ts = [torch.randn(1000), torch.randn(77).bfloat16(), torch.randn(3, 5).half(), torch.randn((1 << 22) + 9)]
    base = fingerprints(ts, native=native)
    assert torch.equal(fingerprints(ts, native=native), base)             # deterministic

    def changed(k, edit):
        t = ts[k].clone()
        edit(t)
        return bool(torch.ne(fingerprints(ts[:k] + [t] + ts[k + 1:], native=native), base)[k])
    assert changed(0, lambda t: t.__setitem__(3, t[3] * (1 + 2 ** -23)))            # one ulp of one element
    assert changed(0, lambda t: t.__setitem__(slice(1, 3), t[[2, 1]]))              # two elements swapped
    assert changed(1, lambda t: t.neg_())
    assert changed(2, lambda t: t.__setitem__((2, 4), float("nan")))
    assert changed(3, lambda t: t.__setitem__(-1, t[-1] + 1))                       # the last chunk's tail
    assert changed(3, lambda t: t.__setitem__((1 << 22) + 1, t[1]))                 # copied across chunks
    assert not changed(0, lambda t: None)
    assert changed(1, lambda t: t.__setitem__(76, -t[76]))                          # an odd-length tail element


@pytest.mark.timeout(120)
@pytest.mark.parametrize("native", [True, False])
def test_fingerprints_see_uniform_scalings(native):
    # p.data.mul_(0.5) changes every element's bits by the same amount. With products wrapped mod
    # 2^32 the change of the sum was (wrap carries) * 2^32 minus a constant: it cancelled for 10 of
    # 300 random 1024-element tensors, and a halving write was silently reverted (found by
    # tests/test_differential.py seed 1256).
    from offload.params.fingerprint import fingerprints
    g = torch.Generator().manual_seed(0)
    for n in (1024, 2048, 4096, 8192):
        for dtype in (torch.float32, torch.bfloat16):
            ts = [torch.randn(n, generator=g).to(dtype) for _ in range(60)]
            base = fingerprints(ts, native=native)
            for factor in (0.5, 2.0, 0.25):
                got = fingerprints([t * factor for t in ts], native=native)
                same = torch.eq(got, base).nonzero().flatten().tolist()
                assert not same, f"{n} x {dtype}, * {factor}: fingerprint unchanged for tensors {same}"


@pytest.mark.timeout(60)
def test_threads_end_when_optimizer_and_model_are_gone():
    import gc
    import threading

    def names():
        return sum(t.name.startswith(("offload-cpu-step", "offload-fake")) for t in threading.enumerate())
    gc.collect()
    before = names()
    train(ours(), steps=2)
    gc.collect()
    deadline = __import__("time").time() + 10
    while names() > before and __import__("time").time() < deadline:
        __import__("time").sleep(0.05)
    assert names() <= before


# ------------------------------------------------------------------ NVMe/mmap state, stepped during backward
def _tiered(tmp_path, tier="nvme", slots=1, **opts):
    d = tmp_path / f"state-{tier}-{slots}"
    d.mkdir(exist_ok=True)
    return ours(storage=tier, nvme_dir=d, host_budget=64 * 1024, nvme_options={"staging_slots": slots},
                max_delay=0.003, **opts)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tier,slots,dtype,case", [
    ("nvme", 1, torch.float32, "plain"), ("nvme", 2, torch.bfloat16, "plain"), ("mmap", 1, torch.float16, "plain"),
    ("nvme", 2, torch.float32, "release_grads"), ("nvme", 1, torch.bfloat16, "no_sync")])
def test_tiered_state_steps_during_backward_bitwise(tmp_path, tier, slots, dtype, case):
    """Device params + NVMe/mmap state in the default schedule: buckets are stepped during backward
    through a 1-2 slot staging ring with random copy delays (hazard checks on): bitwise the host/RAM
    results, with release_grads and with no_sync accumulation too."""
    accum = 3 if case == "no_sync" else 1
    opts = dict(release_grads=True) if case == "release_grads" else {}
    got = train(_tiered(tmp_path, tier, slots, **opts), dtype=dtype, steps=4, accum=accum)
    assert got[1].steps_during_backward
    assert_same(got, train(cpu_mode, dtype=dtype, steps=4, accum=accum))
    st = got[1].last_step_stats()
    assert st["overlapped"] and st["buckets"] > 2 and st["d2h_bytes"] > 0 and "nvme_s" in st
    got[1].close()


class _Reversed(nn.Module):
    """Layers registered in the reverse of their use: backward reaches them in registration order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        x = slow_backward(self.layers[-1](x), 0.15)   # the last bucket to arrive waits in backward
        for layer in reversed(self.layers[:-1]):
            x = torch.tanh(layer(x))
        return x.square().mean()


@pytest.mark.timeout(90)
def test_nvme_read_ahead_learns_the_backward_order(tmp_path):
    """A guessed order that is wrong costs on-demand reads, never a wrong result; after one observed
    backward the state is read ahead in that order (no demand read) and buckets are stepped while
    backward still runs."""
    import time

    def make(side):
        model = _Reversed()
        kw = dict(lr=1e-3)
        if side == "nvme":
            kw.update(offload_device=FakeDevice(max_delay=0.001, seed=3), bucket_mb=0.005, storage="nvme",
                      nvme_dir=tmp_path, host_budget=96 * 1024, trace=True)
        return model, offload.AdamW(model.parameters(), **kw)
    (m_ref, o_ref), (model, opt) = make("host"), make("nvme")
    info = opt.storage_info
    assert info()["buckets"] >= 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    demand = []
    for it in range(4):
        for m, o in ((m_ref, o_ref), (model, opt)):
            if it == 0:   # gradients set by hand: the buckets go in the guessed (reverse layout) order
                for p in m.parameters():
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
            else:
                t0 = time.perf_counter()
                m(x).backward()
            t = time.perf_counter()
            o.step()
            o.zero_grad()
        demand.append(info()["demand_reads"])
        spans = [a for _, lane, a, _ in trace_spans(opt) if lane == "cpu step" and it and a > t0]
        if it >= 2:
            assert sum(a < t for a in spans) >= 2, "no bucket was stepped during backward"
    assert demand[1] > demand[0] == 0      # backward in registration order: the reverse guess missed
    assert demand[3] == demand[2] == demand[1], demand   # learned: every bucket read ahead
    opt.synchronize()
    device(opt).check()
    for a, b in zip(m_ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


@pytest.mark.timeout(60)
def test_tiered_state_during_backward_refusals(tmp_path):
    """What needs every gradient before any bucket is stepped is refused by name, as with RAM state."""
    model = make_net(torch.float32)
    opt = _tiered(tmp_path)(model)
    idx, tgt = random_batch(CFG, 2, "cpu", torch.Generator().manual_seed(1))
    model(idx, tgt, use_aux=True).backward()
    with pytest.raises(RuntimeError, match="clip_grad_norm_ needs every gradient"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="needs step_during_backward=False"):
        opt.step(grad_multiplier=0.5)
    opt.close()
    model = make_net(torch.float32)
    opt = _tiered(tmp_path)(model)
    model(idx, tgt, use_aux=True).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)   # changes gradients already stepped
    with pytest.raises(RuntimeError, match="gradients changed after they were sent"):
        opt.step()
    with pytest.raises(offload.StoreFailedError):
        opt.state_dict()
    opt.close()
    with pytest.raises(ValueError, match="cannot be combined with max_grad_norm"):
        _tiered(tmp_path, step_during_backward=True, max_grad_norm=1.0)(make_net(torch.float32))
    with pytest.raises(RuntimeError, match="no_sync"):
        train(_tiered(tmp_path, bucket_mb=100), two_backwards=True)


@pytest.mark.timeout(60)
def test_deferred_uploads_follow_the_observed_forward_order():
    """Layers registered in the reverse of their use: from the second step on the uploads go in the order
    the first forward used the buckets, so the first layer to run does not wait for the others."""
    model = _Reversed()
    dev = FakeDevice(max_delay=0.0, seed=0)
    opt = offload.AdamW(model.parameters(), lr=1e-3, offload_device=dev, bucket_mb=0.004, max_grad_norm=1e3)
    x = torch.randn(4, 32)
    model(x).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    dev.min_delay, dev.max_delay = 0.03, 0.05
    model(x).backward()
    opt.step()
    model.layers[-1](x)   # the first layer of the forward
    first, last = model.layers[-1].weight.clone(), model.layers[0].weight.clone()
    opt.synchronize()
    assert torch.equal(first, model.layers[-1].weight) and not torch.equal(last, model.layers[0].weight)
    dev.check()
