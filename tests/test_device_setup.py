"""Setting up the GPU-offload path: which device its copies run on, how many CPUs its kernel takes,
and a failure of the CPU worker between buckets (fake device; the CUDA-only parts are marked)."""
import types

import pytest
import torch
import torch.nn as nn

import offload
import offload.device as devices
from offload.device import CudaDevice, FakeDevice
from offload.store import StoreFailedError
from conftest import patch_kernels

pytestmark = pytest.mark.timeout(60)


def _on(kind, index=None):
    """Stand-ins that only carry a device (resolve_device reads nothing else)."""
    return types.SimpleNamespace(device=torch.device(kind, index) if index is not None else torch.device(kind))


class _StubCuda:
    made: list = []

    def __init__(self, device=None):
        self.device = torch.device(device)
        _StubCuda.made.append(self.device)

    def check_params(self, params):
        CudaDevice.check_params(self, params)   # the real rule


def test_cuda_without_index_means_the_parameters_gpu(monkeypatch):
    monkeypatch.setattr(devices, "CudaDevice", _StubCuda)
    _StubCuda.made = []
    params = [_on("cuda", 1), _on("cuda", 1)]
    assert devices.resolve_device("cuda", params).device == torch.device("cuda", 1)
    assert devices.resolve_device(None, params).device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="offload_device is cuda:0 but parameters are on cuda:1"):
        devices.resolve_device("cuda:0", params)
    with pytest.raises(RuntimeError, match="one device"):
        devices.resolve_device(None, [_on("cuda", 0), _on("cuda", 1)])


def test_fake_device_refuses_parameters_on_a_gpu():
    with pytest.raises(ValueError, match="FakeDevice drives CPU tensors"):
        devices.resolve_device(FakeDevice(), [_on("cuda", 0)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_explicit_cuda_device_must_match_the_parameters():
    model = nn.Linear(4, 4).cuda()
    other = CudaDevice("cuda:0")
    if torch.cuda.device_count() < 2:
        assert offload.AdamW(model.parameters(), offload_device=other) is not None
        return
    with pytest.raises(ValueError, match="offload_device is cuda:0"):
        offload.AdamW(nn.Linear(4, 4).to("cuda:1").parameters(), offload_device=other)


def _threads_used(monkeypatch, dev, **opts):
    seen = []

    def spy(real):
        def call(table, hyper, mult, threads):
            seen.append(threads)
            return real(table, hyper, mult, threads)
        return call
    patch_kernels(monkeypatch, spy)
    model = nn.Linear(16, 16)
    opt = offload.AdamW(model.parameters(), offload_device=dev, **opts)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.synchronize()
    opt.close()
    return set(seen)


def test_kernel_leaves_the_launch_threads_their_cpus(monkeypatch):
    dev = FakeDevice(max_delay=0.0)
    assert _threads_used(monkeypatch, dev) == {0}   # no launch threads to spare: every CPU
    dev = FakeDevice(max_delay=0.0)
    dev.launch_threads = 1   # as CudaDevice (2) on a machine with more CPUs
    import os
    want = max(1, len(os.sched_getaffinity(0)) - 1)
    assert _threads_used(monkeypatch, dev) == {want}
    assert _threads_used(monkeypatch, FakeDevice(max_delay=0.0), threads=1) == {1}   # the user's choice wins


def test_worker_failure_between_buckets_is_raised_not_a_hang(monkeypatch):
    """The read-ahead the worker runs between jobs raising must fail the step (raised at the next
    call), not end the thread silently and leave synchronize() waiting."""
    from offload.schedule.worker import Worker
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    dev = FakeDevice(max_delay=0.0)
    opt = offload.AdamW(model.parameters(), offload_device=dev, bucket_mb=0.001)
    calls = {"n": 0}

    def boom(self, blocking):
        calls["n"] += 1
        if not blocking:
            raise OSError("injected read-ahead failure")
    monkeypatch.setattr(Worker, "read_ahead", boom)
    with pytest.raises((RuntimeError, OSError, StoreFailedError), match="injected read-ahead failure"):
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        opt.synchronize()
    with pytest.raises(StoreFailedError, match="load the last checkpoint"):
        opt.step()   # every later call refuses until the state is reloaded
    opt.close()


def test_close_after_a_reported_write_frees_the_worker_and_a_second_close_returns():
    import threading
    import time
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    dev = FakeDevice(max_delay=0.05, min_delay=0.03)
    before = set(threading.enumerate())   # (other tests' workers may still be winding down)
    opt = offload.AdamW(model.parameters(), offload_device=dev, bucket_mb=0.001)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)   # written without synchronize(): reported
    with pytest.warns(RuntimeWarning, match="written"):
        opt.close()   # reported as a warning: close() is cleanup
    assert not [t for t in set(threading.enumerate()) - before if t.name == "offload-backward-step" and t.is_alive()]
    t0 = time.perf_counter()
    opt.close()   # closed already: returns at once
    assert time.perf_counter() - t0 < 5


def test_ddp_on_one_rank_steps_after_backward_by_default(tmp_path):
    """DDP rewrites the gradients after they are ready even with one rank: the default schedule must not
    step buckets during backward whenever a process group exists."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))
        ref = [p.detach().clone() for p in model.parameters()]
        ref_opt = torch.optim.AdamW(ref, lr=1e-2)
        dev = FakeDevice(max_delay=0.001)
        opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=dev, bucket_mb=0.001)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 16, generator=gen)
            model(x).square().mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            for r, g in zip(ref, grads):
                r.grad = g
            ref_opt.step()
        opt.synchronize()
        for a, b in zip(model.parameters(), ref):
            torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-7)
        opt.close()
    finally:
        dist.destroy_process_group()


def test_batched_fingerprints_equal_the_per_tensor_sums():
    """Device-side fingerprints sum small tensors in batches (a few kernels per batch instead of a few per
    tensor): each value must be the per-tensor sum of its own bits."""
    from offload.params import fingerprint as fp
    torch.manual_seed(0)
    sizes = [(5, torch.float32), (3000, torch.bfloat16), (1, torch.float16), (70000, torch.float32),
             (3 << 20, torch.float32), (0, torch.float32), (17, torch.float64)]
    tensors = [torch.randn(n).to(dt) for n, dt in sizes]
    got = fp.fingerprints(tensors, native=False)
    for t, h in zip(tensors, got.tolist()):   # the definition: position-weighted sum of the bits, per chunk
        ints = t.reshape(-1).view(torch.int32 if t.element_size() >= 4 else torch.int16).to(torch.int64)
        w = fp.chunk_weights(t.device)
        want = sum(int((ints[s:s + fp.CHUNK] * w[:ints[s:s + fp.CHUNK].numel()]).sum()) * (2 * k + 1)
                   for k, s in enumerate(range(0, ints.numel(), fp.CHUNK)))
        assert h == (want + (1 << 63)) % (1 << 64) - (1 << 63)
    tensors[1][7] += 1
    assert (fp.fingerprints(tensors, native=False) != got).tolist() == [False, True] + [False] * 5


def test_cpu_test_device_spelling_and_the_old_one_warns():
    p = nn.Parameter(torch.randn(8))
    assert isinstance(devices.resolve_device("cpu-test", [p]), devices.CpuDevice)
    with pytest.warns(DeprecationWarning, match='spelled "cpu-test"'):
        assert isinstance(devices.resolve_device("cpu", [p]), devices.CpuDevice)
