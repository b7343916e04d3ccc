"""bench/delayed.py: what ``delay_updates=1`` buys and costs, on the fake device (no GPU needed).

Two measurements, both in one process, every schedule on the same machine state:

* ``timing``: an MLP whose forward and backward sleep (the time a GPU would compute; the training
  thread is free meanwhile, as it is while a GPU runs) and whose state is on NVMe in a temporary
  directory made artificially slow (``offload.testing.slow_drive``: each bucket read or write takes
  ``--drive-ms``). Measured apart in the same run: F = forward + backward alone, S = the CPU + NVMe
  step alone (``step(); synchronize()`` after a backward). Then the iteration time of the exact
  schedules (deferred: the step after backward, as with clipping; eager: buckets stepped during
  backward, the default) and of ``delay_updates=1``. Per case, ``--rounds`` rounds; each round runs
  every schedule (rotated order) for ``--iters`` timed iterations after two warm-up ones; a round's
  figure is the median iteration, the table shows the median over rounds and the range (noise).
* ``loss``: the order-2 Markov GPT of ``python -m offload.bench fidelity`` (``--size quick``: 300 steps,
  the default; ``default``: 400 steps of a larger model; the same data, init and lr schedule for both
  contenders), exact vs ``delay_updates=1`` after each ``--delay-after`` number of exact steps, on the
  fake device: mean loss of the last 50 steps, for ``--seeds`` seeds; ``--extrapolate-after``: the
  same with ``delay_extrapolate=True`` (the stale forwards on the weights extrapolated).

    python bench/delayed.py --json out.json            # both (about 3 minutes on 2 cores)
    python bench/delayed.py --only timing --rounds 5
    python bench/delayed.py --only loss --size default --delay-after 0,20,50,100
    python bench/delayed.py --only loss --delay-after "" --extrapolate-after 0,50
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn as nn

import offload
from offload import testing
from offload.bench.fidelity import SIZES, MarkovStream, lr_at
from offload.bench.gpt import GPT, GPTConfig, param_groups
from offload.device import FakeDevice

# delay_after=0: delayed from the first step, the schedule of every step after the warm-up (whose
# delay_after steps run the exact deferred schedule)
SCHEDULES = {"exact (deferred)": dict(step_during_backward=False), "exact (eager)": {},
             "delay_updates=1": dict(delay_updates=1, delay_after=0),
             "extrapolated": dict(delay_updates=1, delay_after=0, delay_extrapolate=True)}


class _Sleep(torch.autograd.Function):
    """x unchanged; forward sleeps ``f`` seconds, backward ``b`` (a GPU's compute time)."""

    @staticmethod
    def forward(ctx, x, f, b):
        time.sleep(f)
        ctx.b = b
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.b)
        return g, None, None


class SleepyMLP(nn.Module):
    def __init__(self, layers: int, width: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.f, self.b = fwd_s / layers, bwd_s / layers

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(_Sleep.apply(x, self.f, self.b)))
        return x.square().mean()


def fake():
    return FakeDevice(max_delay=0.0, poison=False, check=False)


def _timed(opt, model, x, iters: int, part: str) -> float:
    """Median seconds of ``part``: "iter" (forward, backward, step), "fb" (forward + backward only) or
    "step" (step() + synchronize() after an untimed backward)."""
    out = []
    for k in range(iters + 2):
        if part == "step":
            model(x).backward()
            opt.synchronize()
        t0 = time.perf_counter()
        if part != "step":
            model(x).backward()
        if part != "fb":
            opt.step()
        if part == "step":
            opt.synchronize()
        opt.zero_grad()
        if k >= 2:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def timing_case(fwd_s, bwd_s, args) -> dict:
    rows: dict = {}
    x = torch.randn(8, args.width)
    names = list(SCHEDULES) + ["F", "S"]
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.manual_seed(0)
            model = SleepyMLP(args.layers, args.width, fwd_s, bwd_s)
            opts = dict(step_during_backward=False) if name in ("F", "S") else SCHEDULES[name]
            with tempfile.TemporaryDirectory() as d:
                opt = offload.AdamW(model.parameters(), lr=1e-3, offload_device=fake(), bucket_mb=args.bucket_mb,
                                    storage="nvme", nvme_dir=d, host_budget="64MiB", **opts)
                testing.slow_drive(opt, 0, args.drive_ms / 1e3)
                part = {"F": "fb", "S": "step"}.get(name, "iter")
                rows.setdefault(name, []).append(_timed(opt, model, x, args.iters, part))
                buckets = len(testing.state_engine(opt).layout.buckets)
                opt.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    f, s = med["F"], med["S"]
    return dict(fwd_s=fwd_s, bwd_s=bwd_s, F=f, S=s, buckets=buckets, rounds=rows, median=med,
                delayed_vs_max=med["delay_updates=1"] / max(f, s),
                extrapolated_vs_max=med["extrapolated"] / max(f, s),
                exact_deferred_vs_sum=med["exact (deferred)"] / (f + s),
                exact_eager_vs_sum=med["exact (eager)"] / (f + s))


def loss_run(delay_after, seed: int, size, extrapolate: bool = False) -> list:
    """Training losses of every step: exact (``delay_after`` None) or delayed after that many steps."""
    stream = MarkovStream(size.vocab, size.contexts, seed=seed + 1234)
    gen = torch.Generator().manual_seed(seed + 1)
    cfg = GPTConfig(vocab=size.vocab, seq=size.seq, n_layer=size.n_layer, n_head=size.n_head, d_model=size.d_model)
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = offload.AdamW(param_groups(model, 0.1), lr=size.lr, betas=(0.9, 0.95), offload_device=fake(),
                        bucket_mb=0.05, step_during_backward=False,
                        **({} if delay_after is None else dict(delay_updates=1, delay_after=delay_after,
                                                              delay_extrapolate=extrapolate)))
    losses = []
    for step in range(size.steps):
        x, _ = stream.sample(size.batch, size.seq + 1, gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, size)
        loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.close()
    return losses


def loss_table(args) -> dict:
    size = SIZES[args.size]
    out = []
    afters = [int(a) for a in args.delay_after.split(",") if a]
    extrapolated = [int(a) for a in args.extrapolate_after.split(",") if a]
    for seed in range(args.seeds):
        ls = loss_run(None, seed, size)
        row = dict(seed=seed, exact=sum(ls[-50:]) / 50, delayed={}, extrapolated={})
        for a in afters:
            ls = loss_run(a, seed, size)
            row["delayed"][a] = sum(ls[-50:]) / 50
        for a in extrapolated:
            ls = loss_run(a, seed, size, extrapolate=True)
            row["extrapolated"][a] = sum(ls[-50:]) / 50
        out.append(row)
        cells = [f"{v:.4f} ({v / row['exact']:.4f})" for v in list(row["delayed"].values()) +
                 list(row["extrapolated"].values())]
        print(f"| {seed} | {row['exact']:.4f} | " + " | ".join(cells) + " |", flush=True)
    return dict(size=args.size, steps=size.steps, delay_after=afters, extrapolate_after=extrapolated, rows=out)


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["timing", "loss"], default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--drive-ms", type=float, default=8.0, help="seconds per bucket read or write on the slow drive")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--delay-after", default="0,50", help="comma-separated warm-ups (exact steps) to measure (loss)")
    ap.add_argument("--extrapolate-after", default="", help="comma-separated warm-ups to measure with "
                    "delay_extrapolate=True (loss)")
    ap.add_argument("--size", choices=sorted(SIZES), default="quick", help="the fidelity bench's size (loss)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = dict(date=datetime.date.today().isoformat(), cpu=cpu_model(), args=vars(args))
    print(f"# {out['date']}, {out['cpu']}")
    if args.only in (None, "timing"):
        out["timing"] = []
        print("| fwd+bwd F | CPU+NVMe step S | exact deferred | exact eager | delay_updates=1 | + delay_extrapolate "
              "| delayed / max(F,S) | extrapolated / max(F,S) | exact deferred / (F+S) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for fwd, bwd in ((0.03, 0.06), (0.06, 0.12), (0.12, 0.24)):
            c = timing_case(fwd, bwd, args)
            out["timing"].append(c)
            m, rg = c["median"], {k: (min(v), max(v)) for k, v in c["rounds"].items()}

            def cell(k):
                return f"{m[k] * 1e3:.0f} ms ({rg[k][0] * 1e3:.0f}-{rg[k][1] * 1e3:.0f})"
            print(f"| {cell('F')} | {cell('S')} | {cell('exact (deferred)')} | {cell('exact (eager)')} | "
                  f"{cell('delay_updates=1')} | {cell('extrapolated')} | {c['delayed_vs_max']:.2f} | "
                  f"{c['extrapolated_vs_max']:.2f} | {c['exact_deferred_vs_sum']:.2f} |",
                  flush=True)
    if args.only in (None, "loss"):
        cols = [f"delay_after={a} (ratio)" for a in args.delay_after.split(",") if a] + \
            [f"extrapolated, delay_after={a} (ratio)" for a in args.extrapolate_after.split(",") if a]
        print(f"| seed | exact: mean loss, last 50 of {SIZES[args.size].steps} steps ({args.size}) | "
              + " | ".join(cols) + " |")
        print("|---|---|" + "---|" * len(cols))
        out["loss"] = loss_table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
