"""steptime.py: the planner's step-time model: seconds of one optimizer step from a plan's buckets
and the bandwidths of offload/bandwidth.py.

Per state tier, with the plan's own buckets (the engine's layout: same bucket sizes, the same
budget split into ``depth + 2`` NVMe slots):
  ram (host parameters)   the kernel: the bytes one Adam pass moves / kernel bandwidth
  nvme                    a three-stage pipeline, bucket k computed while k+1 is read and k-1
                          written: fill (read bucket 0) + sum over k of max(kernel k, disk I/O
                          of reads k+1 and writes k-1) + drain (write the last bucket). The disk
                          I/O of a slot is at the ``mixed`` rate when it both reads and writes,
                          else at the read or write rate.
  device parameters       the gradients come down and the new weights go up per bucket (PCIe, both
                          directions at once): two more stages of the same pipeline
The model predicts the optimizer's own time once the gradients exist (what ``bench step``
measures); with device parameters the step can also hide behind backward, which the model does not
count. mmap state is not modelled (the page cache does its I/O inside the kernel's page faults).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .bandwidth import Bandwidths, pass_bytes
from .base.overlap import choose, cpu_end

__all__ = ["StepTime", "Stage", "pipeline_seconds", "predict", "split", "stages_of"]


@dataclass
class Stage:
    """One bucket's work in bytes: the Adam pass, the state read and written, the copies down and
    up."""
    kernel: float
    read: float = 0
    write: float = 0
    d2h: float = 0
    h2d: float = 0


@dataclass
class StepTime:
    """A predicted step: ``seconds`` and its parts (each the time that part alone would take)."""
    seconds: float
    parts: dict
    bottleneck: str
    buckets: int
    sources: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    # the iteration with state kept on the GPU (gpu_state=): :func:`split`
    split: Optional[dict] = None

    def to_dict(self) -> dict:
        return dict(seconds=self.seconds, parts=self.parts, bottleneck=self.bottleneck,
                    buckets=self.buckets, sources=self.sources, notes=self.notes, split=self.split)

    def __str__(self) -> str:
        alone = ", ".join(f"{k.replace('_s', '')} {v:.3f} s" for k, v in self.parts.items() if v)
        lines = [f"predicted step  {self.seconds:.3f} s  ({self.buckets} "
                 f"bucket{'s' * (self.buckets != 1)}; bound by {self.bottleneck}; alone: {alone})"]
        lines += [f"  {k:<7} {v}" for k, v in self.sources.items()]
        sp = self.split
        if sp is not None:
            lines.append(f"predicted iteration  {sp['iteration_s']:.3f} s with "
                         f"{sp['gpu_buckets']} of {self.buckets} buckets' state on the GPU "
                         f"({sp['gpu_bytes'] / 1e9:.2f} GB of {sp['budget'] / 1e9:.2f} GB; CPU "
                         f"step exposed {sp['exposed_s']:.3f} s), {sp['host_only_s']:.3f} s with "
                         f"every state on the host (exposed {sp['host_only_exposed_s']:.3f} s): "
                         f"forward {sp['forward_s']:.3f} s + backward "
                         f"{sp['backward_s']:.3f} s + exposed")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _need(value: Optional[float], what: str) -> float:
    if not value:
        raise ValueError(f"the step-time model needs the {what} bandwidth: measure it "
                         "(bandwidths='measure') or pass a JSON of python -m "
                         "offload.bench kernel/io")
    return value


def pipeline_seconds(stages: List[Stage], bw: Bandwidths) -> dict:
    """Seconds of the bucket pipeline: fill + sum of slots + drain, and what each part takes alone.

    slot k = max(kernel k, disk(read k+1, write k-1), d2h k+1, h2d k-1); fill = max(read 0, d2h 0);
    drain = max(write n-1, h2d n-1). One stage without transfers is just its kernel time."""
    n = len(stages)
    kbw = _need(bw.kernel, "kernel")
    has_disk = any(s.read or s.write for s in stages)
    has_pcie = any(s.d2h or s.h2d for s in stages)
    rbw = _need(bw.read, "disk read") if has_disk else None
    wbw = _need(bw.write, "disk write") if has_disk else None
    mbw = bw.disk_mixed() if has_disk else None
    d2h = _need(bw.d2h, "device-to-host copy") if has_pcie else None
    h2d = _need(bw.h2d, "host-to-device copy") if has_pcie else None

    def disk(r: float, w: float) -> float:
        if r and w:
            return (r + w) / mbw
        return r / rbw if r else w / wbw if w else 0.0

    def at(k: int, attr: str) -> float:
        return getattr(stages[k], attr) if 0 <= k < n else 0.0

    def pcie(k: int, attr: str, rate) -> float:
        return at(k, attr) / rate if rate else 0.0

    fill = max(disk(at(0, "read"), 0), pcie(0, "d2h", d2h)) if n else 0.0
    drain = max(disk(0, at(n - 1, "write")), pcie(n - 1, "h2d", h2d)) if n else 0.0
    slots, bound = 0.0, {"kernel": 0.0, "disk": 0.0, "copies": 0.0}
    for k in range(n):
        parts = {"kernel": stages[k].kernel / kbw,
                 "disk": disk(at(k + 1, "read"), at(k - 1, "write")),
                 "copies": max(pcie(k + 1, "d2h", d2h), pcie(k - 1, "h2d", h2d))}
        top = max(parts, key=parts.get)
        bound[top] += parts[top]
        slots += parts[top]
    bound["disk" if has_disk else "copies"] += fill + drain
    alone = {"kernel_s": sum(s.kernel for s in stages) / kbw}
    if has_disk:
        alone["read_s"] = sum(s.read for s in stages) / rbw
        alone["write_s"] = sum(s.write for s in stages) / wbw
    if has_pcie:
        alone["d2h_s"] = sum(s.d2h for s in stages) / d2h
        alone["h2d_s"] = sum(s.h2d for s in stages) / h2d
    names = {"kernel": "the kernel (memory bandwidth)", "disk": "the disk",
             "copies": "PCIe copies"}
    return dict(seconds=fill + slots + drain, fill_s=fill, drain_s=drain, alone=alone,
                bottleneck=names[max(bound, key=bound.get)])


def predict(stages: List[Stage], bw: Bandwidths, *, state: str) -> Optional[StepTime]:
    """The step time of a plan's stages (offload/planner.py builds them), or None for mmap
    state."""
    if state == "mmap":
        return None
    r = pipeline_seconds(stages, bw)
    notes = []
    if any(s.read for s in stages) and not bw.mixed:
        notes.append("no measurement of reads and writes at once: the disk is taken to serve them "
                     "one after the other")
    used = {k: v for k, v in bw.sources.items() if r["alone"].get(f"{k}_s")
            or (k == "mixed" and "read_s" in r["alone"])}
    return StepTime(seconds=r["seconds"], parts=dict(r["alone"], fill_s=r["fill_s"],
                                                     drain_s=r["drain_s"]),
                    bottleneck=r["bottleneck"], buckets=len(stages), sources=used, notes=notes)


def stages_of(layout, *, state: str, on_gpu: bool, grad_itemsize: Optional[int],
              amsgrad: bool) -> List[Stage]:
    """The pipeline stages of a layout (offload/state/layout.py) as the engine runs it: one kernel
    pass over the whole RAM state with host parameters, else one stage per bucket with its state
    reads and writes (nvme) and its gradient and weight copies (device parameters)."""
    stages = []
    for b in layout.buckets:
        kernel = 0.0
        for pc in b.pieces:
            g = grad_itemsize or pc.itemsize
            kernel += pc.n * pass_bytes(b.moments, g, pc.itemsize if b.master else 0, amsgrad,
                                        pc.n)
        io = b.nbytes if state == "nvme" else 0
        copy = b.stage_bytes if on_gpu else 0
        stages.append(Stage(kernel=kernel, read=io, write=io, d2h=copy, h2d=copy))
    if state == "ram" and not on_gpu:
        return [Stage(kernel=sum(s.kernel for s in stages))]
    return stages


def split(stages: List[Stage], layout, bw: Bandwidths, *, backward_s: float, forward_s: float,
          budget: int) -> dict:
    """The iteration of device parameters with the buckets backward reaches last keeping their
    state on the GPU (``gpu_state=``; schedule/split.py decides it by the same rule,
    base/overlap.py): gradients arrive in backward's order (the reverse of the layout), spread over
    ``backward_s`` by size; the CPU takes each bucket's pipeline slot (kernel, or its copies where
    longer); what it has not done when backward ends is exposed. ``budget``: the GPU bytes the
    state may take."""
    kbw = _need(bw.kernel, "kernel")
    d2h, h2d = bw.d2h or 0.0, bw.h2d or 0.0
    order = list(range(len(stages)))[::-1]
    elems = [sum(pc.n for pc in layout.buckets[k].pieces) for k in order]
    gpu = [sum(pc.n * (16 if pc.itemsize < 4 else 12) for pc in layout.buckets[k].pieces)
           for k in order]
    cpu = [max(stages[k].kernel / kbw, stages[k].d2h / d2h if d2h else 0.0,
               stages[k].h2d / h2d if h2d else 0.0)
           for k in order]
    total = sum(elems) or 1
    arrive, seen = [], 0
    for n in elems:
        arrive.append(backward_s * seen / total)
        seen += n
    k = choose(elems, arrive, cpu, backward_s, gpu, budget)
    n = len(order)
    exposed = max(0.0, cpu_end(arrive[:n - k], cpu[:n - k]) - backward_s)
    host = max(0.0, cpu_end(arrive, cpu) - backward_s)
    return dict(gpu_buckets=k, gpu_bytes=sum(gpu[n - k:]), budget=budget, exposed_s=exposed,
                iteration_s=forward_s + backward_s + exposed, host_only_exposed_s=host,
                host_only_s=forward_s + backward_s + host, forward_s=forward_s,
                backward_s=backward_s)

