"""pipeline_util.py: helpers of the GPU-offload pipeline tests driven on CPU through the fake device
(test_gpu_results.py, test_gpu_overlap.py, test_gpu_device_writes.py, test_gpu_api.py): a tiny GPT with a
layer used only on even steps, optimizer factories (offload on the fake device, torch.optim.AdamW, the
CPU mode of offload.AdamW), a training loop with accumulation, clipping, overflow and GradScaler options,
the comparison of two runs, the spans of a Chrome trace, and a fake device whose uploads are held back.
"""
import contextlib
import threading
import time

import torch
import torch.nn as nn

import offload
from offload.bench.gpt import GPT, PRESETS, param_groups, random_batch
from offload.device import FakeDevice
from offload.device.base import Event
from offload.testing import device
from conftest import SCHEDULES, Config

CFG = PRESETS["tiny"]


LR = 1e-2

FAKE = dict(sides=("fake",), tiers=("ram",), moments=("fp32",))   # configs(...) of this file: the schedules vary

SCHED = {c: Config("fake", schedule=c).schedule_kw for c in SCHEDULES}   # schedule -> its constructor options


class Net(nn.Module):
    """Tiny GPT (tied head, norms, biases) plus a layer used only on even steps (no grad otherwise)."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CFG)
        self.aux = nn.Linear(CFG.d_model, CFG.d_model)

    def forward(self, idx, tgt, use_aux):
        loss = self.gpt(idx, tgt)
        if use_aux:
            loss = loss + self.aux(self.gpt.ln_f.weight.detach().float().to(self.aux.weight.dtype)).float().square().mean()
        return loss


def make_net(dtype):
    torch.manual_seed(0)
    return Net().to(dtype)


def ours(dev_seed=0, max_delay=0.002, bucket_mb=0.004, **opts):
    def factory(model):
        dev = FakeDevice(max_delay=max_delay, seed=dev_seed)
        return offload.AdamW(param_groups(model, 0.1), lr=LR, offload_device=dev, bucket_mb=bucket_mb, **opts)
    return factory


def torch_ref(model):
    return torch.optim.AdamW(param_groups(model, 0.1), lr=LR)


def cpu_mode(model):
    return offload.AdamW(param_groups(model, 0.1), lr=LR)


def train(factory, dtype=torch.float32, steps=6, accum=1, torch_clip=None, inf_step=None, scaler=None,
          two_backwards=False, use_no_sync=True, after_step=None, before_step=None):
    model = make_net(dtype)
    opt = factory(model)
    gen = torch.Generator().manual_seed(123)
    for it in range(steps):
        for micro in range(accum):
            last = micro == accum - 1
            ctx = opt.no_sync() if (use_no_sync and not last and hasattr(opt, "no_sync")) else contextlib.nullcontext()
            idx, tgt = random_batch(CFG, 2, "cpu", gen)
            with ctx:
                loss = model(idx, tgt, use_aux=(it % 2 == 0))
                if inf_step == it and last:
                    loss = loss * float("inf")
                if scaler is not None:
                    loss = scaler.scale(loss)
                loss.backward()
                if two_backwards:
                    model(idx, tgt, use_aux=False).backward()
        if before_step is not None:
            before_step(model, opt)
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif inf_step == it and not getattr(opt, "gpu_offload", False):
            pass  # the reference skips the step whose gradients are not finite
        else:
            opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model, opt)
    if isinstance(opt, offload.AdamW):
        opt.synchronize()
        if opt.gpu_offload:
            device(opt).check()
    return model, opt


def assert_same(a, b, exact=True, atol=1e-6, rtol=1e-5, state=True):
    (ma, oa), (mb, ob) = a, b
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.isfinite(pa).all(), name
        if exact:
            assert torch.equal(pa, pb), f"{name}: max diff {(pa.float() - pb.float()).abs().max().item()}"
        else:
            torch.testing.assert_close(pa, pb, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    if not state:
        return
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    assert sa, "no optimizer state to compare"
    for k in sa:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "step"):
            # torch has no master_param; every other key must be on both sides
            if key in sb[k] or (key in sa[k] and key != "master_param"):
                ta = sa[k][key].float()
                tb = sb[k][key].float().to(ta.device)
                if exact:
                    assert torch.equal(ta, tb), f"state {k} {key}"
                else:
                    torch.testing.assert_close(ta, tb, atol=atol, rtol=rtol)


def _trace_spans(opt, path):
    import json
    opt.export_chrome_trace(str(path))
    ev = json.loads(path.read_text())["traceEvents"]
    return [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X"]


class _Held(Event):
    """Completes after ``after``, then ``delay`` seconds after it was made, or (no delay) once ``gate`` is set."""

    def __init__(self, after, delay, gate):
        self.after, self.t, self.gate = after, None if delay is None else time.perf_counter() + delay, gate

    def synchronize(self) -> None:
        if self.after is not None:
            self.after.synchronize()
        if self.t is None:
            assert self.gate.wait(60), "a held upload was never released"
        elif self.t > time.perf_counter():
            time.sleep(self.t - time.perf_counter())

    def query(self) -> bool:
        return ((self.after is None or self.after.query())
                and (self.gate.is_set() if self.t is None else time.perf_counter() >= self.t))


class HeldUploads(FakeDevice):
    """FakeDevice whose host-to-device copies start ``delay`` seconds after they are issued, or, with
    ``delay=None``, only while ``gate`` (a threading.Event, set at first) is set."""

    def __init__(self, delay=None, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

    def copy_to_device(self, pairs, after):
        return super().copy_to_device(pairs, _Held(after, self.delay, self.gate))
