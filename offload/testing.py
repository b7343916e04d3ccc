"""testing.py: the supported way for tests and benchmarks to look inside an
``offload.Adam``/``AdamW``: its state engine, state tier, parameter side, device schedule and
device; the state's directory, file, bytes, buckets of a parameter and stored tensors; the cached
row checks (dropped on demand), the step plan, the device schedule's bookkeeping and trace; I/O
fault injection and a slow drive (``slow_drive``). It is the one module that reads the optimizer's
private attributes, so an internal rename touches this file only; nothing here is part of the
training API.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

__all__ = ["state_engine", "row_records", "tier", "side", "device_schedule", "device", "state_dir",
           "state_file", "state_bytes", "pieces_of", "raw_state", "drop_row_caches", "step_plan",
           "bookkeeping_sizes", "trace_spans", "inject_io_fault", "slow_drive"]


def state_engine(opt):
    """The state engine (offload/engine/engine.py) that runs the optimizer's steps, in every
    mode."""
    return opt._face.engine


def row_records(opt) -> list:
    """Per param group, the records of host parameters' rows that ``_C.collect_rows``
    (csrc/rows.cpp) reads and writes (params/hostrows.py GroupRows: ``params``, ``g_ref``,
    ``meta``, ``layouts``, ``table``); empty before the first step."""
    rows = side(opt).rows
    return rows.groups if rows is not None else []


def tier(opt):
    """Where the state lives (offload/state/): RamTier, NvmeTier or MmapTier."""
    return state_engine(opt).tier


def side(opt):
    """Where the parameters live (offload/params/): HostParams, DeviceParams or HeldParams."""
    return state_engine(opt).side


def device_schedule(opt) -> Optional[object]:
    """The device schedule (offload/schedule/device_step.py) of device parameters, else None."""
    return opt._face.schedule


def keep_on_device(opt, params) -> None:
    """Keep the Adam state of ``params`` on the device from now on, as ``gpu_state=`` decides after
    the first steps (schedule/split.py): what the split does, at a split the test chooses."""
    opt._face.keep_state_on_device(list(params))


def device(opt):
    """The offload.device.Device the device schedule copies through."""
    sched = device_schedule(opt)
    if sched is None:
        raise ValueError("this optimizer's parameters are not on a device")
    return sched.device


def state_dir(opt) -> str:
    """The directory of the optimizer's state file (state "nvme" or "mmap"; the first drive's with
    several)."""
    return tier(opt).directory


def state_file(opt) -> str:
    """The path of the optimizer's state file (state "nvme" or "mmap"; the first drive's with
    several)."""
    return tier(opt).path


def state_bytes(opt) -> int:
    """Bytes the layout gives the whole state (every bucket's master, moments, ...;
    offload/state/layout.py)."""
    return state_engine(opt).layout.nbytes


def _index(opt, p) -> tuple:
    for gi, group in enumerate(opt.param_groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                return gi, i
    raise ValueError("the tensor is not a parameter of this optimizer")


def pieces_of(opt, p) -> list:
    """The (bucket, piece) pairs parameter ``p``'s state is split into (offload/state/layout.py),
    in order."""
    return state_engine(opt).pieces[_index(opt, p)]


def raw_state(opt, p) -> dict:
    """Parameter ``p``'s state in its stored form (key -> tensor): fp32 views of master and fp32
    moments and, for compressed moments, copies of the compressed tensors under ``<key>.<format>``
    (offload/moments/format.py saved_key), as offload.save writes them."""
    return state_engine(opt).raw_state_tensors()[_index(opt, p)]


def drop_row_caches(opt) -> None:
    """Forget the cached per-row checks (params/hostrows.py, engine/torchstate.py's state records):
    the next step validates every row of parameters, gradients and ``opt.state`` from scratch."""
    eng = state_engine(opt)
    eng.side.rows = None
    eng.views.drop_records()


def step_plan(opt):
    """The plan the next step runs where nothing it depends on changed (offload/engine/fastpath.py
    StepPlan), or None: the next step runs in full. The same object while steps run as planned."""
    return state_engine(opt).plans.plan


def bookkeeping_sizes(opt) -> dict:
    """What a device schedule keeps between steps: ``copy_events`` (copies whose times are not
    counted yet) and ``step_records`` (steps whose statistics are not settled yet); both stay
    bounded."""
    return dict(copy_events=side(opt).uncounted_copies,
                step_records=len(device_schedule(opt).stats.records))


def trace_spans(opt) -> list:
    """The spans (name, lane, start, end) recorded so far by an optimizer made with
    ``trace=True``."""
    sched = device_schedule(opt)
    if sched is None or sched.trace is None:
        raise ValueError("this optimizer records no trace (device parameters and trace=True)")
    return sched.trace.spans()


def inject_io_fault(opt, kind: int, nth: int, drive: int = 0) -> None:
    """Make the NVMe tier's ``nth`` next system call fail with ``kind``
    (offload.native.aio.FAULT_EIO, ...); ``drive``: which directory of ``nvme_dir`` (several
    drives: each has its own I/O engine)."""
    target = state_engine(opt)
    drives = getattr(target.tier, "drives", None)
    if drives:
        target = drives[drive]
    target.aio._set_fault(kind, nth)


class _Late:
    """A request that completes no earlier than ``at`` (perf_counter seconds)."""

    def __init__(self, req, at: float):
        self.req, self.at = req, at

    def done(self) -> bool:
        return self.req.done() and time.perf_counter() >= self.at

    def wait(self, timeout=None) -> int:
        n = self.req.wait(timeout)
        time.sleep(max(0.0, self.at - time.perf_counter()))
        return n


class SlowAio:
    """An ``AioEngine`` whose drive serves one request per ``delay_s`` seconds at most (requests
    queue behind each other, as on a slow disk); the real transfer still happens (same bytes, same
    errors)."""

    def __init__(self, aio, delay_s: float):
        self.inner, self.delay_s = aio, float(delay_s)
        self.free_at = 0.0
        self.lock = threading.Lock()

    def _late(self, req):
        with self.lock:
            self.free_at = max(time.perf_counter(), self.free_at) + self.delay_s
            return _Late(req, self.free_at)

    def read(self, *a, **kw):
        return self._late(self.inner.read(*a, **kw))

    def write(self, *a, **kw):
        return self._late(self.inner.write(*a, **kw))

    def __getattr__(self, name):   # wait_all, outstanding, telemetry, close ...
        return getattr(self.inner, name)


def slow_drive(opt, drive: int, delay_s: float) -> None:
    """Make directory ``drive`` of the optimizer's ``nvme_dir`` a slow drive: each read or write of
    a bucket there completes ``delay_s`` after the previous one (tests, bench: what one slow drive
    costs)."""
    dr = tier(opt).drives[drive]
    dr.aio = SlowAio(dr.aio, delay_s)
