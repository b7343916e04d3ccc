"""store.py: optimizer state kept in one file on disk (``state="nvme"`` or ``state="mmap"``).

Layout. Parameters are packed, group by group, into *buckets*; a bucket holds the fp32 state of
a run of parameters (or pieces of one large parameter) as contiguous sections
``master | m | v [| vmax]`` and is padded to 4 KiB, so one bucket is one sequential request.
fp32 parameters have no master section: the parameter tensor is the model weight and stays in
RAM, the kernel updates it in place (a disk copy would only add 4 B/param of I/O each way).
bf16/fp16 parameters keep their fp32 master weights on disk and the kernel writes the rounded
weight back into the parameter. All buckets live in ONE preallocated file (posix_fallocate, so
a full disk fails at construction), created 0600 with O_EXCL|O_NOFOLLOW inside a new private
0700 directory (mkdtemp: a leftover directory of a crashed run is never reused).

Step (``nvme``). A pipeline over the buckets that have gradients: bucket k+1..k+depth are being
read while the kernel updates bucket k in a host buffer and bucket k-1 is written back. Host
memory is ``depth + 2`` buffers of at most ``host_budget / (depth + 2)`` bytes, whatever the
model size. State is created lazily at a parameter's first step exactly like the in-RAM mode
(zeros, master = the parameter), so results are bitwise identical to ``state="ram"``.

``mmap`` mode maps the same file and lets the kernel work on the mapping (the page cache does
the I/O); pages of a bucket are released from this process after its update.

After any failure inside a step the store refuses further use: parameters and state may be
partially updated, so continuing would silently train on garbage. Validation (gradients, sizes,
memory shared between gradients and parameters: offload/guards.py) happens before any I/O and
leaves the store usable.

Safety. step, state access and close() take one lock (close waits for a running step).
Tensors handed out by ``state_tensors()`` keep their mapping alive, also after close(). The
state belongs to the creating process: in a fork()ed child every use raises and the finalizer
touches nothing on disk. bf16/fp16 parameters written by the user between steps are re-read
into the master (guards.WriteTracker). The directory and its leftovers: offload/statedir.py.
"""
from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import re
import threading
import time
import weakref
from collections import deque
from typing import Optional

import numpy as np
import torch

from ._kernels import DTYPE_CODES, TASK_COLS, check_tensor, step_table
from .aio import AioEngine
from .buffers import ALIGN, HostArena, round_up
from . import statedir
from .guards import WriteTracker, check_overlaps, resync_master
from .statedir import STATE_FILE, find_stale_state, remove_stale_state

__all__ = ["StateStore", "parse_size", "StoreFailedError", "find_stale_state", "remove_stale_state"]

_LOW = (torch.bfloat16, torch.float16)
_ELEM = 16  # pieces start on 16-element (64-byte) boundaries inside a section


class StoreFailedError(RuntimeError):
    """The on-disk optimizer state can no longer be trusted (an earlier step failed)."""


def parse_size(x) -> int:
    """Bytes from an int or a string like '2GiB', '512MB', '64M', '1.5G' (binary multiples for 'K/M/G/T')."""
    if isinstance(x, bool):
        raise TypeError("size must be an int or a string like '2GiB'")
    if isinstance(x, int):
        if x <= 0:
            raise ValueError(f"size must be positive, got {x}")
        return x
    if not isinstance(x, str):
        raise TypeError(f"size must be an int or a string like '2GiB', got {type(x).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", x)
    if not m:
        raise ValueError(f"cannot parse size {x!r} (examples: '2GiB', '512MB', 1073741824)")
    unit = m.group(2).upper()
    decimal = m.group(3) is not None and m.group(3).lower() == "b" and unit != ""
    base = 1000 if decimal else 1024
    v = int(float(m.group(1)) * base ** " KMGT".index(unit or " ")) if unit else int(float(m.group(1)))
    if v <= 0:
        raise ValueError(f"size must be positive, got {x!r}")
    return v


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


class _Bucket:
    __slots__ = ("gi", "low", "nsec", "cap", "pieces", "offset", "nbytes")

    def __init__(self, gi: int, low: bool, nsec: int):
        self.gi, self.low, self.nsec = gi, low, nsec
        self.cap = 0          # elements per section (multiple of 16)
        self.pieces = []      # (param index in group, start element, n, position in section)
        self.offset = 0       # byte offset in the state file (4 KiB aligned)
        self.nbytes = 0       # 4 KiB-aligned size

    def section(self, s: int) -> int:
        """Byte offset of section s (0 = master or m ...) inside the bucket."""
        return s * self.cap * 4


def _make_private_dir(parent: str) -> str:
    """A new directory, mode 0700, only this process knows about (never an existing one)."""
    return statedir.make_private_dir(parent)


def _cleanup(engine, file, mapping, arena, directory: Optional[str], keep: bool, pid: int) -> None:
    if os.getpid() != pid:
        # a fork()ed child: the I/O threads, the file and the directory are the parent's. Only this
        # process's own copies of the descriptors are closed; nothing on disk is touched.
        if file is not None:
            file.close()
        return
    # Order matters: no transfer may be in flight when buffers or descriptors go away.
    if engine is not None:
        engine.close()
    if mapping is not None:
        # never munmap here: state_dict() tensors are views of the mapping and keep the mmap object
        # alive (torch.frombuffer holds a reference); it is unmapped when the last of them dies
        mapping.clear()
    if file is not None:
        file.close()
    if arena is not None:
        arena.close()
    if directory:
        if keep:
            statedir.mark_kept(directory)
        else:
            statedir.remove_own(directory)


class StateStore:
    """Optimizer state of every parameter of ``param_groups`` in one file under ``nvme_dir``."""

    def __init__(self, param_groups: list, *, mode: str = "nvme", nvme_dir: Optional[str] = None,
                 host_budget="2GiB", keep: bool = False, depth: int = 2, queue_depth: int = 8,
                 block_size: int = 1 << 20, direct: bool = True):
        if mode not in ("nvme", "mmap"):
            raise ValueError(f"mode must be 'nvme' or 'mmap', got {mode!r}")
        if not isinstance(depth, int) or not 1 <= depth <= 64:
            raise ValueError(f"depth (buckets read ahead) must be an int in [1, 64], got {depth!r}")
        self.mode = mode
        self.depth = depth
        self.keep = bool(keep)
        self.budget = parse_size(host_budget)
        if nvme_dir is None:
            raise ValueError(f"state={mode!r} needs nvme_dir: a directory on the disk that will hold the state file")
        nvme_dir = os.fspath(nvme_dir)
        if not os.path.exists(nvme_dir):
            raise FileNotFoundError(errno.ENOENT, "nvme_dir does not exist", nvme_dir)
        if not os.path.isdir(nvme_dir):
            raise NotADirectoryError(errno.ENOTDIR, "nvme_dir is not a directory", nvme_dir)
        self.nvme_dir = nvme_dir
        # the parameters as laid out; hyperparameters are read from the optimizer's groups each step
        self._params = [list(g["params"]) for g in param_groups]
        self._dtypes = [[p.dtype for p in ps] for ps in self._params]
        self.arena = None
        self._mapping = None
        check_overlaps(self._params, (), None, mode)  # a parameter listed twice...: refused before any file exists
        self._failed: Optional[BaseException] = None
        self._pid = os.getpid()  # the state (file, I/O threads, mapping) belongs to this process only
        self._lock = threading.RLock()  # step / state access / close never overlap (close waits)
        self.engine = None
        self.file = None
        self.arena = None
        self._mapping = None
        self.directory = None

        # ---- layout
        nslots = depth + 2 if mode == "nvme" else 1
        slot_bytes = self.budget // nslots // ALIGN * ALIGN
        self.amsgrad = [bool(g["amsgrad"]) for g in param_groups]
        min_bytes = 4 * 4 * _ELEM  # one 16-element piece of four sections
        if mode == "nvme" and slot_bytes < round_up(min_bytes, ALIGN):
            raise ValueError(f"host_budget={host_budget!r} is too small: need at least {nslots} buffers of "
                             f"{ALIGN} bytes ({nslots * ALIGN} bytes)")
        if mode == "mmap":
            slot_bytes = max(slot_bytes, ALIGN)  # mmap buckets only bound what is released at a time
        self.slot_bytes = slot_bytes
        self.buckets: list = []
        self.pieces: dict = {}  # (gi, i) -> [(bucket, start, n, pos)]
        self._layout(slot_bytes)
        self.file_bytes = max(ALIGN, sum(b.nbytes for b in self.buckets))  # never an empty file (mmap)
        # step counts (fp32 like torch's), one vector per group; state['step'] are 0-dim views
        self.steps = [torch.zeros(len(ps), dtype=torch.float32) for ps in self._params]
        self.ready = [np.zeros(len(ps), dtype=bool) for ps in self._params]
        # bf16/fp16 params written by the user since their master on disk last matched them
        self._writes = WriteTracker(self._params)
        self.telemetry = dict(steps=0, bytes_read=0, bytes_written=0, read_wait_s=0.0, write_wait_s=0.0,
                              kernel_s=0.0, step_s=0.0, buckets=len(self.buckets), file_bytes=self.file_bytes,
                              slot_bytes=slot_bytes, slots=nslots, direct=None)

        # ---- file
        statedir.warn_stale(nvme_dir)  # leftovers of killed runs: say where, how big, how to remove them
        try:
            self.directory = _make_private_dir(nvme_dir)
        except OSError as e:
            raise OSError(e.errno, f"cannot create the optimizer state directory in {nvme_dir}: "
                                   f"{os.strerror(e.errno)}", nvme_dir) from e
        self._finalizer = weakref.finalize(self, _cleanup, None, None, None, None, self.directory, self.keep,
                                           self._pid)
        statedir.write_marker(self.directory)
        self.path = os.path.join(self.directory, STATE_FILE)
        if mode == "nvme":
            self.engine = AioEngine(queue_depth=queue_depth, block_size=block_size)
            self.file = self.engine.open(self.path, create=True, direct=direct, mode=0o600)
        else:
            from .aio import AioFile
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self.file = AioFile(self.path, fd, -1, False)
        self.telemetry["direct"] = bool(self.file.direct)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self.engine, self.file, None, None, self.directory,
                                           self.keep, self._pid)
        self._reserve()
        if mode == "nvme":
            # no larger than the largest bucket: a small model under a big budget allocates (and,
            # with CUDA, pins) only what it can use
            self.arena = HostArena(nslots, max([b.nbytes for b in self.buckets] + [ALIGN]))
            self.slot_bytes = self.telemetry["slot_bytes"] = self.arena.slot_bytes
        else:
            mm = mmap.mmap(self.file.fd, self.file_bytes, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
            self._mapping = [mm, torch.frombuffer(mm, dtype=torch.uint8)]
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self.engine, self.file, self._mapping, self.arena,
                                           self.directory, self.keep, self._pid)

    # ------------------------------------------------------------------ construction
    def _layout(self, slot_bytes: int) -> None:
        offset = 0

        def close(b: _Bucket):
            nonlocal offset
            if not b.pieces:
                return
            b.nbytes = round_up(b.nsec * b.cap * 4, ALIGN)
            b.offset = offset
            offset += b.nbytes
            self.buckets.append(b)

        for gi, params in enumerate(self._params):
            open_b: dict = {}
            for i, p in enumerate(params):
                low = p.dtype in _LOW
                nsec = (1 if low else 0) + 2 + (1 if self.amsgrad[gi] else 0)
                cap_max = slot_bytes // (4 * nsec) // _ELEM * _ELEM
                n = p.numel()
                self.pieces[(gi, i)] = []
                start = 0
                while start < n:
                    b = open_b.get(low)
                    # a parameter that fits in one bucket is never split (its state_dict tensors
                    # are then plain views of the file); larger ones fill buckets piece by piece
                    fits_alone = start == 0 and n <= cap_max
                    if b is None or b.cap >= cap_max or (fits_alone and b.cap + n > cap_max):
                        if b is not None:
                            close(b)
                        b = open_b[low] = _Bucket(gi, low, nsec)
                    take = min(n - start, cap_max - b.cap)
                    piece = (i, start, take, b.cap)
                    b.pieces.append(piece)
                    self.pieces[(gi, i)].append((b, start, take, b.cap))
                    b.cap += round_up(take, _ELEM)
                    start += take
            for b in open_b.values():
                close(b)

    def _reserve(self) -> None:
        try:
            os.posix_fallocate(self.file.fd, 0, self.file_bytes)
        except OSError as e:
            try:
                st = os.statvfs(self.directory)
                free = f"{_human(st.f_bavail * st.f_frsize)} available"
            except OSError:
                free = "free space unknown"
            self.close()
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise OSError(e.errno, f"not enough space in {self.nvme_dir} for the optimizer state file: needs "
                                       f"{_human(self.file_bytes)} ({self.file_bytes} bytes), {free}",
                              self.path) from None
            raise OSError(e.errno, f"cannot reserve {self.file_bytes} bytes for the optimizer state: "
                                   f"{os.strerror(e.errno)}", self.path) from None

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for outstanding I/O, release buffers and delete the state (unless ``keep``).

        A step (or state access) running in another thread finishes first. Tensors handed out by
        ``state_tensors()`` stay valid: they keep the memory they view alive. In a fork()ed child
        this only closes the child's copies of the descriptors (the state stays the parent's).
        """
        if os.getpid() != self._pid:
            self._finalizer()
            return
        with self._lock:
            self._finalizer()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"the {self.mode} optimizer state of process {self._pid} cannot be used after fork() (this is "
                f"process {os.getpid()}): its state file, mapping and I/O threads belong to the parent. Create "
                "the optimizer in the child (or start it with the 'spawn' method)")

    @contextlib.contextmanager
    def _using(self):
        """Exclusive use of the store: right process, not closed, not failed; close() waits for it."""
        self._check_process()
        with self._lock:
            self._check_usable()
            yield

    def _check_usable(self) -> None:
        self._check_process()
        if self._failed is not None:
            raise StoreFailedError(
                f"the {self.mode} optimizer state in {self.path} is unusable after an earlier failure "
                f"({type(self._failed).__name__}: {self._failed}); parameters and state may be partially "
                "updated. Restore model and optimizer from a checkpoint.") from self._failed
        if self.closed:
            raise RuntimeError("the optimizer's state store is closed")

    def _fail(self, exc: BaseException) -> None:
        try:  # a copy without the traceback: its frames would keep the step's gradients alive
            self._failed = type(exc)(*exc.args)
        except Exception:
            self._failed = RuntimeError(f"{type(exc).__name__}: {exc}")
        if self.engine is not None:
            self.engine.wait_all()  # nothing may still write into buffers or the file

    # ------------------------------------------------------------------ step
    def _check_groups(self, groups: list) -> None:
        if len(groups) != len(self._params) or any(
                len(g["params"]) != len(ps) or any(a is not b for a, b in zip(g["params"], ps))
                for g, ps in zip(groups, self._params)):
            raise RuntimeError(f"the optimizer's parameters changed since it was created with state={self.mode!r} "
                               "(the state file is laid out for the original parameter list)")

    def _collect(self, opt) -> tuple:
        """Validate grads/params of every group (before any I/O) and return per-group
        (active mask, hyperparameters, gradients): the step uses exactly the tensors checked here."""
        info = []
        self._check_groups(opt.param_groups)
        for gi, group in enumerate(opt.param_groups):
            if bool(group["amsgrad"]) != self.amsgrad[gi]:
                raise ValueError(f"group {gi}: amsgrad cannot change after construction with state={self.mode!r}")
            params = self._params[gi]
            active = np.zeros(len(params), dtype=bool)
            grads = [None] * len(params)
            for i, p in enumerate(params):
                g = p.grad
                if g is None:
                    continue
                if p.numel() != sum(pc[2] for pc in self.pieces[(gi, i)]):
                    raise RuntimeError(f"parameter {i} of group {gi} changed size since the optimizer was created")
                if p.dtype != self._dtypes[gi][i]:  # the bucket layout depends on it (master section or not)
                    raise RuntimeError(f"parameter {i} of group {gi} changed dtype ({self._dtypes[gi][i]} -> "
                                       f"{p.dtype}) since the optimizer was created with state={self.mode!r}")
                check_tensor(p, f"parameter {i}", dtypes=(torch.float32,) + _LOW)
                check_tensor(g, f"gradient of parameter {i}", dtypes=(p.dtype,), shape=p.shape)
                active[i] = True
                grads[i] = g
            h = opt._group_hyper(group) if active.any() else None
            if h is not None:  # the native kernel refuses these too, but only after I/O has started
                for k in ("lr", "eps", "weight_decay", "beta1", "beta2"):
                    if not math.isfinite(h[k]):
                        raise ValueError(f"group {gi}: {k} = {h[k]} is not finite")
            info.append((active, h, grads))
        check_overlaps(self._params, [(gi, i, g) for gi, (_, _, gs) in enumerate(info) for i, g in enumerate(gs)
                                      if g is not None], self._own_memory(), self.mode)
        return info

    def _own_memory(self) -> Optional[torch.Tensor]:
        return self.arena.memory if self.arena is not None else (self._mapping[1] if self._mapping else None)

    def step(self, opt, grad_multiplier: float, threads: int) -> None:
        self._check_process()
        with self._lock:
            self._step(opt, grad_multiplier, threads)

    def _step(self, opt, grad_multiplier: float, threads: int) -> None:
        self._check_usable()
        info = self._collect(opt)
        t0 = time.perf_counter()
        jobs = []
        for b in self.buckets:
            active = info[b.gi][0]
            act = [pc for pc in b.pieces if active[pc[0]]]
            if act:
                ready = self.ready[b.gi]
                jobs.append((b, act, any(ready[pc[0]] for pc in b.pieces)))
        resync = self._writes.written(self.ready)
        try:
            for gi, (active, h, _) in enumerate(info):
                if active.any():
                    self.steps[gi][torch.from_numpy(active)] += 1
                    for i in np.flatnonzero(active):
                        p = self._params[gi][i]
                        st = opt.state[p]
                        if "step" not in st:
                            st["step"] = self.steps[gi][int(i)]
            if self.mode == "nvme":
                self._run_pipeline(jobs, info, grad_multiplier, threads, resync=resync)
            else:
                self._run_mapped(jobs, info, grad_multiplier, threads, resync)
            for gi, (active, h, _) in enumerate(info):
                self.ready[gi] |= active
                self._writes.record(gi, np.flatnonzero(active))
        except BaseException as e:
            self._fail(e)
            raise
        self.telemetry["steps"] += 1
        self.telemetry["step_s"] += time.perf_counter() - t0

    def _prepare(self, b: _Bucket, act: list, buf: torch.Tensor, resync=()) -> None:
        """First step of a parameter: create its state in the buffer as the in-RAM mode would.
        A bf16/fp16 parameter written by the user since the last step (``resync``): take the new
        value into the master, only where the parameter no longer equals the rounded master (the
        other elements keep their fp32 precision)."""
        ready = self.ready[b.gi]
        f32 = buf.view(torch.float32)
        params = self._params[b.gi]
        if b.low and resync:
            for (i, start, n, pos) in act:
                if (b.gi, i) in resync:
                    resync_master(f32[pos:pos + n], params[i].detach().reshape(-1)[start:start + n])
        for (i, start, n, pos) in b.pieces:
            if ready[i]:
                continue
            for s in range(b.nsec):
                sec = f32[s * b.cap + pos: s * b.cap + pos + n]
                if s == 0 and b.low:
                    sec.copy_(params[i].detach().reshape(-1)[start:start + n])
                else:
                    sec.zero_()

    def _table(self, b: _Bucket, act: list, base: int, grads: list) -> np.ndarray:
        t = np.zeros((len(act), TASK_COLS), dtype=np.int64)
        params = self._params[b.gi]
        steps = self.steps[b.gi].numpy()
        off = 1 if b.low else 0
        for r, (i, start, n, pos) in enumerate(act):
            p = params[i]
            g = grads[i]
            row = t[r]
            if b.low:
                row[0] = base + pos * 4
                row[5] = p.data_ptr() + start * p.element_size()
                row[9] = DTYPE_CODES[p.dtype]
            else:
                row[0] = p.data_ptr() + start * 4
            row[1] = base + b.section(off) + pos * 4
            row[2] = base + b.section(off + 1) + pos * 4
            row[3] = base + b.section(off + 2) + pos * 4 if self.amsgrad[b.gi] else 0
            row[4] = g.data_ptr() + start * g.element_size()
            row[6] = n
            row[7] = int(steps[i])
            row[8] = DTYPE_CODES[g.dtype]
        return t

    def _kernel(self, b: _Bucket, act: list, base: int, info, mult: float, threads: int) -> None:
        _, h, grads = info[b.gi]
        table = self._table(b, act, base, grads)
        t = time.perf_counter()
        step_table(table, h, mult, threads)
        self.telemetry["kernel_s"] += time.perf_counter() - t

    def io_pass(self) -> float:
        """Benchmark helper: read and write back every bucket through the step's pipeline without
        computing (data unchanged). Returns the seconds it took: the I/O-only time of a full step."""
        with self._using():
            if self.mode != "nvme":
                raise RuntimeError("io_pass() measures the nvme pipeline")
            saved = dict(self.telemetry)
            t = time.perf_counter()
            try:
                self._run_pipeline([(b, b.pieces, True) for b in self.buckets], None, 1.0, 0, compute=False)
            except BaseException as e:
                self._fail(e)
                raise
            dt = time.perf_counter() - t
        self.telemetry = saved
        return dt

    def _run_pipeline(self, jobs: list, info, mult: float, threads: int, compute: bool = True,
                      resync=()) -> None:
        eng, f, slots = self.engine, self.file, self.arena.slots
        free = list(range(len(slots)))[::-1]
        reads: deque = deque()
        writes: deque = deque()
        tel = self.telemetry

        def retire_write():
            s, req = writes.popleft()
            t = time.perf_counter()
            tel["bytes_written"] += req.wait()
            tel["write_wait_s"] += time.perf_counter() - t
            free.append(s)

        nxt = 0
        for k in range(len(jobs)):
            while nxt < len(jobs) and nxt <= k + self.depth:
                b, act, need_read = jobs[nxt]
                if not free:
                    retire_write()
                s = free.pop()
                req = eng.read(f, slots[s], b.offset, b.nbytes) if need_read else None
                reads.append((s, req))
                nxt += 1
            b, act, _ = jobs[k]
            s, req = reads.popleft()
            if req is not None:
                t = time.perf_counter()
                tel["bytes_read"] += req.wait()
                tel["read_wait_s"] += time.perf_counter() - t
            buf = slots[s]
            if compute:
                self._prepare(b, act, buf, resync)
                self._kernel(b, act, buf.data_ptr(), info, mult, threads)
            writes.append((s, eng.write(f, buf, b.offset, b.nbytes)))
        while writes:
            retire_write()

    def _run_mapped(self, jobs: list, info, mult: float, threads: int, resync=()) -> None:
        mm, base_t = self._mapping
        base = base_t.data_ptr()
        for b, act, _ in jobs:
            view = base_t[b.offset:b.offset + b.nbytes]
            self._prepare(b, act, view, resync)
            self._kernel(b, act, base + b.offset, info, mult, threads)
            if hasattr(mmap, "MADV_DONTNEED") and b.nbytes >= mmap.PAGESIZE:
                # dirty pages stay in the page cache (written back by the kernel); only our RSS drops
                mm.madvise(mmap.MADV_DONTNEED, b.offset, b.nbytes)

    # ------------------------------------------------------------------ state_dict
    def _keys(self, gi: int, low: bool) -> list:
        keys = (["master_param"] if low else []) + ["exp_avg", "exp_avg_sq"]
        return keys + (["max_exp_avg_sq"] if self.amsgrad[gi] else [])

    def _state_mapping(self):
        if self.mode == "mmap":
            return self._mapping[0]
        # A fresh shared mapping after all direct writes completed reads what is on disk.
        return mmap.mmap(self.file.tail_fd if self.file.tail_fd >= 0 else self.file.fd,
                         self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def state_tensors(self) -> dict:
        """(gi, i) -> {key: fp32 tensor} for every parameter that has state.

        Tensors are views of a shared mapping of the state file (no copy; like torch's state_dict
        they alias the live state), except for a parameter split over several buckets, whose
        pieces are concatenated into one tensor. Every tensor keeps the memory it views alive, also
        after ``close()`` (the state file's disk space is released when the last of them is gone).
        """
        with self._using():
            return self._state_tensors()

    def _state_tensors(self) -> dict:
        if self.engine is not None:
            self.engine.wait_all()
        mm = self._state_mapping()
        out = {}
        for gi, params in enumerate(self._params):
            for i, p in enumerate(params):
                if not self.ready[gi][i] and p.numel() > 0:
                    continue
                pcs = self.pieces[(gi, i)]
                low = p.dtype in _LOW
                st = {}
                for s, key in enumerate(self._keys(gi, low)):
                    views = [torch.frombuffer(mm, dtype=torch.float32, count=n,
                                              offset=b.offset + b.section(s) + pos * 4)
                             for (b, start, n, pos) in pcs]
                    if not views:
                        t = torch.zeros(p.shape, dtype=torch.float32)
                    elif len(views) == 1:
                        t = views[0].view(p.shape)
                    else:
                        t = torch.cat(views).view(p.shape)
                    st[key] = t
                out[(gi, i)] = st
        return out

    def load(self, entries: dict) -> None:
        """Replace the whole state by ``entries`` ((gi, i) -> state dict), bucket by bucket.
        Parameters without an entry start afresh at their next step (as with torch's loader).

        Missing 'master_param' of a bf16/fp16 parameter is taken from the parameter (a state
        saved by torch.optim). Sizes are checked before anything is written.
        """
        with self._using():
            self._load(entries)

    def _load(self, entries: dict) -> None:
        for (gi, i), st in entries.items():
            p = self._params[gi][i]
            for key in self._keys(gi, p.dtype in _LOW):
                if key == "master_param" and key not in st:
                    continue
                if key == "max_exp_avg_sq" and key not in st:
                    continue
                if key not in st:
                    raise KeyError(f"state of parameter {i} of group {gi} has no '{key}'")
                t = st[key]
                if not isinstance(t, torch.Tensor) or t.numel() != p.numel():
                    raise ValueError(f"state '{key}' of parameter {i} of group {gi} does not match the "
                                     f"parameter's {p.numel()} elements")
        try:
            for b in self.buckets:
                hit = [pc for pc in b.pieces if (b.gi, pc[0]) in entries]
                if not hit:
                    continue
                if self.mode == "nvme":
                    buf = self.arena.slots[0]  # the rest of the bucket is not ready after the load
                else:
                    buf = self._mapping[1][b.offset:b.offset + b.nbytes]
                f32 = buf.view(torch.float32)
                params = self._params[b.gi]
                for (i, start, n, pos) in hit:
                    st, p = entries[(b.gi, i)], params[i]
                    for s, key in enumerate(self._keys(b.gi, b.low)):
                        dst = f32[s * b.cap + pos: s * b.cap + pos + n]
                        src = st.get(key)
                        if src is None:
                            src = p if key == "master_param" else None
                        if src is None:
                            dst.zero_()
                        else:
                            dst.copy_(src.detach().reshape(-1)[start:start + n])
                if self.mode == "nvme":
                    self.engine.write(self.file, buf, b.offset, b.nbytes).wait()
                    self.telemetry["bytes_written"] += b.nbytes
            for gi in range(len(self._params)):  # like torch: parameters missing from the saved state start fresh
                self.ready[gi][:] = False
                self.steps[gi].zero_()
            for (gi, i), st in entries.items():
                v = st.get("step", 0.0)
                self.steps[gi][i] = float(v.item() if isinstance(v, torch.Tensor) else v)
                self.ready[gi][i] = True
                self._writes.record(gi, [i])  # the loaded master is the truth for the parameter as it is now
        except BaseException as e:
            self._fail(e)
            raise

    def info(self) -> dict:
        d = dict(self.telemetry)
        d.update(mode=self.mode, path=self.path, depth=self.depth, host_budget=self.budget)
        if self.engine is not None:
            d["engine"] = self.engine.telemetry()
        return d
