"""doctor.py: ``python -m offload`` / ``offload.doctor()``, what a bug report needs, in a few
seconds.

``report(build_info, dir)`` returns a dict (the keys of ``KEYS``): offload's and the native core's
versions (they must match), Python, torch (version, CUDA/HIP build), OS and kernel, the CPU model
and ISA flags (read from /proc/cpuinfo: no external tools), the kernel ISA offload chose and those
available, thread count and CPU affinity, RAM, CUDA devices and whether pinned memory can be
allocated (only when ``torch.cuda.is_available()``; CUDA is never initialized otherwise),
transparent huge pages, and, for a directory (default: the system's temporary directory): its
filesystem, free space, whether it takes O_DIRECT (opened the way the NVMe state file is, through
offload/native/aio.py) and a write+read speed of at most about 2 s, on a file in a new subdirectory
that is removed afterwards (nothing else there is touched). ``problems`` lists what looks wrong,
each with what to do. ``format_report`` renders the text form; ``main`` is the command line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from typing import Callable, Optional

import torch

__all__ = ["KEYS", "report", "format_report", "main"]

KEYS = ("offload", "python", "torch", "os", "cpu", "memory", "cuda", "transparent_hugepages",
        "env", "dir", "problems")
_CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
              "avx512_bf16", "avx512_fp16", "amx_bf16", "asimd", "sve", "sve2")
_ENV = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
_SPEED_CHUNK = 4 << 20          # bytes per transfer of the speed test
_SPEED_MAX = 512 << 20          # never more than this, nor a quarter of the free space
_SPEED_PHASE_S = 0.8            # seconds of writing, then of reading


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _guard(fn: Callable, *a) -> dict:
    """A section that fails reports its error instead of failing the whole report."""
    try:
        return fn(*a)
    except Exception as e:   # noqa: BLE001 (a diagnostic tool: every failure is data)
        return {"error": f"{type(e).__name__}: {e}"}


def _offload(info: dict) -> dict:
    d = dict(info)
    d["versions_match"] = info.get("version") == info.get("native_version")
    return d


def _python() -> dict:
    return {"version": platform.python_version(),
            "implementation": platform.python_implementation(), "executable": sys.executable}


def _torch() -> dict:
    cuda, hip = getattr(torch.version, "cuda", None), getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU"
    return {"version": torch.__version__, "cuda": cuda, "hip": hip, "build": build,
            "threads": torch.get_num_threads()}


def _os() -> dict:
    rel = _read("/etc/os-release") or ""
    pretty = next((line.split("=", 1)[1].strip().strip('"') for line in rel.splitlines()
                   if line.startswith("PRETTY_NAME=")), None)
    return {"system": platform.system(), "kernel": platform.release(),
            "machine": platform.machine(),
            "distribution": pretty, "libc": " ".join(platform.libc_ver()).strip() or None}


def _cpu() -> dict:
    text = _read("/proc/cpuinfo") or ""
    fields: dict = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            fields.setdefault(k.strip(), v.strip())
    model = (fields.get("model name") or fields.get("Model") or fields.get("Hardware")
             or platform.processor() or None)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"model": model, "logical_cpus": os.cpu_count(), "affinity_cpus": affinity,
            "flags": [f for f in _CPU_FLAGS if f in flags]}


def _memory() -> dict:
    vals = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            vals[k] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return {"total_bytes": vals.get("MemTotal"), "available_bytes": vals.get("MemAvailable"),
            "swap_total_bytes": vals.get("SwapTotal")}


def _cuda() -> dict:
    if not torch.cuda.is_available():   # the only CUDA call unless a device is there
        return {"available": False}
    devs = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devs.append({"index": i, "name": p.name, "total_memory_bytes": int(p.total_memory),
                     "capability": f"{p.major}.{p.minor}"})
    out = {"available": True, "devices": devs, "pinned_memory": False}
    try:
        t = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        out["pinned_memory"] = bool(t.is_pinned())
        del t
    except Exception as e:   # noqa: BLE001
        out["pinned_memory_error"] = f"{type(e).__name__}: {e}"
    return out


def _thp() -> Optional[str]:
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text is None:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")),
                text.strip())


def _env() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("OFFLOAD_") or k in _ENV}


def _filesystem(path: str) -> Optional[str]:
    """The type of the filesystem holding ``path`` (the longest mount point above it,
    /proc/self/mountinfo)."""
    best, fstype = -1, None
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        parts = left.split()
        if not sep or len(parts) < 5 or not right:
            continue
        # \040 is a space
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best:
            best, fstype = len(mnt), right.split()[0]
    return fstype


def _speed(directory: str, free: int, speed_test: bool) -> dict:
    """O_DIRECT and, with ``speed_test``, MB/s of writing then reading a file of a new
    subdirectory."""
    from .native.aio import AioEngine
    from .base.memory import aligned_empty

    sub = tempfile.mkdtemp(prefix="offload-doctor-", dir=directory)
    path = os.path.join(sub, "probe.bin")
    out: dict = {}
    eng = fh = None
    try:
        eng = AioEngine(queue_depth=8, block_size=1 << 20)
        with warnings.catch_warnings():
            # the refusal is what is reported here
            warnings.simplefilter("ignore", RuntimeWarning)
            fh = eng.open(path, create=True, direct=True)
        out["o_direct"] = bool(fh.direct)
        if not speed_test:
            return out
        cap = max(0, min(_SPEED_MAX, free // 4)) // _SPEED_CHUNK * _SPEED_CHUNK
        if cap == 0:
            out["speed_error"] = "not enough free space for the speed test"
            return out
        buf = aligned_empty(_SPEED_CHUNK)
        buf.copy_(torch.randint(0, 256, (_SPEED_CHUNK,), dtype=torch.uint8))   # incompressible
        fd = fh.tail_fd if fh.tail_fd >= 0 else fh.fd
        written, t0 = 0, time.perf_counter()
        while written < cap and time.perf_counter() - t0 < _SPEED_PHASE_S:
            n = min(4, (cap - written) // _SPEED_CHUNK)   # 4 transfers in flight
            reqs = [eng.write(fh, buf, written + k * _SPEED_CHUNK) for k in range(n)]
            for r in reqs:
                r.wait()
            if not fh.direct:
                os.fsync(fd)   # buffered: the time to reach the disk, not the page cache
            written += len(reqs) * _SPEED_CHUNK
        os.fsync(fd)
        tw = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            # buffered reads: not from the page cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done, t0 = 0, time.perf_counter()
        while done < written and time.perf_counter() - t0 < _SPEED_PHASE_S:
            n = min(4, (written - done) // _SPEED_CHUNK)
            reqs = [eng.read(fh, buf, done + k * _SPEED_CHUNK) for k in range(n)]
            for r in reqs:
                r.wait()
            done += len(reqs) * _SPEED_CHUNK
        tr = time.perf_counter() - t0
        out.update(write_mb_s=round(written / tw / 1e6, 1), read_mb_s=round(done / tr / 1e6, 1),
                   speed_test_bytes=written)
    finally:
        if fh is not None:
            fh.close()
        if eng is not None:
            eng.close()
        if os.path.lexists(path):
            os.unlink(path)
        os.rmdir(sub)
    return out


def _dir(directory: Optional[str], speed_test: bool) -> dict:
    path = os.path.realpath(directory if directory is not None else tempfile.gettempdir())
    out: dict = {"path": path, "filesystem": None, "free_bytes": None, "o_direct": None}
    if not os.path.isdir(path):
        out["error"] = f"{path} is not a directory: pass an existing directory with --dir"
        return out
    out["filesystem"] = _filesystem(path)
    st = os.statvfs(path)
    out["free_bytes"] = st.f_bavail * st.f_frsize
    if not os.access(path, os.W_OK | os.X_OK):
        out["error"] = (f"{path} is not writable by this user: pass a directory you can "
                        "write with --dir")
        return out
    try:
        out.update(_speed(path, out["free_bytes"], speed_test))
    except OSError as e:
        out["error"] = f"the I/O test in {path} failed: {e}"
    return out


def _problems(rep: dict) -> list:
    out = []
    off = rep["offload"]
    if not off.get("versions_match", True):
        out.append(f"the native core (offload._C {off.get('native_version')}) does not match the "
                   f"package ({off.get('version')}): rebuild it with `pip install -e .`")
    aff, thr = rep["cpu"].get("affinity_cpus"), off.get("threads")
    if aff and thr and thr > aff:
        out.append(f"offload uses {thr} threads on {aff} CPUs this process may run on: set "
                   f"OFFLOAD_NUM_THREADS={aff} or threads= in the optimizer")
    cuda = rep["cuda"]
    if cuda.get("available") and not cuda.get("pinned_memory"):
        out.append("pinned host memory cannot be allocated: GPU offload copies will fail or be "
                   "slow; check the locked-memory limit (ulimit -l) and the container's "
                   "memory settings")
    d = rep["dir"]
    if d.get("error"):
        out.append(d["error"])
    elif d.get("o_direct") is False:
        out.append(f"{d['path']} ({d.get('filesystem')}) refuses O_DIRECT: NVMe state there is "
                   "buffered through the page cache; point nvme_dir at a directory on the NVMe "
                   "disk (ext4/xfs)")
    return out


def report(build_info: dict, dir=None, *, speed_test: bool = True) -> dict:
    """The environment as a dict with the keys of ``KEYS``; ``build_info`` is
    ``offload.build_info()``."""
    rep = {"offload": _guard(_offload, build_info), "python": _guard(_python),
           "torch": _guard(_torch),
           "os": _guard(_os), "cpu": _guard(_cpu), "memory": _guard(_memory),
           "cuda": _guard(_cuda),
           "transparent_hugepages": _thp(), "env": _env(), "dir": _guard(_dir, dir, speed_test)}
    try:
        rep["problems"] = _problems(rep)
    except Exception as e:   # noqa: BLE001
        rep["problems"] = [f"the report could not be checked: {type(e).__name__}: {e}"]
    return rep


def _size(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def format_report(rep: dict) -> str:
    """The report as text, one fact a line (what ``python -m offload`` prints)."""
    o, py, t, s, c, m, cu, d = (rep[k] for k in ("offload", "python", "torch", "os", "cpu",
                                                 "memory", "cuda", "dir"))
    lines = [
        f"offload         {o.get('version')} (native core {o.get('native_version')}"
        f"{'' if o.get('versions_match') else ', MISMATCH'})",
        f"python          {py.get('version')} ({py.get('implementation')}, "
        f"{py.get('executable')})",
        f"torch           {t.get('version')} ({t.get('build')}), {t.get('threads')} "
        "intra-op threads",
        f"os              {s.get('system')} {s.get('kernel')} {s.get('machine')}"
        + (f", {s['distribution']}" if s.get("distribution") else "")
        + (f", {s['libc']}" if s.get("libc") else ""),
        f"cpu             {c.get('model')}, {c.get('logical_cpus')} logical CPUs, "
        f"flags: {' '.join(c.get('flags') or []) or '-'}",
        f"kernel isa      {o.get('isa')} (available: {', '.join(o.get('available_isas') or [])}), "
        f"software prefetch {o.get('stream_prefetch')}",
        f"threads         {o.get('threads')} by default, affinity {o.get('affinity_cpus')} CPUs",
        f"memory          {_size(m.get('total_bytes'))} total, "
        f"{_size(m.get('available_bytes'))} available",
    ]
    if cu.get("available"):
        for dev in cu.get("devices", []):
            lines.append(f"cuda:{dev['index']:<10} {dev['name']}, "
                         f"{_size(dev['total_memory_bytes'])}, compute capability "
                         f"{dev['capability']}")
        pinned = "yes" if cu.get("pinned_memory") else "NO " + cu.get("pinned_memory_error", "")
        lines.append(f"pinned memory   {pinned}")
    else:
        lines.append(f"cuda            {'not available' if 'error' not in cu else cu['error']}")
    lines.append(f"huge pages      transparent_hugepage={rep.get('transparent_hugepages')}")
    if rep.get("env"):
        lines.append("environment     " + " ".join(f"{k}={v}" for k, v in rep["env"].items()))
    lines.append(f"dir             {d.get('path')}: {d.get('filesystem')}, "
                 f"{_size(d.get('free_bytes'))} free, O_DIRECT "
                 f"{'?' if d.get('o_direct') is None else 'yes' if d['o_direct'] else 'no'}")
    if "write_mb_s" in d:
        lines.append(f"dir speed       write {d['write_mb_s']} MB/s, read {d['read_mb_s']} MB/s "
                     f"({_size(d['speed_test_bytes'])}"
                     f"{'' if d.get('o_direct') else ', buffered'})")
    for section in ("offload", "python", "torch", "os", "cpu", "memory", "cuda"):
        if "error" in rep[section]:
            lines.append(f"{section}: could not be read: {rep[section]['error']}")
    lines += [f"problem         {p}" for p in rep["problems"]] or ["problems        none found"]
    return "\n".join(lines)


def main(argv, build_info: Callable[[], dict]) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload",
                                 description="Print what a bug report about offload needs: "
                                             "versions, CPU, memory, CUDA and the filesystem of "
                                             "the state directory.")
    ap.add_argument("--dir", default=None, help="the directory to check (where nvme_dir will be; "
                                                "default: the system's temporary directory)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("--no-speed", action="store_true",
                    help="skip the write+read speed test (about 2 s)")
    args = ap.parse_args(argv)
    rep = report(build_info(), args.dir, speed_test=not args.no_speed)
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0
