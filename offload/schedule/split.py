"""schedule/split.py: how many buckets keep their Adam state on the GPU (``gpu_state=``), decided
from what the first steps measured.

Device parameters are stepped by the CPU as backward delivers their gradients; what the CPU has not
finished when backward ends is exposed, and the buckets backward reaches last (the model's first
layers, whose new weights the next forward needs first) are the worst placed. ``Split`` measures
one step with every bucket on the CPU (the second: the first warms allocators up; decided at the
third), models it (each bucket's gradients arrive in backward's order, spread over backward by
their size; the CPU takes each bucket's share of the measured kernel time) and keeps on the GPU the
fewest trailing buckets that let the CPU's part end inside backward, within the GPU memory the
option allows (schedule/resident.py ``choose``): ``"auto"`` what the device reports spare after the
peak so far (Device.spare_bytes), a size caps it, 0 keeps every bucket on the CPU. The model reads
host clocks (when backward queued each bucket): a host that runs ahead of the GPU sees a shorter
backward than the GPU's. So two steps after the first split it measures what stayed exposed (the
time the training thread waited for the CPU step and its uploads) and keeps that much more of the
CPU's buckets on the GPU, as the budget allows (never fewer); then the split is fixed. With the
step after backward (clipping, the overflow check) every gradient arrives at once, and the split
keeps as many buckets as the budget holds.
"""
from __future__ import annotations

from typing import List, Optional

from ..base.dist import in_process_group, local
from ..base.units import parse_size
from ..base.overlap import choose
from .resident import resident_bytes

__all__ = ["Split", "check_gpu_state", "effective"]

# the steps after which the split is decided, then refined, each from the step before (its uploads
# waited for by this step's forward: what stayed exposed is known)
DECIDE_AT = (3, 5)


def check_gpu_state(value):
    """``gpu_state=``: "auto", 0 / None (every bucket's state on the host), or bytes (an int >= 0
    or a size string such as "8GiB"); returns "auto" or the bytes."""
    if value is None or value == "auto" or (type(value) is int and value == 0):
        return value
    if isinstance(value, bool):
        raise ValueError(f"gpu_state must be 'auto', a size such as '8GiB' or 0, got {value!r}")
    try:
        n = parse_size(value)
    except (TypeError, ValueError) as e:
        raise ValueError("gpu_state must be 'auto', a size such as '8GiB' or 0, got "
                         f"{value!r} ({e})") from None
    if n < 0:
        raise ValueError(f"gpu_state must be 'auto', a size such as '8GiB' or 0, got {value!r}")
    return n


def effective(value, delayed: bool, storage: str):
    """What ``gpu_state=`` (checked) does in this configuration: "auto" or bytes, or 0 (off).
    "auto" (the default, None) turns itself off with the delayed update (whose parameters are all
    updated one step late), several torch.distributed ranks (each rank's own split would differ)
    and state on NVMe/mmap (moving state there means a second state file while it is laid out
    again); an explicit size is refused with the first two."""
    value = "auto" if value is None else check_gpu_state(value)
    if value == "auto":
        return 0 if delayed or in_process_group() or storage != "ram" else "auto"
    if value and delayed:
        raise ValueError("gpu_state cannot be combined with delay_updates=1 (the parameters "
                         "stepped on the GPU would be updated at once, the others one step "
                         "later): leave gpu_state unset or 0")
    if value and in_process_group():
        raise ValueError("gpu_state is not supported with torch.distributed ranks: "
                         "leave it unset or 0")
    return value


class Split:
    def __init__(self, option, device):
        self.option = option          # "auto" or bytes (0: off)
        self.device = device
        self.steps = 0
        self.resident: List = []      # the parameters whose state stays on the device
        self.applied([])

    def budget(self) -> int:
        """Device bytes the state kept there may take in all (what it takes already included)."""
        held = sum(resident_bytes(p) for p in self.resident)
        spare = self.device.spare_bytes() + held
        return spare if self.option == "auto" else min(int(self.option), spare)

    def after_step(self, schedule) -> Optional[list]:
        """After ``schedule``'s step(): the parameters whose state is to stay on the device from
        the next step on, where that changes now; None otherwise."""
        if not self.option:
            return None
        self.steps += 1
        if self.steps not in DECIDE_AT:
            return None
        st = schedule.last_step_stats()
        if not st or st.get("skipped") or not st.get("kernel_s"):
            self.steps -= 1   # (a skipped step measured nothing: the next one is measured instead)
            return None
        more = self.choose(schedule, st)
        return self.resident + more if more else None

    def choose(self, schedule, st: dict) -> list:
        """The parameters to add to those kept on the device, from the step ``st`` measured."""
        eng = schedule.engine
        buckets = eng.layout.buckets
        feed = schedule.feed
        order = [bi for bi in (feed.order if feed is not None else []) if bi < len(buckets)]
        order += [b.index for b in reversed(buckets) if b.index not in set(order)]
        elems = [sum(pc.n for pc in buckets[bi].pieces) for bi in order]
        total = sum(elems) or 1
        backward = float(st.get("backward_s") or 0.0) if schedule.eager else 0.0
        arrive, seen = [], 0
        for n in elems:
            arrive.append(backward * seen / total if backward else 0.0)
            seen += n
        cpu = [st["kernel_s"] * n / total for n in elems]
        groups = eng.groups
        params_of = [sorted({(buckets[bi].group, pc.param) for pc in buckets[bi].pieces})
                     for bi in order]
        gpu = [sum(resident_bytes(groups[gi][i]) for gi, i in ps) for ps in params_of]
        left = self.budget() - sum(resident_bytes(p) for p in self.resident)
        # refined: the CPU buckets whose time covers what stayed exposed, and a fifth
        if self.resident:
            k, need = 0, 1.2 * float(st.get("exposed_s") or 0.0)
            while need > 1e-3 and k < len(order) and sum(gpu[len(order) - k - 1:]) <= left:
                need -= cpu[len(order) - k - 1]
                k += 1
        else:
            k = choose(elems, arrive, cpu, backward if backward else -1.0, gpu, left)
        keep, used = [], 0
        for bi in range(len(order) - 1, len(order) - 1 - k, -1):   # trailing buckets, last first
            for gi, i in params_of[bi]:
                p = groups[gi][i]
                if any(p is q for q in keep) or local(p).numel() == 0:
                    continue
                # (a parameter also in a bucket the CPU keeps)
                if used + resident_bytes(p) > left:
                    return keep
                keep.append(p)
                used += resident_bytes(p)
        return keep

    def stats(self) -> dict:
        return dict(self.info)

    def applied(self, params: list) -> None:
        """The parameters now kept on the device."""
        self.resident = list(params)
        self.info = dict(gpu_state_params=len(params),
                         gpu_state_bytes=sum(resident_bytes(p) for p in params),
                         gpu_state_elements=sum(local(p).numel() for p in params))
