"""The combination matrix: {host, CpuDevice, FakeDevice} parameters x {ram, nvme, mmap} state.

Every combination must give bitwise the results of host parameters with RAM state (the kernel is
elementwise and partition-independent), through fp32 and bf16 steps, several param groups
(amsgrad, maximize, weight decay), a parameter without gradient, state_dict round trips through
torch.optim.AdamW, offload.save/load resume and add_param_group. FakeDevice runs with a staging
ring of 1-2 slots and random copy delays, with its hazard checks on. Tensors are tiny.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import offload
from conftest import configs
from offload import testing
from offload.device import CpuDevice, FakeDevice

SIZES = [(700,), (33, 5), (4100,), (3,), (2, 3, 4)]   # 4100: split over buckets under the small budget


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


def make_params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SIZES]


def groups(ps):
    return [{"params": ps[:3], "weight_decay": 0.1},
            {"params": ps[3:], "amsgrad": True, "maximize": True, "lr": 3e-3, "betas": (0.8, 0.9)}]


def make_opt(ps, side, tier, tmp_path, slots=2, seed=1, **kw):
    opts = dict(kw)
    if tier != "ram":
        d = tmp_path / f"state-{side}-{tier}"
        d.mkdir(exist_ok=True)
        opts.update(storage=tier, nvme_dir=d, host_budget=96 * 1024)
    if side != "host":   # the staging ring of device parameters, every tier
        opts["nvme_options"] = {"staging_slots": slots}
    if side == "cpu":
        opts["offload_device"] = CpuDevice()
    elif side == "fake":
        opts["offload_device"] = FakeDevice(max_delay=0.002, seed=seed)
    if side != "host":
        opts["bucket_mb"] = 0.01
    return offload.AdamW(groups(ps), lr=1e-2, **opts)


def grads(ps, step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(ps):
        p.grad = None if (step == 1 and i == 1) else torch.randn(p.shape, generator=g).to(dtype)


def run(ps, opt, steps, dtype, start=0):
    for s in range(start, start + steps):
        grads(ps, s, dtype)
        opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    if getattr(opt, "gpu_offload", False):
        testing.device(opt).check()   # FakeDevice: no copy source was overwritten while in flight


def train_bf16_mlp(model, opt, steps, seed):
    """``steps`` steps of a bf16 MLP taking 70 features on random inputs, then ``opt.synchronize()``."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 70, generator=g).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def reference(dtype, steps=3):
    ps = make_params(dtype)
    opt = offload.AdamW(groups(ps), lr=1e-2)
    run(ps, opt, steps, dtype)
    return ps, opt


def assert_same(ps_a, opt_a, ps_b, opt_b):
    for i, (a, b) in enumerate(zip(ps_a, ps_b)):
        assert torch.equal(a, b), f"parameter {i}: max diff {(a.float() - b.float()).abs().max().item()}"
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert (key in sa[k]) == (key in sb[k]), (k, key)
            if key in sa[k]:
                assert torch.equal(sa[k][key].float(), sb[k][key].float()), (k, key)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", configs(moments=("fp32",), cover="all"))
def test_bitwise_like_the_host_reference(tmp_path, cfg, dtype):
    ref = reference(dtype)
    ps = make_params(dtype)
    opt = make_opt(ps, cfg.side, cfg.tier, tmp_path, slots=1 + (dtype == torch.float32))
    run(ps, opt, 3, dtype)
    assert_same(*ref, ps, opt)
    if cfg.tier != "ram":   # opt.state offers the moments, as views of the state
        sd = opt.state_dict()["state"]
        for i, p in enumerate(ps):
            assert torch.equal(opt.state[p]["exp_avg"], sd[i]["exp_avg"])
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(moments=("fp32",), cover="all"))
def test_state_dict_round_trip_through_torch_and_resume(tmp_path, cfg):
    dtype = torch.float32
    ref = reference(dtype, steps=5)
    ps = make_params(dtype)
    opt = make_opt(ps, cfg.side, cfg.tier, tmp_path)
    run(ps, opt, 2, dtype)
    t = torch.optim.AdamW(groups([p.detach().clone() for p in ps]), lr=1e-2)
    t.load_state_dict(opt.state_dict())   # torch's loader accepts our layout
    sd = t.state_dict()
    opt.close()
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = make_opt(ps2, cfg.side, cfg.tier, tmp_path, seed=7)
    opt2.load_state_dict(sd)              # and ours accepts torch's
    run(ps2, opt2, 3, dtype, start=2)
    assert_same(*ref, ps2, opt2)
    opt2.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(moments=("fp32",), cover="all"))
def test_checkpoint_resume(tmp_path, cfg):
    dtype = torch.bfloat16
    ref = reference(dtype, steps=4)
    ps = make_params(dtype)
    opt = make_opt(ps, cfg.side, cfg.tier, tmp_path)
    run(ps, opt, 2, dtype)
    offload.save(opt, tmp_path / "ckpt")
    opt.close()
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = make_opt(ps2, cfg.side, cfg.tier, tmp_path, seed=3)
    offload.load(opt2, tmp_path / "ckpt")
    run(ps2, opt2, 2, dtype, start=2)
    assert_same(*ref, ps2, opt2)
    opt2.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(moments=("fp32",), cover="all"))
def test_add_param_group(tmp_path, cfg):
    dtype = torch.float32

    def go(ps, opt):
        run(ps[:3], opt, 2, dtype)
        opt.add_param_group({"params": ps[3:], "amsgrad": True, "lr": 3e-3})
        run(ps, opt, 2, dtype, start=2)

    ps_r = make_params(dtype)
    ref = offload.AdamW(ps_r[:3], lr=1e-2)
    go(ps_r, ref)
    ps = make_params(dtype)
    kw = {}
    opt = make_opt(ps, cfg.side, cfg.tier, tmp_path)
    opt.close()   # (make_opt builds two groups; this test wants one, then a second added)
    opts = dict(storage=cfg.tier, nvme_dir=tmp_path / f"state-{cfg.side}-{cfg.tier}", host_budget=96 * 1024, **kw)
    if cfg.tier == "ram":
        opts = {}
    if cfg.side != "host":
        opts.update(offload_device=FakeDevice(seed=2) if cfg.side == "fake" else CpuDevice(), bucket_mb=0.01)
    opt = offload.AdamW(ps[:3], lr=1e-2, **opts)
    go(ps, opt)
    assert_same(ps_r, ref, ps, opt)
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(tiers=("nvme", "ram"), moments=("fp32",), cover="all"))
def test_frozen_params_reserve_no_disk(tmp_path, cfg):
    base = torch.nn.Parameter(torch.randn(1 << 16), requires_grad=False)   # a frozen base: 256 KiB fp32
    lora = torch.nn.Parameter(torch.randn(64))
    opts = dict(storage="nvme", nvme_dir=tmp_path, host_budget=1 << 20) if cfg.tier == "nvme" else {}
    if cfg.side != "host":
        opts.update(offload_device=FakeDevice(seed=4) if cfg.side == "fake" else CpuDevice())
    opt = offload.AdamW([base, lora], **opts)
    assert opt.storage_info()["file_bytes"] == 4096   # one bucket: lora's state only
    lora.grad = torch.randn(64)
    opt.step()
    opt.synchronize()   # device parameters: read outside a forward only after synchronize()
    assert base not in opt.state or not opt.state[base]
    # unfreezing later still works: the state is laid out when the first gradient arrives
    ref_b, ref_l = base.detach().clone(), lora.detach().clone()
    ref = offload.AdamW([torch.nn.Parameter(ref_b), torch.nn.Parameter(ref_l)])
    base.requires_grad_(True)
    for o, (b, l) in ((opt, (base, lora)), (ref, ref.param_groups[0]["params"])):
        b.grad, l.grad = torch.ones_like(b), torch.ones_like(l)
        o.step()
    opt.synchronize()
    assert torch.equal(base, ref.param_groups[0]["params"][0])
    assert opt.storage_info()["file_bytes"] > 2 * 4 * (1 << 16)   # m and v of the base (+ a master on a device)
    opt.close()


_RSS_SCRIPT = textwrap.dedent("""
    import os, resource, sys, torch, offload
    from offload.device import FakeDevice
    torch.set_num_threads(1)
    side, d = sys.argv[1], sys.argv[2]
    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
    n = 40 * 2**20   # bf16: 12 bytes of state per element (master, m, v): ~480 MiB of state
    ps = [torch.nn.Parameter(torch.randn(n // 4).bfloat16()) for _ in range(4)]
    for p in ps:
        p.grad = torch.randn(p.shape).bfloat16()
    offload.AdamW([torch.nn.Parameter(torch.zeros(1))])   # torch's first optimizer imports ~70 MB of modules
    base = anon()
    peak = 0
    kw = dict(offload_device=FakeDevice(max_delay=0.0, poison=False, check=False)) if side == "fake" else {}
    opt = offload.AdamW(ps, storage="nvme", nvme_dir=d, host_budget="32MiB", **kw)
    for _ in range(2):
        opt.step()
        peak = max(peak, anon())
    torch.save(opt.state_dict(), os.path.join(d, "sd.pt"))   # streams from the file
    peak = max(peak, anon())
    print(opt.storage_info()["file_bytes"], peak - base)
""")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("side", ["fake", pytest.param("host", marks=pytest.mark.slow)])
def test_host_memory_bounded_by_budget(tmp_path, side):
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, side, str(tmp_path)], capture_output=True, text=True,
                         timeout=220, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    file_bytes, growth = map(int, out.stdout.split())
    assert file_bytes > 450 * 2**20
    assert growth < (32 + 150) * 2**20, f"anonymous RSS grew by {growth / 2**20:.0f} MiB with a 32 MiB budget"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("tier", ("nvme", "mmap"))
def test_fake_device_clip_scaler_and_slow_copies(tmp_path, tier, slots):
    """Device params + NVMe/mmap state with a 1-2 slot staging ring and slow, random copies (hazard
    checks on): clipping (max_grad_norm= and clip_grad_norm_) and GradScaler's skip of a non-finite
    step give bitwise the host/RAM results."""
    dtype = torch.float32
    ps_r = make_params(dtype)
    ref = offload.AdamW(groups(ps_r), lr=1e-2)
    ps = make_params(dtype)
    dev = FakeDevice(max_delay=0.006, min_delay=0.001, seed=slots)
    opt = offload.AdamW(groups(ps), lr=1e-2, storage=tier, nvme_dir=tmp_path, host_budget=96 * 1024,
                        offload_device=dev, bucket_mb=0.004, max_grad_norm=0.5, check_overflow=True,
                        nvme_options={"staging_slots": slots})
    for s in range(4):
        grads(ps_r, s, dtype)
        grads(ps, s, dtype)
        if s == 2:   # an overflow: check_overflow skips the step (the reference does not step)
            ps[0].grad[0] = float("inf")
            opt.step()
            assert opt.last_step_stats(wait=True)["skipped"]
            continue
        ref.clip_grad_norm_(0.5)
        opt.step()
        ref.step()
        assert opt.last_step_stats(wait=True)["buckets"] > 2 and not opt.last_step_stats()["skipped"]
    # GradScaler: scaled gradients, 1/scale folded into the kernel; a non-finite step is skipped
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))   # (what scaler.scale(loss) does first: create the scale)
    for s in range(4, 7):
        grads(ps_r, s, dtype)
        grads(ps, s, dtype)
        for p in ps:
            p.grad.mul_(2.0 ** 10)
        if s == 5:
            ps[1].grad[0] = float("nan")
        else:
            ref.clip_grad_norm_(0.5)
            ref.step()
        scaler.step(opt)
        scaler.update(2.0 ** 10)   # keep the scale (the reference sees unscaled gradients)
        assert opt.last_step_stats(wait=True)["skipped"] == (s == 5)
    opt.synchronize()
    dev.check()
    assert_same(ps_r, ref, ps, opt)
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(sides=("cpu",), moments=("fp32", "8bit"), cover="all"))
def test_add_param_group_while_the_last_step_is_in_flight(tmp_path, monkeypatch, cfg):
    """add_param_group right after step(), without synchronize(): the CPU worker is still stepping
    (here its first bucket waits between its D2H and its kernel: gradients staged) when the layout,
    the tier and the staging ring grow (the new 5000-element parameter needs bigger slots). The
    result must be the host's, bitwise; it was not: staged gradients were read from the new,
    uninitialized slots (wrong updates, NaN)."""
    from offload.schedule import worker
    stage_then_step = worker.Worker.step_bucket
    staged = threading.Event()

    def slow_step_bucket(self, job, st):
        if not staged.is_set():   # the first bucket: its gradients staged (D2H done), the engine lock free
            staged.set()
            time.sleep(0.1)
        return stage_then_step(self, job, st)

    def go(ps, opt, wait=False):
        for s in range(3):
            if s == 1:
                if wait:
                    assert staged.wait(10)   # the worker is between a D2H and its kernel
                opt.add_param_group({"params": ps[5:], "lr": 3e-3, "maximize": True})
            grads(ps if s else ps[:5], s + 5, torch.float32)
            opt.step()
        if hasattr(opt, "synchronize"):
            opt.synchronize()

    def params():
        big = torch.randn(5000, generator=torch.Generator().manual_seed(9))   # needs bigger staging slots
        return make_params(torch.float32) + [torch.nn.Parameter(big)]

    kw = dict(moments=cfg.moments, moments_min_size=4096)
    ps_r = params()
    ref = offload.AdamW(ps_r[:5], lr=1e-2, **kw)
    go(ps_r, ref)
    monkeypatch.setattr(worker.Worker, "step_bucket", slow_step_bucket)
    ps = params()
    opts = dict(storage=cfg.tier, nvme_dir=tmp_path, host_budget=96 * 1024) if cfg.tier != "ram" else {}
    opt = offload.AdamW(ps[:5], lr=1e-2, offload_device=CpuDevice(), bucket_mb=0.01, **opts, **kw)
    go(ps, opt, wait=True)
    for i, (a, b) in enumerate(zip(ps_r, ps)):
        assert torch.equal(a, b), f"parameter {i}: max diff {(a - b).abs().max().item()}"
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ("model_first", "optimizer_first"))
@pytest.mark.parametrize("cfg", configs(sides=("cpu", "fake"), tiers=("ram", "nvme"), moments=("fp32", "8bit"),
                                        cover="all"))
def test_resume_in_either_order_is_bitwise_the_uninterrupted_run(tmp_path, cfg, order):
    """bf16 device parameters: a fresh model + optimizer, model.load_state_dict and opt.load_state_dict
    of the same checkpoint in either order, continue: bitwise the run that was not interrupted. (The
    parameters before the model's load are the fresh model's: taking them into the loaded masters at
    load time, as one version of the user-write fix did, cost the masters their fp32 precision.)"""
    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(70, 90), torch.nn.Linear(90, 50)).to(torch.bfloat16)
        opts = {}
        if cfg.tier != "ram":
            (tmp_path / f"{seed}").mkdir()
            opts = dict(storage=cfg.tier, nvme_dir=tmp_path / f"{seed}", host_budget=1 << 20)
        dev = CpuDevice() if cfg.side == "cpu" else FakeDevice(max_delay=0.001)
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, moments=cfg.moments, moments_min_size=1024,
                            offload_device=dev, bucket_mb=0.01, **opts)
        return model, opt

    train = train_bf16_mlp
    a, opt_a = make(0)
    train(a, opt_a, 3, 1)
    model_sd, opt_sd = {k: v.clone() for k, v in a.state_dict().items()}, opt_a.state_dict()
    b, opt_b = make(5)
    if order == "model_first":
        b.load_state_dict(model_sd)
        opt_b.load_state_dict(opt_sd)
    else:
        opt_b.load_state_dict(opt_sd)
        b.load_state_dict(model_sd)
    train(a, opt_a, 2, 2)
    train(b, opt_b, 2, 2)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"{name}: max diff {(x.float() - y.float()).abs().max().item()}"
    opt_a.close()
    opt_b.close()
