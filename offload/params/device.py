"""params/device.py: DeviceParams, parameters and gradients on a device (CUDA; CpuDevice/FakeDevice
in tests).

Streams buckets through a small ring of ``slots`` staging slots (pinned through the Device on
CUDA: the only page-locked host memory). Per bucket: gradients go down (D2H) into a slot, the
kernel reads them there and writes the new weights (parameter dtype) into the slot's out part,
and those go up (H2D) into the parameters. A slot is reused only after its upload finished.
The fp32 master of every piece is a state section, read from the parameter at its first step
(or after ``reload``). Nothing here knows where the state lives.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from ..base.dist import local
from ..native.adam import DTYPE_CODES
from ..state.tier import check_staging_slots
from .base import bump_stepped, check_grad
from .guards import check_overlaps
from .side import ParamSide

__all__ = ["DeviceParams", "piece"]


@dataclass
class Staged:
    slot: int
    d2h: object


def piece(buf: torch.Tensor, pc, dtype) -> torch.Tensor:
    """Piece ``pc``'s part of a staging buffer ``buf`` (its bucket's layout), as ``dtype``."""
    return buf[pc.boff:pc.boff + pc.n * pc.itemsize].view(dtype)


class DeviceParams(ParamSide):
    """The parameter side of device tensors (params/side.py: what each method does)."""
    all_masters = True   # the kernel writes new weights into a slot: each piece's master is state

    def __init__(self, groups, device, slots: int = 2, dtypes: Optional[list] = None):
        check_staging_slots(slots)
        super().__init__(groups)
        # per group, each parameter's dtype as laid out (the engine's list, which grows with
        # it): the staging slots are sized by it, whatever a parameter was cast to since
        self.dtypes = [[local(p).dtype for p in ps] for ps in groups] if dtypes is None else dtypes
        self.device = device
        self.nslots = slots
        self.slot_bytes = 0
        self.grad_bufs: List[torch.Tensor] = []
        self.out_bufs: List[torch.Tensor] = []
        self.slot_ev: List[Optional[object]] = []
        self._next = 0
        self._after = None
        self._last_up = None
        self._events: list = []       # (kind, event) of copies not yet counted; the worker appends
        self._events_lock = threading.Lock()

    @property
    def staging_slots(self) -> int:
        return self.nslots

    def stage_cap(self, budget_cap: Optional[int], bucket_bytes: Optional[int]) -> Optional[int]:
        return min(budget_cap or bucket_bytes, bucket_bytes) if bucket_bytes else budget_cap

    def collect(self, groups, local_groups, dtypes, numels, own, mode: str) -> tuple:
        active, grads = [], []
        for gi, params in enumerate(groups):
            a = np.zeros(len(params), dtype=bool)
            gs = [None] * len(params)
            for i, p in enumerate(params):
                g = p.grad
                if g is None:
                    continue
                check_grad(p, g, gi, i, dtypes[gi][i], numels[gi][i], mode, True)
                a[i] = True
                gs[i] = local(g)
            active.append(a)
            grads.append(gs)
        given = [(gi, i, g) for gi, gs in enumerate(grads) for i, g in enumerate(gs)
                 if g is not None]
        check_overlaps(local_groups, given, own, mode)
        return active, grads

    def allocate(self, layout) -> None:
        need = max(64, layout.max_stage_bytes)
        if need <= self.slot_bytes:
            return
        self.synchronize()
        grad_bufs = [self.device.host_empty(need, torch.uint8) for _ in range(self.nslots)]
        out_bufs = [self.device.host_empty(need, torch.uint8) for _ in range(self.nslots)]
        # (replaced only once all are made: a ring that cannot grow stays as it was)
        self.slot_bytes, self.grad_bufs, self.out_bufs = need, grad_bufs, out_bufs
        self.slot_ev = [None] * self.nslots

    @property
    def pinned_bytes(self) -> int:
        return 2 * self.nslots * self.slot_bytes

    # ------------------------------------------------------------------ one step
    def begin(self) -> None:
        """Everything the compute stream did so far (backward) comes before our copies."""
        self._after = self.device.record()

    def arrive(self, b, pieces, after=None) -> Staged:
        """D2H of the pieces' gradients into the next staging slot, after ``after`` (default: the
        event of ``begin()``; step_during_backward: the event recorded when the bucket was
        ready)."""
        s = self._next
        self._next = (s + 1) % self.nslots
        ev = self.slot_ev[s]
        if ev is not None:        # the slot's previous upload still reads its out part
            ev.synchronize()
            self.slot_ev[s] = None
        pairs = []
        for pc in pieces:
            g = self.grads[b.group][pc.param]
            pairs.append((piece(self.grad_bufs[s], pc, g.dtype),
                          g.reshape(-1)[pc.start:pc.start + pc.n]))
        ev = self.device.copy_to_host(pairs, self._after if after is None else after)
        with self._events_lock:
            self._events.append(("d2h", ev))
        self.stats["d2h_bytes"] += sum(d.numel() * d.element_size() for d, _ in pairs)
        return Staged(s, ev)

    def next_slot_free(self) -> bool:
        """Can ``arrive`` take the next staging slot without waiting for its previous upload?"""
        ev = self.slot_ev[self._next] if self.slot_ev else None
        return ev is None or ev.query()

    def ptrs(self, b, pieces, staged: Staged) -> list:
        staged.d2h.synchronize()
        gbuf, obuf = self.grad_bufs[staged.slot], self.out_bufs[staged.slot]
        out = []
        for pc in pieces:   # (the layout's dtype: a parameter cast since must not size the write)
            code = DTYPE_CODES[self.dtypes[b.group][pc.param]]
            out.append((0, gbuf.data_ptr() + pc.boff, code, obuf.data_ptr() + pc.boff, code))
        return out

    def flat_param(self, gi: int, i: int) -> torch.Tensor:
        """Parameter i of group gi as the flat tensor an upload writes: its own memory (``.data``:
        our own write must not look like a user's, version counter), never a temporary copy;
        RuntimeError if it was cast or made non-contiguous since it was checked (a write racing
        with the step)."""
        p, laid = local(self.groups[gi][i]).data, self.dtypes[gi][i]
        if p.dtype != laid:
            fix = (f"changed dtype ({laid} -> {p.dtype})",
                   f"cast the parameters back (e.g. model.to({laid}))")
        elif not p.is_contiguous():
            fix = (f"is not contiguous (strides {tuple(p.stride())})", "make it contiguous "
                   "(p.data = p.data.contiguous()): offload never updates a temporary copy")
        else:
            return p.view(-1)
        raise RuntimeError(f"offload: parameter {i} of group {gi} {fix[0]} while an update of it "
                           f"was still to be uploaded: {fix[1]}. Call optimizer.synchronize() "
                           "before changing parameters between steps")

    def stepped(self, active: list) -> None:
        """The step's new weights of the parameters ``active`` (per group, bool masks) are
        uploaded, or will be before anything waits for them: their version counters go up now, in
        step(), as after torch's in-place update (the uploads themselves write through ``.data``,
        in the worker and on the device's streams: a version moved there would race with the next
        forward's saved tensors). Called before the step's write tracking records the parameters
        (engine.commit, the device step's snapshot), so the step's own bump is not taken for a
        user's write."""
        bump_stepped(self.groups, active)

    def publish(self, b, pieces, staged: Staged, after=None):
        """H2D of the new weights from the slot (after ``after``: during backward, the compute
        stream's event recorded when the bucket's gradients were complete, so no queued kernel
        still reads them)."""
        dtypes, out = self.dtypes[b.group], self.out_bufs[staged.slot]
        pairs = [(self.flat_param(b.group, pc.param)[pc.start:pc.start + pc.n],
                  piece(out, pc, dtypes[pc.param])) for pc in pieces]
        ev = self.upload(pairs, after)
        self.slot_ev[staged.slot] = ev
        return ev

    def upload(self, pairs: list, after=None):
        """H2D of ``pairs`` ((parameter part, host source)) after ``after``, counted as an upload
        (``publishes``, ``stats``, ``collect_times``); ``finish`` makes the compute stream wait for
        the last one. Returns its event."""
        self.publishes += 1
        ev = self.device.copy_to_device(pairs, after)
        self._last_up = ev
        with self._events_lock:
            self._events.append(("h2d", ev))
        self.stats["h2d_bytes"] += sum(d.numel() * d.element_size() for d, _ in pairs)
        return ev

    def finish(self) -> None:
        """The compute stream waits for the last upload (streams are FIFO: for all of them)."""
        if self._last_up is not None:
            self.device.wait(self._last_up)
            self._last_up = None
        self.device.check()

    @property
    def uncounted_copies(self) -> int:
        """Copies whose times are not yet counted in ``stats`` (collect_times counts the finished
        ones)."""
        with self._events_lock:
            return len(self._events)

    def collect_times(self) -> None:
        with self._events_lock:   # (the worker appends meanwhile: no copy may be lost)
            events, self._events = self._events, []
        keep = []
        for kind, ev in events:
            if ev.query():
                self.stats[f"{kind}_s"] += ev.seconds()
                if self.trace is not None:
                    self.trace.span(kind, kind, ev.span())
            else:
                keep.append((kind, ev))
        with self._events_lock:
            self._events[:0] = keep

    def synchronize(self) -> None:
        for s, ev in enumerate(self.slot_ev):
            if ev is not None:
                ev.synchronize()
                self.slot_ev[s] = None
        self.device.synchronize()
        self.collect_times()

    # ------------------------------------------------------------------ masters, norms
    def read_master(self, gi: int, i: int, start: int, n: int, dst: torch.Tensor,
                    changed_only: bool = False, after=None) -> None:
        """dst = the parameter's elements [start, start + n). ``changed_only`` (a user wrote the
        parameter, dst holds its master): a bf16/fp16 parameter adopts only the elements that
        differ from round(master), as the host kernel does, so the others keep their fp32 master's
        precision. ``after``: the copy waits for it (the CPU worker passes its bucket's event from
        the compute stream: an event recorded on the worker's own thread would be on that thread's
        current stream, which is not ordered after a user's compute stream); default: the caller's
        stream now."""
        p = local(self.groups[gi][i]).detach().reshape(-1)[start:start + n]
        tmp = dst if p.dtype == torch.float32 else torch.empty(n, dtype=p.dtype)
        self.device.copy_to_host([(tmp, p)],
                                 self.device.record() if after is None else after).synchronize()
        if tmp is dst:
            return
        if changed_only:
            # bits: NaN payloads, -0.0
            same = tmp.view(torch.int16) == dst.to(tmp.dtype).view(torch.int16)
            dst.copy_(torch.where(same, dst, tmp.float()))
        else:
            dst.copy_(tmp)

    def grad_sumsq(self, grads, threads: int) -> float:
        grads = [local(g) for g in grads]
        if not grads:
            return 0.0
        # CpuDevice / FakeDevice
        if all(g.device.type == "cpu" and g.is_contiguous() for g in grads):
            from ..native.adam import grad_sumsq
            return grad_sumsq(grads, threads)
        # on the device: one scalar crosses
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return float(torch.stack(norms).double().square().sum().item())

    def info(self, layout) -> dict:
        per_bucket = [sum(pc.n * pc.itemsize for pc in b.pieces) for b in layout.buckets]
        return dict(staging_slots=self.nslots, staging_bytes=self.pinned_bytes,
                    bucket_param_bytes=per_bucket)

    def close(self) -> None:
        try:
            self.synchronize()
        except Exception:
            pass
