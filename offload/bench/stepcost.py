"""bench/stepcost.py: ``python -m offload.bench step-cost``: one ``offload.AdamW.step()`` against
one ``torch.optim.AdamW(fused=True).step()`` on the same sizes, from one small tensor (where a step
is all fixed cost: checks, bookkeeping, the call into the kernel) to one of 128M elements (where it
is all kernel).

Cases (fp32 parameters on the CPU, their gradients kept from step to step, state in RAM):
  1x1024      1 tensor of 1024 elements
  10x256x256  10 tensors of 256 x 256
  mlp         a 12-layer 768-wide MLP: per layer a 768 x 768 weight, its bias, a norm weight (36)
  10000x1024  10000 tensors of 1024 elements
  128M        1 tensor of 128M elements (4 GiB of parameters, gradients and both states)
at each ``--threads`` count (offload's ``threads=``; torch.set_num_threads for torch).

Both optimizers live in the one process and are timed round-robin, their order alternating from
round to round: in each of ``--reps`` rounds each times ``--steps`` steps in a row (0: about 50 ms
of steps, 3 to 500) and keeps their median. The verdict is the median over rounds of the
per-round ratio offload / torch (bench/common.py paired_ratio): at most 1.0 is a PASS (offload no
slower). ``--scale`` shrinks every tensor (a quick run; the case names keep their full sizes).
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

import offload
from .common import (Progress, add_common_options, cpu_model, format_table, machine_info, median,
                     paired_ratio, write_json)

QUESTION = ("Is one offload.AdamW step as cheap as torch's fused AdamW step, from 1 small tensor "
            "to 128M elements?")
CASES = ("1x1024", "10x256x256", "mlp", "10000x1024", "128M")
OURS, PEER = "offload.AdamW", "torch AdamW(fused=True)"
STEP_BUDGET_S = 0.05   # timed steps per contender and round (--steps 0)


def shapes(case: str, scale: float = 1.0) -> list:
    """The parameter shapes of ``case``; the first dimension of each is scaled by ``scale`` when it
    has over 64 elements (every tensor keeps at least one element)."""
    def s(n: int) -> int:
        return max(1, int(round(n * scale))) if n > 64 else n
    if case == "1x1024":
        return [(s(1024),)]
    if case == "10x256x256":
        return [(s(256), 256)] * 10
    if case == "mlp":
        return [(s(768), 768), (s(768),), (s(768),)] * 12
    if case == "10000x1024":
        return [(s(1024),)] * 10000
    if case == "128M":
        return [(s(128 << 20),)]
    raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)}")


def _params(case: str, scale: float) -> list:
    gen = torch.Generator().manual_seed(0)
    ps = []
    for shape in shapes(case, scale):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen) * 0.01   # kept: the same gradient every step
        ps.append(p)
    return ps


class Contender:
    """One optimizer over its own copy of the case's tensors, stepped at one thread count."""

    def __init__(self, name: str, make, case: str, scale: float, threads: int):
        self.name, self.threads = name, threads
        self.opt = make(_params(case, scale))

    def steps(self, n: int) -> float:
        """Median seconds of ``n`` steps in a row."""
        torch.set_num_threads(self.threads)   # (torch's kernel; offload's takes threads=)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.opt.step()
            ts.append(time.perf_counter() - t0)
        return median(ts)

    def close(self) -> None:
        close = getattr(self.opt, "close", None)
        if close is not None:
            close()


def measure(case: str, scale: float, threads: int, rounds: int, steps: int) -> dict:
    """Round-robin timing of offload and torch on one case at one thread count (module text)."""
    cs = [Contender(OURS, lambda ps: offload.AdamW(ps, lr=1e-4, threads=threads), case, scale,
                    threads),
          Contender(PEER, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), case, scale,
                    threads)]
    try:
        for c in cs:
            c.steps(3)   # state made, caches warm, offload's next step planned
        n = steps or max(3, min(500, int(STEP_BUDGET_S / max(c.steps(3) for c in cs))))
        times = {c.name: [] for c in cs}
        gc.collect()
        for r in range(rounds):
            for c in (cs if r % 2 == 0 else cs[::-1]):
                times[c.name].append(c.steps(n))
    finally:
        for c in cs:
            c.close()
    ratio = paired_ratio(times[OURS], times[PEER])
    sizes = shapes(case, scale)
    return dict(case=case, threads=threads, tensors=len(sizes),
                elements=sum(torch.Size(s).numel() for s in sizes), steps_per_round=n,
                rounds=rounds, seconds={k: median(v) for k, v in times.items()}, per_round=times,
                ratio=ratio, verdict="PASS" if ratio <= 1.0 else "MISS")


def run(args) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        shapes(c)   # an unknown name fails before anything runs
    thread_counts = [int(t) for t in args.threads.split(",")]
    from ..native.adam import available_isas, get_isa, set_num_threads
    set_num_threads(max(thread_counts))
    print(f"CPU: {cpu_model()}  |  kernel ISA: {get_isa()} (available: "
          f"{', '.join(available_isas())})  |  torch {torch.__version__}")
    print(f"question: {QUESTION}")
    saved = torch.get_num_threads()
    results = []
    bar = Progress(len(cases) * len(thread_counts), "step-cost", enabled=not args.no_progress)
    try:
        for case in cases:
            for th in thread_counts:
                bar.update(f"{case} threads={th}")
                results.append(measure(case, args.scale, th, args.reps, args.steps))
    finally:
        torch.set_num_threads(saved)
        bar.close()
    rows = [(r["case"], r["threads"], r["tensors"], f"{r['seconds'][OURS] * 1e6:.1f}",
             f"{r['seconds'][PEER] * 1e6:.1f}", f"{r['ratio']:.3f}", r["verdict"])
            for r in results]
    print(format_table(["case", "threads", "tensors", "offload.AdamW.step (us)",
                        "torch fused (us)", "offload / torch (per-round median)",
                        "offload no slower"], rows))
    missed = [f"{r['case']}@{r['threads']}" for r in results if r["verdict"] != "PASS"]
    print("target (offload no slower than torch fused at every size): "
          + ("PASS" if not missed else "MISS: " + ", ".join(missed)))
    write_json(args.json, dict(machine=machine_info(), isa=get_isa(), question=QUESTION,
                               scale=args.scale, results=results))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("step-cost", help="one step, offload vs torch fused, 1 tensor to 128M",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma list of {', '.join(CASES)} (default: all)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--steps", type=int, default=0,
                   help="timed steps per contender and round (0: about 50 ms of steps)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply tensor sizes (e.g. 0.01 for a quick run)")
    add_common_options(p, reps=7, what="round-robin rounds (the median of per-round ratios)")
    p.set_defaults(func=run)
