"""bandwidth.py: the bandwidths behind the planner's step-time prediction, measured on this machine
in a few seconds or read from saved benchmark JSON (``python -m offload.bench kernel|io --json
PATH``).

Four figures, all in bytes per second:
  kernel   the Adam pass at the planned format and thread count, counted as the bytes one pass
           must move (:func:`pass_bytes` per parameter, as ``bench kernel``'s GB/s column): an
           ``offload.AdamW`` step over 16M parameters in RAM (out of any L3), median of a few steps
  read, write   the state directory's O_DIRECT reads / writes alone, with the planned bucket size
           as the request size and ``depth`` requests queued (as the NVMe tier issues them)
  mixed    reads and writes in flight together (what the NVMe step does between its first read
           and its last write): the bytes of both per second. Where unknown (an io JSON without
           it) the disk is taken to serve them one after the other: ``2 / (1/read + 1/write)``
  h2d, d2h pinned host <-> GPU copies (PCIe), when CUDA is present
Several directories (several drives) are measured each alone, once per filesystem, and added up.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Union

import torch

from .base.dtypes import LOW_PRECISION
from .moments.format import moment_format

__all__ = ["Bandwidths", "pass_bytes", "measure", "measure_kernel", "measure_disk", "measure_pcie",
           "from_json"]

GB = 1e9
FIGURES = ("kernel", "read", "write", "mixed", "h2d", "d2h")
PROBE_PARAMS = 16 << 20   # 16M parameters: state + grads + weights ~ 5x a 48 MiB L3


@dataclass
class Bandwidths:
    """Bytes per second of each part of a step (None: not known); ``sources``: where each came
    from."""
    kernel: Optional[float] = None
    read: Optional[float] = None
    write: Optional[float] = None
    mixed: Optional[float] = None
    h2d: Optional[float] = None
    d2h: Optional[float] = None
    sources: dict = field(default_factory=dict)

    def disk_mixed(self) -> Optional[float]:
        """Bytes/s of reads and writes in flight together (the serial assumption where not
        measured)."""
        if self.mixed:
            return self.mixed
        if self.read and self.write:
            return 2 / (1 / self.read + 1 / self.write)
        return None

    def merged(self, other: "Bandwidths") -> "Bandwidths":
        """These figures, with the gaps filled from ``other``."""
        out = Bandwidths(sources=dict(other.sources))
        for k in FIGURES:
            mine = getattr(self, k)
            setattr(out, k, mine if mine is not None else getattr(other, k))
            if mine is not None and k in self.sources:
                out.sources[k] = self.sources[k]
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    def checked(self) -> "Bandwidths":
        """These figures, each refused by name unless a positive finite number (or None)."""
        for k in FIGURES:
            v = getattr(self, k)
            if v is not None and not _positive(v, (int, float)):
                raise ValueError(f"bandwidth {k} must be a positive number of bytes/s (or "
                                 f"None), got {v!r}")
        return self

    @classmethod
    def of(cls, figures: dict) -> "Bandwidths":
        """From a dict of figures (bytes/s): an unknown name is refused, and so is a value that is
        not a positive number."""
        unknown = sorted(str(k) for k in figures if k not in FIGURES + ("sources",))
        if unknown:
            raise TypeError(f"bandwidths has no figure {unknown[0]!r} (it has "
                            f"{', '.join(FIGURES)})")
        return cls(**figures).checked()


def pass_bytes(moments="fp32", grad_bytes: int = 4, out_bytes: int = 0, amsgrad: bool = False,
               numel: Optional[int] = None) -> float:
    """Bytes one Adam pass must move per parameter: the fp32 master (or fp32 parameter) read and
    written, the gradient read, the low-precision weight written (``out_bytes``: 2 for bf16/fp16
    parameters, 0 for fp32), the moments read and written (fp32 16, bf16 8, 8-bit 4 + the
    per-256-element fp32 scales), and max_exp_avg_sq (8) with amsgrad. fp32 parameters with fp32
    gradients: 28 B. ``moments``: a format's name or the format (offload/moments/format.py)."""
    mom = 2 * moment_format(moments).moment_bytes(numel)
    return 8 + grad_bytes + out_bytes + mom + (8 if amsgrad else 0)


def _median_time(fn, reps: int) -> float:
    fn()   # warm-up (first-touch, state creation)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_kernel(*, param_dtype=torch.float32, moments: str = "fp32", amsgrad: bool = False,
                   threads: Optional[int] = None, numel: int = PROBE_PARAMS,
                   reps: int = 9) -> float:
    """Bytes/s of ``offload.AdamW.step()`` in RAM on ``numel`` parameters of ``param_dtype``."""
    from .optim.adam import AdamW
    p = torch.empty(numel, dtype=param_dtype).uniform_(-1, 1)
    p.grad = torch.empty(numel, dtype=param_dtype).uniform_(-1e-2, 1e-2)
    opt = AdamW([p], lr=1e-4, moments=moments, amsgrad=amsgrad, threads=threads)
    try:
        sec = _median_time(opt.step, reps)
    finally:
        opt.close()
    low = param_dtype in LOW_PRECISION
    return numel * pass_bytes(moments, p.element_size(), 2 if low else 0, amsgrad, numel) / sec


def _disk_one(directory: str, size: int, request: int, inflight: int, reps: int) -> dict:
    """read, write, mixed bytes/s of one directory's filesystem (O_DIRECT where it is
    supported)."""
    from .native.aio import AioEngine
    from .base.memory import aligned_empty
    work = tempfile.mkdtemp(prefix="offload-plan-probe-", dir=directory)
    nslot = 2 * inflight + 2
    buf = aligned_empty(request * nslot)
    buf.view(torch.int32).random_()
    paths = [os.path.join(work, n) for n in ("a", "b")]
    try:
        with AioEngine() as eng:
            files = []
            for p in paths:
                files.append(eng.open(p, create=True))

            def run(jobs, queued):
                pending = []
                t = time.perf_counter()
                for k, (op, f, off) in enumerate(jobs):
                    if len(pending) >= queued:
                        pending.pop(0).wait()
                    s = (k % nslot) * request
                    pending.append((eng.write if op == "w" else eng.read)(
                        f, buf[s:s + request], off, min(request, size - off)))
                for r in pending:
                    r.wait()
                if any(op == "w" for op, _, _ in jobs):
                    for f in files:
                        os.fsync(f.fd)
                return time.perf_counter() - t

            offs = range(0, size, request)
            # lay both files out (untimed)
            run([("w", f, o) for f in files for o in offs], inflight)
            out = {"write": [], "read": [], "mixed": []}
            for _ in range(reps):
                out["write"].append(size / run([("w", files[0], o) for o in offs], inflight))
                out["read"].append(size / run([("r", files[1], o) for o in offs], inflight))
                both = [j for o in offs for j in (("r", files[0], o), ("w", files[1], o))]
                out["mixed"].append(2 * size / run(both, 2 * inflight))
            direct = all(f.direct for f in files)
            for f in files:
                f.close()
        res = {k: statistics.median(v) for k, v in out.items()}
        res["direct"] = direct
        return res
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(work)


def measure_disk(dirs: Iterable[Optional[str]], *, request: int = 64 << 20, inflight: int = 2,
                 size: int = 256 << 20, reps: int = 3) -> dict:
    """read/write/mixed bytes/s of the state directories, each filesystem once, summed over them;
    ``direct``: whether every one took O_DIRECT."""
    request = max(4096, min(request, size) // 4096 * 4096)
    size = max(request, size // request * request)
    seen, total = set(), {"read": 0.0, "write": 0.0, "mixed": 0.0, "direct": True}
    for d in dirs:
        d = d or tempfile.gettempdir()
        dev = os.stat(d).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        r = _disk_one(d, size, request, inflight, reps)
        for k in ("read", "write", "mixed"):
            total[k] += r[k]
        total["direct"] &= r["direct"]
    return total


def measure_pcie(size: int = 256 << 20, reps: int = 5) -> Optional[dict]:
    """{'h2d', 'd2h'} bytes/s of pinned copies to and from the current GPU (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = {}
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        def timed(fn=fn):
            fn()
            torch.cuda.synchronize()
        out[name] = size / _median_time(timed, reps)
    return out


def measure(*, param_dtype=torch.float32, moments: str = "fp32", amsgrad: bool = False,
            threads: Optional[int] = None, dirs=None, request: int = 64 << 20, inflight: int = 2,
            cuda: bool = False, params: int = PROBE_PARAMS,
            state_bytes: int = 256 << 20) -> Bandwidths:
    """What a plan needs, measured here: the kernel always; the disk when ``dirs`` is given (a
    list: the state directories); PCIe when ``cuda`` and a GPU is present. ``params``,
    ``state_bytes``: the plan's sizes; the probes are no larger (a model that fits in the caches
    runs at cache speed) and no larger than 16M parameters / 256 MiB (enough to leave any
    cache)."""
    when = time.strftime("%Y-%m-%d %H:%M")
    bw = Bandwidths()
    n = max(1 << 20, min(PROBE_PARAMS, params))
    bw.kernel = measure_kernel(param_dtype=param_dtype, moments=moments, amsgrad=amsgrad,
                               threads=threads, numel=n)
    bw.sources["kernel"] = f"measured {when}: offload.AdamW.step on {n:,} parameters in RAM"
    if dirs is not None:
        d = measure_disk(dirs, request=request, inflight=inflight,
                         size=max(request, min(256 << 20, state_bytes)))
        bw.read, bw.write, bw.mixed = d["read"], d["write"], d["mixed"]
        where = ", ".join(x or tempfile.gettempdir() for x in dirs)
        for k in ("read", "write", "mixed"):
            bw.sources[k] = (f"measured {when} in {where} "
                             f"({'O_DIRECT' if d['direct'] else 'buffered'})")
    if cuda:
        p = measure_pcie()
        if p is not None:
            bw.h2d, bw.d2h = p["h2d"], p["d2h"]
            bw.sources["h2d"] = bw.sources["d2h"] = f"measured {when}: pinned copies"
    return bw


def _cases_of(moments) -> str:
    """The ``bench kernel`` cases that measure the kernel of a moment format."""
    return "moments" if moment_format(moments).compressed else "flat,bf16"


def _kernel_from(js: dict, path: str, moments: str, low: bool,
                 threads: Optional[int]) -> Optional[tuple]:
    """(bytes/s, label) of the matching kernel record: offload.AdamW.step of the flat case (fp32
    moments), or the compressed-moment kernel call of that format."""
    recs = [r if isinstance(r, dict) else {} for r in js.get("results", [])]
    if not moment_format(moments).compressed:   # measured by the fp32 kernel's cases
        prefix = "bf16 grad+out, flat" if low else "fp32 flat"
        cand = [i for i, r in enumerate(recs) if r.get("impl") == "offload.AdamW.step"
                and str(r.get("case", "")).startswith(prefix)]
    else:
        want = f"{moments} moments, {'bf16 grad+out' if low else 'fp32 grad'}"
        cand = [i for i, r in enumerate(recs)
                if r.get("case") == "moments" and r.get("impl") == want]
    if not cand:
        return None
    for i in cand:   # the figures used below: a hand-edited or truncated file is refused by name
        for key, kind in (("params", int), ("seconds", (int, float)), ("threads", int)):
            v = recs[i].get(key)
            if not _positive(v, kind):
                raise ValueError(f"{path}: kernel record {i} ({recs[i].get('case')}, "
                                 f"{recs[i].get('impl')}): {key} must be a positive "
                                 f"number, got {v!r}")
    cand = [recs[i] for i in cand]
    same = [r for r in cand if threads and r.get("threads") == threads]
    r = same[0] if same else max(cand, key=lambda r: r.get("threads", 0))
    bpp = pass_bytes(moments, 2 if low else 4, 2 if low else 0, False, r["params"])
    return (r["params"] * bpp / r["seconds"], f"{path}: {r['impl']}, {r['case']}, "
                                              f"{r['threads']} threads")


def from_json(paths: Union[str, Iterable[str]], *, moments: str = "fp32",
              param_dtype=torch.float32, threads: Optional[int] = None) -> Bandwidths:
    """Bandwidths from ``bench kernel --json`` and/or ``bench io --json`` files (a path, a list, or
    comma-separated). Kernel: the record matching the format and thread count (else the most
    threads); io: our I/O engine's medians (several drives: all at once)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [p for p in os.fspath(paths).split(",") if p]
    low = param_dtype in LOW_PRECISION
    bw = Bandwidths()
    for path in paths:
        js = _load(path)
        if js.get("bench") == "io":
            res = js.get("results")
            ours = js.get("aggregate") or (res.get("ours") if isinstance(res, dict) else 0) or {}
            if not isinstance(ours, dict) or "read" not in ours or "write" not in ours:
                raise ValueError(f"{path}: an io benchmark JSON without our I/O engine's "
                                 "read/write figures")
            bw.read, bw.write, bw.mixed = ours["read"], ours["write"], ours.get("mixed")
            for k in ("read", "write", "mixed"):
                bw.sources[k] = f"{path}: bench io in {js.get('dir') or js.get('dirs')}"
            if bw.mixed is None:
                bw.sources["mixed"] = (f"{path} has no mixed figure: reads and writes taken to "
                                       "run one after the other")
        elif isinstance(js.get("results"), list):
            got = _kernel_from(js, path, moments, low, threads)
            if got is None:
                raise ValueError(f"{path}: no kernel record for moments={moments!r} with "
                                 f"{'bf16' if low else 'fp32'} parameters; run python -m "
                                 "offload.bench kernel --cases "
                                 f"{_cases_of(moments)} --json {path}")
            bw.kernel, bw.sources["kernel"] = got
        else:
            raise ValueError(f"{path}: not a JSON of python -m offload.bench kernel or "
                             "io (--json PATH)")
    try:
        return bw.checked()
    except ValueError as e:
        raise ValueError(f"{', '.join(map(str, paths))}: {e}") from None


def _load(path) -> dict:
    """The JSON object in ``path``: a file that is not JSON, or holds no object, is refused."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a bandwidth JSON is named by a path, got {path!r}")
    with open(path) as f:
        try:
            js = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:   # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(js, dict):
        raise ValueError(f"{path}: not a JSON of python -m offload.bench kernel or "
                         "io (--json PATH)")
    return js


def _positive(v, kind) -> bool:
    """``v`` is a finite number > 0 of ``kind`` (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, kind) and 0 < v < math.inf
