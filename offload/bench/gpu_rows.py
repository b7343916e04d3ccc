"""bench/gpu_rows.py: the rows of ``python -m offload.bench gpu`` that are not peers: what a row is
(a Row builds a Trainer from the model), forward + backward alone, torch's fused AdamW on the GPU
with an fp32 master, and offload in its schedules; and the clocks a row is timed with (CUDA events,
or the host's).

A row is a way to train the same GPT (offload/bench/gpt.py) from the same initial weights on the
same batches. The peers' rows are in offload/bench/gpu_peers.py; offload/bench/gpu_child.py times
one row.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .gpt import PRESETS, param_groups


@dataclass
class Setup:
    """What every row of one size shares."""
    size: str
    device: torch.device
    batch: int
    lr: float = 1e-4
    bucket_mb: Optional[float] = None   # None: offload's default

    @property
    def cfg(self):
        return PRESETS[self.size]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Trainer:
    """A model and whatever updates it: ``iteration`` runs forward, backward and the update and
    returns the loss (not read back yet: reading it would wait for the GPU); ``finish`` waits until
    the last update landed; ``threads`` names the thread counts the row's library chose."""

    def __init__(self, model, opt=None, *, finish: Optional[Callable] = None,
                 close: Optional[Callable] = None, threads: Optional[dict] = None):
        self.model, self.opt = model, opt
        self._finish, self._close = finish, close
        self.threads = dict(threads or {})

    def iteration(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        return loss.detach()

    def finish(self) -> None:
        if self._finish is not None:
            self._finish()

    def close(self) -> None:
        if self._close is not None:
            self._close()


@dataclass
class Row:
    name: str
    label: str
    build: Callable   # (setup, model) -> Trainer; the model is fp32 on the device
    needs: tuple = ()   # modules that must be importable
    cuda_only: bool = False
    note: str = ""
    offload: bool = False
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# rows
class SplitTrainer(Trainer):
    """Forward + backward alone, with the forward and the backward timed apart (the targets'
    terms)."""

    def __init__(self, model, setup):
        super().__init__(model)
        self.setup, self.fwd, self.bwd = setup, [], []

    def iteration(self, x, y):
        a = mark(self.setup)
        loss = self.model(x, y)
        b = mark(self.setup)
        loss.backward()
        c = mark(self.setup)
        self.model.zero_grad(set_to_none=True)
        self.fwd.append((a, b))
        self.bwd.append((b, c))
        return loss.detach()

    def split(self, skip: int) -> dict:
        sync(self.setup)
        return {"fwd_ms": span_median(self.setup, self.fwd[skip:]),
                "bwd_ms": span_median(self.setup, self.bwd[skip:])}


def _baseline(setup, model):
    return SplitTrainer(model.to(torch.bfloat16), setup)


class MasterAdamW:
    """Exact mixed-precision Adam on the GPU with torch's own pieces: bf16 weights for compute, an
    fp32 master and fp32 moments stepped by ``torch.optim.AdamW(fused=True)``; each bf16 gradient
    is turned into the master's fp32 gradient as soon as it is accumulated (18 B/param at the
    step)."""

    def __init__(self, model, lr):
        self.pairs = [(p, p.detach().float()) for p in model.parameters()]
        master = {id(p): m for p, m in self.pairs}
        groups = [dict(g, params=[master[id(p)] for p in g["params"]])
                  for g in param_groups(model, 0.1)]
        self.opt = torch.optim.AdamW(groups, lr=lr, fused=True)
        for p, m in self.pairs:
            p.register_post_accumulate_grad_hook(lambda p, m=m: self._to_master(p, m))

    @staticmethod
    def _to_master(p, m):
        m.grad = p.grad.float()
        p.grad = None

    @torch.no_grad()
    def step(self):
        self.opt.step()
        torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def zero_grad(self, set_to_none=True):
        for p, m in self.pairs:
            p.grad = m.grad = None


def _torch_fused(setup, model):
    # master from the fp32 weights, then the model goes bf16
    master = MasterAdamW(model, setup.lr)
    return Trainer(model.to(torch.bfloat16), master)


def offload_row(**opts):
    def build(setup, model):
        import offload
        model = model.to(torch.bfloat16)
        kw = dict(opts)
        if setup.bucket_mb is not None:
            kw["bucket_mb"] = setup.bucket_mb
        dev = None
        # the device schedule, on the CPU: the fake device (timings mean nothing)
        if not setup.cuda:
            from offload.device import FakeDevice
            dev = kw["offload_device"] = FakeDevice(max_delay=0.0, poison=False, check=False)
        opt = offload.AdamW(param_groups(model, 0.1), lr=setup.lr, **kw)

        def close():
            opt.close()
            if dev is not None:
                dev.close()
        threads = {"offload": opt.kernel_threads or offload.kernels.get_num_threads()}
        return Trainer(model, opt, finish=opt.synchronize, close=close, threads=threads)
    return build


def our_rows() -> list:
    """Forward + backward alone, torch's fused AdamW on the GPU and offload's rows (priority order:
    offload/bench/gpu.py)."""
    return [
        Row("baseline", "forward + backward alone", _baseline),
        Row("torch_fused", "torch AdamW(fused) on the GPU, fp32 master", _torch_fused,
            note="fp32 master and moments on the GPU (18 B/param at the step)"),
        Row("offload", "offload.AdamW, stepped during backward", offload_row(), offload=True,
            note="gpu_state='auto': spare GPU memory holds the state of the first layers"),
        Row("offload_host", "offload.AdamW, every state on the host", offload_row(gpu_state=0),
            offload=True, note="gpu_state=0"),
        Row("offload_clip", "offload.AdamW, max_grad_norm=1.0", offload_row(max_grad_norm=1.0),
            offload=True),
        # delayed from the second update on (delay_after=1), so that every timed iteration is a
        # delayed one
        Row("offload_delayed", "offload.AdamW, delay_updates=1",
            offload_row(delay_updates=1, delay_after=1),
            offload=True, note="one step of staleness"),
        Row("offload_8bit", "offload.AdamW, 8-bit moments", offload_row(moments="8bit"),
            offload=True),
    ]


# ------------------------------------------------------------------------------------------ timing
def sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)


def mark(setup: Setup):
    if setup.cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(setup: Setup, a, b) -> float:
    return a.elapsed_time(b) if setup.cuda else (b - a) * 1e3


def span_median(setup: Setup, spans: list) -> float:
    return statistics.median(elapsed_ms(setup, a, b) for a, b in spans)
