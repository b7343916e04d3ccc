"""Device parameters (GPU-offload mode, through CpuDevice / FakeDevice): writes that would race with
the CPU worker are errors, not silently lost or used, and the gradients torch accepts give torch's
answer or a named error.

step() returns while the worker still copies gradients down (D2H). A write into p.grad after
step() and before that copy finished (``p.grad.zero_()``, ``model.zero_grad(set_to_none=False)``,
a refilled persistent gradient buffer) used to be stepped silently with the new values; the worker
now compares each gradient's version counter before issuing its copy and after it finished.
Contiguous gradient views (slices of one flat bucket) are copied as they are; non-contiguous
gradients are refused by name (as on the host path); the overlap check reaches as far as a
gradient's strides do.

Likewise step() returns while the new weights are still being uploaded: a parameter written (or its
.data replaced) before the compute stream waited for its bucket's upload (a module's forward, the
next backward, synchronize()) may be reverted by that upload. That is now raised when the wait comes.
"""
import threading

import pytest
import torch

import offload
from offload.device import CpuDevice, FakeDevice

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)

SHAPES = [(70, 80), (9000,), (3,)]


def params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def device(side):
    return CpuDevice() if side == "cpu" else FakeDevice(max_delay=0.002, seed=3)


def flat_views(ps, gen):
    """Gradients as views into one flat buffer at an odd offset (as DDP's gradient buckets)."""
    buf = torch.randn(sum(p.numel() for p in ps) + 7, generator=gen)
    out, o = [], 7
    for p in ps:
        out.append(buf[o:o + p.numel()].view(p.shape))
        o += p.numel()
    return out


def transposed(ps, gen):
    return [torch.randn(p.shape[::-1], generator=gen).t() if p.dim() == 2 else torch.randn(p.shape, generator=gen)
            for p in ps]


STRIDED = {
    "transposed": transposed,
    "expanded": lambda ps, gen: [torch.randn(1, generator=gen).expand(p.shape) for p in ps],
    "every_other": lambda ps, gen: [torch.randn(2 * p.numel(), generator=gen)[::2].view(p.shape) for p in ps],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ("cpu", "fake"))
def test_gradients_as_views_of_one_flat_buffer_give_torch_result(side):
    """Contiguous views at odd offsets of one buffer (DDP's gradient buckets), every step a new buffer.
    (The overlap check once treated such views by numel only; it reaches what their strides reach.)"""
    ps_t, ps = params(), params()
    ref = torch.optim.AdamW(ps_t, lr=1e-2, foreach=False)
    opt = offload.AdamW(ps, lr=1e-2, offload_device=device(side), bucket_mb=0.01)
    gen_t, gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, g in zip(ps_t, flat_views(ps_t, gen_t)):
            p.grad = g
        for p, g in zip(ps, flat_views(ps, gen)):
            p.grad = g
        ref.step()
        opt.step()
    opt.synchronize()
    for a, b in zip(ps_t, ps):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(STRIDED))
@pytest.mark.parametrize("side", ("cpu", "fake"))
def test_non_contiguous_gradients_are_refused_by_name(side, kind):
    """torch steps them; offload copies gradients down as flat pieces of their own memory, so a
    non-contiguous one (which would need a copy kernel on an unordered stream) is refused before
    anything is stepped, as on the host path; the parameters are untouched."""
    ps = params()
    before = [p.detach().clone() for p in ps]
    opt = offload.AdamW(ps, lr=1e-2, offload_device=device(side), bucket_mb=0.01)
    for p, g in zip(ps, STRIDED[kind](ps, torch.Generator().manual_seed(1))):
        p.grad = g
    with pytest.raises(RuntimeError, match="gradient of parameter 0 of group 0 is not contiguous"):
        opt.step()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("during", ("before_copy", "during_copy"))
@pytest.mark.parametrize("tier", ("ram", "nvme"))
def test_gradient_written_in_place_while_the_worker_copies_it_raises(tmp_path, monkeypatch, tier, during):
    """A persistent gradient buffer refilled in place right after step(): the worker is made to wait
    before it issues the first bucket's copy (or after the copy, before its check), the refill
    happens then. The next step() raises instead of stepping those buckets with the new values."""
    from offload.params.device import DeviceParams
    hold, held = threading.Event(), threading.Event()
    where = "arrive" if during == "before_copy" else "ptrs"
    orig = getattr(DeviceParams, where)

    def waiting(self, *a, **k):
        if not held.is_set():
            held.set()
            assert hold.wait(10)
        return orig(self, *a, **k)

    monkeypatch.setattr(DeviceParams, where, waiting)
    ps = params()
    opts = dict(storage=tier, nvme_dir=tmp_path) if tier != "ram" else {}
    opt = offload.AdamW(ps, lr=1e-2, offload_device=CpuDevice(), bucket_mb=0.01, **opts)
    bufs = [torch.zeros(p.shape) for p in ps]
    gen = torch.Generator().manual_seed(1)
    for p, b in zip(ps, bufs):
        b.copy_(torch.randn(p.shape, generator=gen))
        p.grad = b
    opt.step()
    assert held.wait(10)        # the worker waits inside its first bucket
    for b in bufs:
        b.mul_(-3.0)            # the next step's gradient, written into the same tensors
    hold.set()
    with pytest.raises(RuntimeError, match="changed while the CPU worker still had to copy it"):
        opt.step()
    opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ("zero_grad", "synchronize"))
def test_gradient_written_in_place_after_the_documented_wait_is_fine(how):
    """The same refill after optimizer.zero_grad(set_to_none=False) or optimizer.synchronize(): the
    host path's result, bitwise."""
    ps_h, ps = params(), params()
    host = offload.AdamW(ps_h, lr=1e-2)
    opt = offload.AdamW(ps, lr=1e-2, offload_device=FakeDevice(max_delay=0.002, seed=5), bucket_mb=0.01)
    for o, group in ((host, ps_h), (opt, ps)):
        bufs = [torch.zeros(p.shape) for p in group]
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            if how == "zero_grad":
                o.zero_grad(set_to_none=False)
            elif hasattr(o, "synchronize"):
                o.synchronize()
            for p, b in zip(group, bufs):
                b.add_(torch.randn(p.shape, generator=gen))
                p.grad = b
            o.step()
    opt.synchronize()
    for a, b in zip(ps_h, ps):
        assert torch.equal(a, b)
    opt.close()


def _hold_upload(monkeypatch):
    """The worker waits before it issues its first bucket's upload (H2D) until ``release`` is set."""
    from offload.params.device import DeviceParams
    release, held = threading.Event(), threading.Event()
    orig = DeviceParams.publish

    def publish(self, *a, **k):
        if not held.is_set():
            held.set()
            assert release.wait(10)
        return orig(self, *a, **k)

    monkeypatch.setattr(DeviceParams, "publish", publish)
    return held, release


WRITES = {
    "in_place": lambda p: p.mul_(0.5),
    "data_replaced": lambda p: setattr(p, "data", p.data.clone() * 0.5),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", sorted(WRITES))
@pytest.mark.parametrize("wait", ("synchronize", "forward"))
def test_weight_write_before_its_upload_is_waited_for_raises(monkeypatch, how, wait):
    """opt.step(), then a write into the weights without opt.synchronize(): the upload of those weights
    has not even been issued (the worker is held); the write would be reverted when it lands. The wait
    (synchronize(), or the module's forward) raises, once; after it the optimizer goes on."""
    held, release = _hold_upload(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=CpuDevice(), bucket_mb=0.001,
                        step_during_backward=False)
    x = torch.randn(8, 30)
    model(x).square().mean().backward()
    opt.step()
    assert held.wait(10)
    with torch.no_grad():
        WRITES[how](model[0].weight)
    release.set()
    with pytest.raises(RuntimeError, match="written .* after step\\(\\) while its new weights were still being uploaded"):
        opt.synchronize() if wait == "synchronize" else model(x)
    opt.synchronize()                     # reported once: the optimizer goes on
    model(x).square().mean().backward()
    opt.step()
    opt.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


@pytest.mark.timeout(60)
def _host_vs_device(device, between, schedule="deferred", steps=3):
    """Three steps of a small MLP (host parameters when ``device`` is None), ``between(step, model, opt)``
    after each step(); the final parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    kw = dict(offload_device=device, bucket_mb=0.001, step_during_backward=schedule == "eager") if device else {}
    opt = offload.AdamW(model.parameters(), lr=1e-2, **kw)
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        model(torch.randn(8, 30, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        between(s, model, opt)
    if device:
        opt.synchronize()
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


def test_weight_write_after_synchronize_is_kept():
    """The same write after opt.synchronize() is legal and not reported: bitwise the host path."""
    def between(s, model, opt):
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        with torch.no_grad():
            model[0].weight.mul_(0.5)
    for a, b in zip(_host_vs_device(None, between), _host_vs_device(FakeDevice(max_delay=0.002, seed=2), between)):
        assert torch.equal(a, b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ("eager", "deferred"))
@pytest.mark.parametrize("how", ("wrapper", "in_place", "late"))
def test_compiled_model_reads_the_new_weights(how, schedule):
    """torch.compile(model), model.compile() or a compile after two steps: compiled code runs only
    the global module hooks that existed when it was traced, so the per-module upload waits, which
    are registered at each step(), did not happen inside a compiled forward: it read weights before
    their upload landed (FakeDevice with slow copies: different losses and parameters). step() now
    waits for every upload once torch.compile has compiled anything: bitwise the host path."""
    def run(device):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.GELU(), torch.nn.Linear(40, 40), torch.nn.Linear(40, 5))
        kw = dict(offload_device=device, bucket_mb=0.001, step_during_backward=schedule == "eager") if device else {}
        opt = offload.AdamW(m.parameters(), lr=1e-2, **kw)
        f = torch.compile(m, backend="eager") if how == "wrapper" else m
        if how == "in_place":
            m.compile(backend="eager")
        gen = torch.Generator().manual_seed(1)
        for it in range(5):
            if how == "late" and it == 2:
                f = torch.compile(m, backend="eager")
            f(torch.randn(8, 30, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if device:
            opt.synchronize()
            opt.close()
        return [p.detach().clone() for p in m.parameters()]
    torch._dynamo.reset()
    for a, b in zip(run(None), run(FakeDevice(max_delay=0.01, min_delay=0.005, seed=4))):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ("eager", "deferred"))
def test_the_cpu_worker_records_no_event_on_its_own_thread(monkeypatch, schedule):
    """The events the worker's copies wait for come from the compute stream (recorded on the training
    thread or in backward hooks). One recorded on the worker's own thread would be on that thread's
    current CUDA stream, which is not ordered after a user's compute stream; the first step of each
    parameter reads its master from the device in the worker (registry.init_fresh) and did that."""
    names = []
    orig = FakeDevice.record

    def record(self):
        names.append(threading.current_thread().name)
        return orig(self)

    monkeypatch.setattr(FakeDevice, "record", record)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5)).to(torch.bfloat16)
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=FakeDevice(max_delay=0.001), bucket_mb=0.001,
                        step_during_backward=schedule == "eager")
    for _ in range(3):
        model(torch.randn(8, 30).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    opt.close()
    assert names and "offload-backward-step" not in names, sorted(set(names))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ("eager", "deferred"))
def test_model_state_dict_right_after_step_holds_the_new_weights(schedule):
    """model.state_dict() right after step(), as transformers' Trainer, Lightning and accelerate save
    checkpoints: it waits for the uploads of each module's parameters (a state_dict pre-hook on the
    modules seen in forward), instead of returning the weights before the step (a checkpoint of the
    old model beside the new optimizer state; on the FakeDevice, whose copies here take 0.2 s and
    poison their destination until they land, NaN)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=FakeDevice(min_delay=0.2, max_delay=0.2),
                        bucket_mb=0.001, step_during_backward=schedule == "eager")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 30)).square().mean().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    opt.synchronize()
    after = model.state_dict()
    assert all(torch.equal(saved[k], after[k]) for k in after), [k for k in after if not torch.equal(saved[k], after[k])]
    assert not any(torch.equal(before[k], after[k]) for k in after)
    opt.close()


_EXIT_SCRIPT = """
import sys, tempfile, torch, offload
from offload.device import CpuDevice
p = torch.nn.Parameter(torch.zeros(12_000_000))
kw = dict(storage="nvme", nvme_dir=tempfile.mkdtemp()) if sys.argv[1] == "nvme" else {}
opt = offload.AdamW([p], lr=1e-2, offload_device=CpuDevice(), step_during_backward=False, **kw)
p.grad = torch.ones_like(p)
opt.step()        # returns while the CPU worker is inside the kernel (GIL released)
print("end of script")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", ("ram", "nvme"))
def test_script_ending_right_after_step_exits_cleanly(tier):
    """The worker is joined at interpreter exit (weakref.finalize); it used to be killed on its way
    back into Python from the kernel, through C++ code: 'terminate called without an active
    exception', exit code 134, every time."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, tier], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0 and "terminate" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "end of script" in r.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ("eager", "deferred"))
def test_model_load_state_dict_right_after_step_is_kept(schedule):
    """model.load_state_dict() right after step() (a rollback) waits for the uploads of each module's
    parameters first, so no upload lands after the load and reverts it; the next step takes the loaded
    weights, as the host path does (bitwise)."""
    torch.manual_seed(0)
    snap = {k: v.clone() for k, v in torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Tanh(),
                                                         torch.nn.Linear(40, 5)).state_dict().items()}

    def between(s, model, opt):
        if s == 1:
            model.load_state_dict(snap)   # back to the initial weights, without synchronize()
    host = _host_vs_device(None, between)
    for a, b in zip(host, _host_vs_device(FakeDevice(min_delay=0.05, max_delay=0.05), between, schedule)):
        assert torch.equal(a, b)
