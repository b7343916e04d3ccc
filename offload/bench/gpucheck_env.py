"""bench/gpucheck_env.py: check 00 of ``bench/gpu_check.py`` - the environment: versions, GPU, CPU
affinity, the locked-memory limit, offload's build, a ``cudaHostRegister`` of 64 MiB followed by a
trivial kernel launch (a swallowed registration error would make that launch raise), pinned and
pageable copy probes at 4/32/128 MB in both directions, and the native kernel's memory-bandwidth
probe.
"""
from __future__ import annotations

import os
import platform
import resource
import statistics
import time

import torch

from .gpucheck_common import Ctx, Result

MB = 1 << 20


def _cuda_probe(nbytes: int, pinned: bool, reps: int = 5) -> dict:
    from .train import copy_probe
    return {k: round(v, 2)
            for k, v in copy_probe(torch.device("cuda"), nbytes, reps, pinned).items()}


def _host_probe(nbytes: int, reps: int = 5) -> float:
    n = nbytes // 4
    src, dst = torch.ones(n), torch.zeros(n)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return round(nbytes / statistics.median(times[1:]) / 1e9, 2)


def _register_probe(res: Result) -> None:
    """cudaHostRegister of 64 MiB (page-aligned), then a kernel launch that must not raise."""
    nbytes = 64 * MB
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096
    buf = raw[off:off + nbytes]
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
    rc = int(getattr(rc, "value", rc))
    res.expect(rc == 0, "cudaHostRegister(64 MiB) returns 0", rc=rc)
    launched = None
    try:
        x = torch.ones(1024, device="cuda")
        x.add_(1.0)
        torch.cuda.synchronize()
        launched = float(x[0]) == 2.0
    except Exception as e:  # a sticky error from the register call shows up here
        launched = f"{type(e).__name__}: {e}"
    res.expect(launched is True, "a kernel launch after cudaHostRegister works", outcome=launched)
    # (offload registers nothing itself: its host buffers come from torch's pinned allocator)
    if rc == 0:
        res.data["torch is_pinned() of a cudaHostRegister'ed buffer"] = bool(buf.is_pinned())
        cudart.cudaHostUnregister(buf.data_ptr())
    from offload.device import CudaDevice
    dev = CudaDevice()
    try:
        slot = dev.host_empty(4 * MB // 4, torch.float32)
        res.expect(slot.is_pinned(), "CudaDevice.host_empty(4 MiB) is pinned")
    finally:
        dev.close()


def check_environment(ctx: Ctx, res: Result) -> None:
    import offload
    info = dict(python=platform.python_version(), torch=torch.__version__,
                torch_cuda=torch.version.cuda,
                cpus=os.cpu_count(), memlock_rlimit=resource.getrlimit(resource.RLIMIT_MEMLOCK),
                CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                deterministic=torch.are_deterministic_algorithms_enabled())
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["affinity_cpus"] = None
    try:
        info["build_info"] = offload.build_info()
    except Exception as e:  # noqa: BLE001
        res.expect(False, "offload.build_info() works (rebuild with pip install -e . "
                          "if _C is stale)", error=str(e))
    from .common import cpu_model
    info["cpu_model"] = cpu_model()   # the host's memory bandwidth sets the CPU step's speed
    lim = info["memlock_rlimit"][0]
    res.note(f"CPU {info['cpu_model']}; torch {torch.__version__}, affinity "
             f"{info['affinity_cpus']} CPUs, ulimit -l "
             f"{'unlimited' if lim == resource.RLIM_INFINITY else lim // 1024}, isa "
             f"{info.get('build_info', {}).get('isa')}, threads "
             f"{info.get('build_info', {}).get('threads')}")
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                    gpu_mem_gb=round(p.total_memory / 1e9, 1))
        try:
            info["driver"] = torch._C._cuda_getDriverVersion()
        except Exception:  # noqa: BLE001
            info["driver"] = None
        res.note(f"GPU {p.name}, driver {info['driver']}, CUDA {torch.version.cuda}")
        _register_probe(res)
        probes = {}
        for mb in (4, 32, 128):
            ctx.tick()
            probes[f"{mb}MB"] = dict(pinned=_cuda_probe(mb * MB, True),
                                     pageable=_cuda_probe(mb * MB, False))
        info["copy_probe_gbps"] = probes
        ctx.perf["probe"] = probes
        res.note("pinned 32MB D2H/H2D %.1f/%.1f GB/s, pageable %.1f/%.1f GB/s" % (
            probes["32MB"]["pinned"]["d2h"], probes["32MB"]["pinned"]["h2d"],
            probes["32MB"]["pageable"]["d2h"], probes["32MB"]["pageable"]["h2d"]))
    else:
        probes = {f"{mb}MB": dict(host_memcpy=_host_probe(mb * MB))
                  for mb in ((4, 32) if ctx.quick else (4, 32, 128))}
        info["copy_probe_gbps"] = probes
        ctx.perf["probe"] = probes
        res.note("fake device: no GPU, no cudaHostRegister; host memcpy probe only")
    # the native kernel's memory bandwidth with Adam's access pattern
    from offload import kernels
    if hasattr(kernels, "bandwidth_probe"):
        n = (16 if ctx.cuda else 1) * MB
        p, m, v, g = (torch.rand(n) for _ in range(4))
        kernels.bandwidth_probe(p, m, v, g)
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            kernels.bandwidth_probe(p, m, v, g)
        dt = (time.perf_counter() - t0) / reps
        # reads p, m, v, g; writes p, m, v
        info["kernel_probe_gbps"] = round(28 * n / dt / 1e9, 2)
        ctx.perf["kernel_probe_gbps"] = info["kernel_probe_gbps"]
        res.note(f"native bandwidth probe {info['kernel_probe_gbps']} GB/s")
    else:
        res.note("offload.kernels has no bandwidth_probe")
    res.data["environment"] = info
    res.expect(True, "environment recorded")
