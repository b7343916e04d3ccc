"""test_gpu_overlap.py: GPU-offload pipeline (fake device, offload/device/fake.py): the overlap is real and
safe: races with uneven buckets and random delays, hazards the fake device detects, buckets stepped
during backward, a forward that waits only for the buckets it reads, bookkeeping that stays bounded,
threads that end with the optimizer, and NVMe/mmap state stepped during backward (read-ahead, refusals,
the observed forward order).

Parameters are CPU tensors that the pipeline treats as device tensors: every gradient goes down and
every weight goes up through background "streams" with random delays, and the fake device poisons copy
destinations and checks copy sources, so an ordering bug shows up as NaNs or as a recorded hazard.
"""
import time

import pytest
import torch
import torch.nn as nn

import offload
from offload.bench.gpt import random_batch
from offload.device import FakeDevice
from offload.testing import bookkeeping_sizes, device, trace_spans
from tiny_models import slow_backward
from conftest import patch_kernels
from pipeline_util import HeldUploads, CFG, _trace_spans, assert_same, cpu_mode, make_net, ours, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


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
def test_worker_steps_staged_buckets_while_an_upload_is_held(monkeypatch):
    """A bucket whose staging slot still uploads an earlier bucket's weights waits; the buckets already
    staged are stepped meanwhile (the worker does not block on the slot first)."""
    kernels = []
    patch_kernels(monkeypatch, lambda real: lambda *a, **k: (kernels.append(1), real(*a, **k))[1])

    def run(dev):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=dev, bucket_mb=0.001,
                            nvme_options={"staging_slots": 2})
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        for step in range(3):
            if step == 2 and isinstance(dev, HeldUploads):
                opt.synchronize()   # the last step's uploads landed: only this step's are held
                dev.gate.clear()
            kernels.clear()
            model(x).square().mean().backward()
            if step == 2 and isinstance(dev, HeldUploads):
                deadline = time.perf_counter() + 10
                while len(kernels) < 2 and time.perf_counter() < deadline:
                    time.sleep(0.01)
                time.sleep(0.1)
                held = len(kernels)
                dev.gate.set()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        out = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return out, (held if isinstance(dev, HeldUploads) else None)

    ref, _ = run(FakeDevice(max_delay=0.0))
    got, held = run(HeldUploads(max_delay=0.0))
    assert held == 2, f"{held} bucket(s) stepped while the first upload was held, 2 staged"
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


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
