"""kernel.py: ``python -m offload.bench kernel``: the CPU Adam step, ours vs peers vs memory bandwidth.

In one process and round-robin (so drifting memory bandwidth hits every contender alike) it times
``offload.AdamW.step()``, our raw multi-tensor kernel call, ``torch.optim.AdamW(fused=True)``,
``torch.optim.AdamW(foreach=True)``, DeepSpeed's ``DeepSpeedCPUAdam`` when importable, and a
native bandwidth probe with Adam's access pattern (reads 4, writes 3 fp32 streams). Figures are
medians; GB/s counts the bytes a perfect single pass must move (28 B/param).
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import offload
from offload import _C, _kernels

from .common import Progress, format_table, machine_info, median, write_json

BYTES_PER_PARAM = 28  # read g, p, m, v (16 B) + write p, m, v (12 B); bf16 case: 2+12 read, 12+2 written


def _human(n: int) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div and n % (div // 16 or 1) == 0:
            return f"{n / div:g}{unit}"
    return str(n)


@dataclass
class Case:
    key: str  # flat | multi | small | bf16 (what check_targets looks up)
    sizes: list
    lowp: bool = False  # bf16 grads in, bf16 weights out, fp32 master/moments
    results: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def name(self) -> str:
        n = self.sizes[0]
        shape = f"flat {_human(n)}" if len(self.sizes) == 1 else f"{len(self.sizes)}x{n}"
        return f"bf16 grad+out, {shape}" if self.lowp else f"fp32 {shape}"


def make_cases(scale: float, only) -> list:
    flat = max(16, int(128 * 2**20 * scale))
    cases = [
        Case("flat", [flat]),
        Case("multi", [max(1, int(131072 * scale))] * 1000),
        Case("small", [1024] * max(1, int(10000 * min(1.0, scale * 8)))),
        Case("bf16", [flat], lowp=True),
    ]
    if only:
        keys = [k.strip() for k in only.split(",")]
        cases = [c for c in cases if c.key in keys]
    return cases


# --------------------------------------------------------------------------- contenders
_RANDOM = {}


def randn_like_sizes(sizes: list, dtype=torch.float32, scale: float = 1.0) -> list:
    """Random tensors of the given sizes, copied out of one cached random block (fast setup)."""
    need = max(sizes)
    src = _RANDOM.get("src")
    if src is None or src.numel() < need:
        src = _RANDOM["src"] = torch.randn(need)
    out = []
    for k, n in enumerate(sizes):
        start = (k * 7919) % max(1, src.numel() - n + 1)
        out.append((src[start:start + n] * scale).to(dtype))
    return out


class Contender:
    name = "?"
    threads = 1

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def step(self) -> None:
        raise NotImplementedError


class Ours(Contender):
    """offload.AdamW.step(): the drop-in optimizer, Python bookkeeping included."""
    name = "offload.AdamW.step"

    def __init__(self, case: Case, grads: list, threads: int):
        dtype = torch.bfloat16 if case.lowp else torch.float32
        self.params = [torch.nn.Parameter(t) for t in randn_like_sizes(case.sizes, dtype)]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = offload.AdamW(self.params, lr=1e-3, weight_decay=0.01, threads=threads)

    def set_threads(self, threads: int) -> None:
        self.opt._threads = threads

    def step(self) -> None:
        self.opt.step()


class OursKernel(Contender):
    """One native call on a prebuilt pointer table: the kernel alone."""
    name = "offload kernel call"

    def __init__(self, ours: Ours, threads: int):
        plan = ours.opt._plans[0]
        self.table = plan.table.copy()
        self.table[:, _kernels.COL_STEP] = 10
        self.threads = threads

    def step(self) -> None:
        _C._adam_step(self.table, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, False, 1.0, self.threads, False)


class TorchAdamW(Contender):
    def __init__(self, case: Case, grads: list, threads: int, mode: str):
        self.name = f"torch AdamW({mode}=True)" + (" +casts" if case.lowp else "")
        self.threads = threads
        self.params = [torch.nn.Parameter(t) for t in randn_like_sizes(case.sizes)]
        self.lowp = case.lowp
        self.grads = grads
        if case.lowp:
            # the composite a user writes today: upcast bf16 grads, fp32 step, cast weights down
            self.model_weights = [torch.empty(n, dtype=torch.bfloat16) for n in case.sizes]
        else:
            for p, g in zip(self.params, grads):
                p.grad = g
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01, **{mode: True})

    def step(self) -> None:
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            if self.lowp:
                for p, g in zip(self.params, self.grads):
                    p.grad = g.float()
            self.opt.step()
            if self.lowp:
                torch._foreach_copy_(self.model_weights, self.params)
        finally:
            torch.set_num_threads(prev)


class DeepSpeed(Contender):
    name = "DeepSpeedCPUAdam"

    def __init__(self, case: Case, grads: list, threads: int):
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: import here, optional
        self.threads = threads
        self.params = [torch.nn.Parameter(t) for t in randn_like_sizes(case.sizes)]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = DeepSpeedCPUAdam(self.params, lr=1e-3, weight_decay=0.01, adamw_mode=True)

    def step(self) -> None:
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self.opt.step()
        finally:
            torch.set_num_threads(prev)


class Probe(Contender):
    """Bandwidth ceiling: native pass over 7 fp32 streams (Adam's pattern), same size."""
    name = "bandwidth probe (ceiling)"

    def __init__(self, numel: int, threads: int):
        self.bufs = [torch.full((numel,), 0.5) for _ in range(4)]
        self.threads, self.numel = threads, numel

    def step(self) -> None:
        p, m, v, g = (b.data_ptr() for b in self.bufs)
        _C._bandwidth_probe(p, m, v, g, self.numel, self.threads)


def deepspeed_available() -> bool:
    try:
        import deepspeed.ops.adam  # noqa: F401
        return True
    except Exception:
        return False


# --------------------------------------------------------------------------- running
def run_case(case: Case, thread_counts: list, reps: int, use_ds: bool, progress: Progress) -> None:
    """Time every contender, round-robin, at each thread count; results go to case.results."""
    gdtype = torch.bfloat16 if case.lowp else torch.float32
    grads = randn_like_sizes(case.sizes, gdtype, scale=1e-2)
    ours = Ours(case, grads, thread_counts[0])
    ours.step()  # creates state and the pointer table
    contenders = [ours, OursKernel(ours, thread_counts[0]),
                  TorchAdamW(case, grads, thread_counts[0], "fused"), TorchAdamW(case, grads, thread_counts[0], "foreach")]
    if use_ds and not case.lowp:
        try:
            contenders.append(DeepSpeed(case, grads, thread_counts[0]))
        except Exception as e:  # noqa: BLE001 - report and go on without it
            print(f"  (DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e})")
    contenders.append(Probe(case.numel, thread_counts[0]))
    for t in thread_counts:
        times = {c.name: [] for c in contenders}
        for c in contenders:
            c.set_threads(t)
        for rep in range(reps + 1):  # round-robin; rep 0 is warm-up
            for c in contenders:
                t0 = time.perf_counter()
                c.step()
                dt = time.perf_counter() - t0
                if rep:
                    times[c.name].append(dt)
                progress.update(f"{case.name} t={t} {c.name}")
        case.results[t] = {k: median(v) for k, v in times.items()} | {"_raw": times}
    del contenders, ours, grads
    gc.collect()


def summarize(cases: list, thread_counts: list) -> tuple:
    rows, records = [], []
    for case in cases:
        for t in thread_counts:
            res = case.results[t]
            probe = res["bandwidth probe (ceiling)"]
            ours = res["offload.AdamW.step"]
            for name, sec in res.items():
                if name.startswith("_"):
                    continue
                gbs = case.numel * BYTES_PER_PARAM / sec / 1e9
                rows.append([case.name, t, name, f"{sec * 1e3:.1f}", f"{case.numel / sec / 1e6:.0f}",
                             f"{gbs:.1f}", f"{probe / sec * 100:.0f}%", f"{sec / ours:.2f}x"])
                records.append(dict(case=case.name, threads=t, impl=name, seconds=sec, params=case.numel,
                                    gb_per_s=gbs, pct_of_probe=probe / sec * 100, ours_speedup=sec / ours))
    headers = ["case", "thr", "implementation", "ms", "Mparam/s", "GB/s", "% probe", "ours speedup"]
    return format_table(headers, rows), records


def check_targets(cases: list, thread_counts: list) -> list:
    """The issue's targets, evaluated on this run (at the largest thread count)."""
    t = max(thread_counts)
    res = {c.key: c.results[t] for c in cases}
    numel = {c.key: c.numel for c in cases}
    probe = "bandwidth probe (ceiling)"
    impls = ("offload.AdamW.step", "offload kernel call")
    out = []

    def add(label, value, ok):
        out.append(f"{'PASS' if ok else 'MISS'}  {label}: {value}")

    if "flat" in res:
        flat = res["flat"]
        for impl in impls:
            pct = flat[probe] / flat[impl] * 100
            add(f"fp32 flat, {impl} >= 97% of probe", f"{pct:.1f}%", pct >= 97)
        r = flat["torch AdamW(fused=True)"] / flat["offload.AdamW.step"]
        add("fp32 flat >= 1.05x torch fused", f"{r:.2f}x", r >= 1.05)
    for key, label, limit in (("multi", "1000x131072 throughput >= 95% of our flat", None),
                              ("small", "10000x1024 per-element time <= 1.2x our flat", 1.2)):
        if "flat" not in res or key not in res:
            continue
        for impl in impls:
            ratio = (res[key][impl] / numel[key]) / (res["flat"][impl] / numel["flat"])
            if limit is None:
                add(f"{label} ({impl})", f"{100 / ratio:.1f}%", 1 / ratio >= 0.95)
            else:
                add(f"{label} ({impl})", f"{ratio:.2f}x", ratio <= limit)
    if "bf16" in res:
        lowp = res["bf16"]
        r = lowp["torch AdamW(fused=True) +casts"] / lowp["offload.AdamW.step"]
        add("bf16 grad+out >= 1.8x torch composite", f"{r:.2f}x", r >= 1.8)
        pct = lowp[probe] / lowp["offload.AdamW.step"] * 100
        add("bf16 grad+out >= 90% of probe", f"{pct:.1f}%", pct >= 90)
    return out


def plot(path: str, records: list) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'offload[bench]')")
        return
    labels = sorted({(r["case"], r["threads"]) for r in records}, key=lambda x: (x[0], x[1]))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels)), 5))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = [next((r["gb_per_s"] for r in records if (r["case"], r["threads"]) == lab and r["impl"] == impl), 0)
                for lab in labels]
        ax.bar(np.arange(len(labels)) + j * width, vals, width, label=impl)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{c}\n{t} thr" for c, t in labels], fontsize=8)
    ax.set_ylabel("effective GB/s (28 B/param)")
    ax.set_title("CPU Adam step: offload vs peers vs bandwidth probe")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def run(args) -> int:
    all_threads = _C.affinity_cpu_count()
    thread_counts = sorted({all_threads if t == "all" else int(t) for t in args.threads.split(",")})
    _C.set_num_threads(max(thread_counts + [_C.get_num_threads()]))
    cases = make_cases(args.scale, args.cases)
    use_ds = not args.no_deepspeed and deepspeed_available()
    info = offload.build_info()
    print(f"offload {info['version']}  isa={info['isa']}  cpus(affinity)={all_threads}  torch {torch.__version__}"
          f"  DeepSpeed: {'yes' if use_ds else 'not importable (skipped)'}")
    print(f"median of {args.reps} round-robin repetitions after one warm-up; GB/s = params x {BYTES_PER_PARAM} B / time")
    n_contenders = 6 + int(use_ds)
    progress = Progress(len(cases) * len(thread_counts) * (args.reps + 1) * n_contenders, "kernel bench",
                        enabled=not args.no_progress)
    for case in cases:
        run_case(case, thread_counts, args.reps, use_ds, progress)
    progress.close()
    table, records = summarize(cases, thread_counts)
    print(table)
    targets = check_targets(cases, thread_counts)
    if targets:
        print(f"\ntargets (at {max(thread_counts)} threads):")
        print("\n".join("  " + t for t in targets))
    write_json(args.json, dict(machine=machine_info(), build=info, reps=args.reps, scale=args.scale,
                               results=records, targets=targets,
                               raw={f"{c.name}|{t}": c.results[t]["_raw"] for c in cases for t in thread_counts}))
    if args.plot:
        plot(args.plot, records)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kernel", help="CPU Adam kernel vs torch/DeepSpeed vs memory bandwidth (default)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,all", help="comma-separated thread counts ('all' = affinity CPUs)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per contender (median reported)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply tensor sizes (e.g. 0.05 for a quick run)")
    p.add_argument("--cases", default="", help="subset of flat,multi,small,bf16 (default: all)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw a PNG chart (needs matplotlib)")
    p.set_defaults(func=run)
