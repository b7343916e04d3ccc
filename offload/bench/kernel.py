"""bench/kernel.py: ``python -m offload.bench kernel``: the CPU Adam step, ours vs peers vs memory
bandwidth.

In one process and round-robin (so drifting memory bandwidth hits every contender alike) it times
``offload.AdamW.step()``, our raw multi-tensor kernel call, ``torch.optim.AdamW(fused=True)``,
``torch.optim.AdamW(foreach=True)``, DeepSpeed's ``DeepSpeedCPUAdam`` when importable, and a native
bandwidth probe with the case's streams (reads 4, writes 3 fp32 streams; for bf16 gradients and
weights the bf16 streams instead of the fp32 gradient) walked in several ways, the fastest being
the ceiling. Figures are medians; GB/s counts the bytes a perfect single pass must move (28
B/param, bf16 gradients and weights 30 B/param).

The default sizes (32M-parameter flat tensors, 10000 x 1024) are well past any L3 and finish in
about a minute on 2 cores; ``--full`` runs the 128M-parameter sizes the speed targets are set on.
On a CPU with AVX-512 an extra case answers "is AVX-512 worth it?": the same kernel forced to AVX2
vs the native AVX-512 path, round-robin in one run.
"""
from __future__ import annotations

import argparse
import gc

import numpy as np
import torch

import offload
from offload.native import adam as _native
from offload.planner import host_memory

from .common import (Progress, add_common_options, cpu_model, format_table, machine_info, median,
                     paired_ratio, time_warm, verdict, write_json)
from .kernel_cases import (BYTES_PER_PARAM, BYTES_PER_PARAM_BF16, CASE_KEYS, DS_BF16_BYTES,
                           MODE_PREFIX, OPT_IN, Case,
                           DeepSpeed, MetadataFloor, Ours, OursKernel, OursKernelIsa, Probe,
                           TorchAdamW, ceiling_series,
                           deepspeed_available, has_avx512, make_cases, probe_modes,
                           randn_like_sizes)

def run_case(case: Case, thread_counts: list, reps: int, use_ds: bool, progress: Progress) -> None:
    """Time every contender, round-robin, at each thread count; results go to case.results."""
    gdtype = torch.bfloat16 if case.lowp else torch.float32
    grads = randn_like_sizes(case.sizes, gdtype, scale=1e-2)
    ours = Ours(case, grads, thread_counts[0])
    ours.step()  # creates state and the pointer table
    if case.key == "isa":
        native = _native.get_isa()
        contenders = [OursKernelIsa(ours, thread_counts[0], "avx2", native),
                      OursKernelIsa(ours, thread_counts[0], native, native)]
    else:
        contenders = [ours, OursKernel(ours, thread_counts[0]),
                      TorchAdamW(case, grads, thread_counts[0], "fused"),
                      TorchAdamW(case, grads, thread_counts[0], "foreach")]
    if use_ds and case.key != "isa":
        try:
            contenders.append(DeepSpeed(case, grads, thread_counts[0]))
        except Exception as e:  # noqa: BLE001 - report and go on without it
            print(f"  (DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e})")
    contenders += probe_modes(case.numel, thread_counts[0], lowp=case.lowp)
    if case.key in ("small", "small-newgrads"):
        contenders.append(MetadataFloor(ours))
    for t in thread_counts:
        times = {c.name: [] for c in contenders}
        for c in contenders:
            c.set_threads(t)
        for rep in range(reps):  # round-robin (time_warm's untimed step is each one's warm-up)
            # each round starts one contender later: none always runs right after the same one
            # (what the previous contender left in the caches and write-back queues costs the next
            # one a few %); each is timed on the second of two steps in a row (common.time_warm)
            k = rep % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                times[c.name].append(time_warm(c))
                progress.update(f"{case.name} t={t} {c.name}")
        times[Probe.CEILING] = ceiling_series(times)
        modes = {k[len(MODE_PREFIX):]: median(v) for k, v in times.items()
                 if k.startswith(MODE_PREFIX)}
        case.results[t] = {k: median(v) for k, v in times.items() if not k.startswith(MODE_PREFIX)}
        case.results[t] |= {"_raw": times, "_probe_modes": modes}
    del contenders, ours, grads
    gc.collect()


def cases_that_fit(cases: list, available, scale: float = 1.0) -> tuple:
    """(the cases whose tensors fit in ``available`` bytes, one line per case left out). Each case
    holds its contenders' tensors at once (Case.footprint) and frees them before the next one
    starts, so each must fit alone; a margin of 10 % and 0.5 GiB stays free. No figure: no
    check."""
    if not available:
        return cases, []
    keep, notes = [], []
    for c in cases:
        need = c.footprint
        if need * 1.1 + 2**29 <= available:
            keep.append(c)
            continue
        label = f"compressed moments, {c.name}" if c.key == "moments" else c.name
        notes.append(f"case '{label}' skipped: it holds about {need / 2**30:.1f} GiB at once "
                     f"(every contender's tensors and the probe's) and {available / 2**30:.1f} "
                     "GiB of memory is available; --scale "
                     f"{max(0.01, scale * (available - 2**29) / 1.1 / need):.2g} "
                     "or less would fit")
    return keep, notes


def summarize(cases: list, thread_counts: list) -> tuple:
    rows, records = [], []
    for case in cases:
        for t in thread_counts:
            res = case.results[t]
            probe = res["bandwidth probe (ceiling)"]
            ours = res.get("offload.AdamW.step") or next(v for k, v in res.items()
                                                         if not k.startswith("_"))
            for name, sec in res.items():
                if name.startswith("_"):
                    continue
                gbs = case.numel * case.bytes_per_param / sec / 1e9
                rows.append([case.name, t, name, f"{sec * 1e3:.1f}",
                             f"{case.numel / sec / 1e6:.0f}",
                             f"{gbs:.1f}", f"{probe / sec * 100:.0f}%", f"{sec / ours:.2f}x"])
                records.append(dict(case=case.name, threads=t, impl=name, seconds=sec,
                                    params=case.numel,
                                    gb_per_s=gbs, pct_of_probe=probe / sec * 100,
                                    ours_speedup=sec / ours))
    headers = ["case", "thr", "implementation", "ms", "Mparam/s", "GB/s", "% probe",
               "ours speedup"]
    return format_table(headers, rows), records


def verdicts(cases: list, thread_counts: list) -> list:
    """One line per case and thread count: offload.AdamW.step against the fastest peer measured in
    this run (torch's and DeepSpeed's optimizers; not offload's own kernel call, the floor or the
    probe)."""
    out = []
    for case in cases:
        for t in thread_counts:
            res = case.results[t]
            peers = {k: v for k, v in res.items() if k.startswith(("torch", "DeepSpeed"))}
            v = verdict(res.get("offload.AdamW.step"), peers, ours_name="offload.AdamW.step",
                        label=f"{case.name}, {t} thr")
            if v is not None:
                out.append(dict(case=case.name, threads=t, **v))
    return out


TARGETS = (
    "every fp32 and bf16 grad+out case (flat and many-tensor), at every thread count: "
    "offload.AdamW.step at least 95% of the bandwidth probe (the fastest way this machine's "
    "memory was walked in this run)",
    "the same cases: offload.AdamW.step at least as fast (1.0x) as the fastest peer measured in "
    "the same run (torch AdamW fused/foreach, DeepSpeedCPUAdam where importable; bf16: torch's "
    "upcast-step-cast composite and DeepSpeed's bf16 parameters)",
    "10000 x 1024 fp32: offload.AdamW.step per-element time <= 1.5x the flat figure",
)


def check_targets(cases: list, thread_counts: list) -> list:
    """The speed targets, evaluated on this run: one line per case, thread count and target, in
    words a user reads ("reaches 97% of what the memory can do", "1.08x faster than
    DeepSpeedCPUAdam"). Each ratio is the median of the per-round ratios (common.paired_ratio; the
    tables show medians of the times)."""
    probe = "bandwidth probe (ceiling)"
    step = "offload.AdamW.step"
    out = []

    def add(label, value, ok):
        out.append(f"{'PASS' if ok else 'MISS'}  {label}: {value}")

    def ratio(case, t, num, den):
        raw = case.results[t]["_raw"]
        return paired_ratio(raw[num], raw[den])

    by_key = {c.key: c for c in cases}
    for case in cases:
        if case.key not in ("flat", "multi", "bf16"):
            continue
        for t in thread_counts:
            raw = case.results[t]["_raw"]
            pct = ratio(case, t, probe, step) * 100
            note = ""
            # where the time goes: the kernel, or the step around it
            if pct < 95 and OursKernel.name in raw:
                kpct = ratio(case, t, probe, OursKernel.name) * 100
                note = (f" (the kernel call on the same tensors: {kpct:.0f}%; the rest is the "
                        f"step's checks of {len(case.sizes)} tensors)" if len(case.sizes) > 1 else
                        f" (the kernel call on the same tensor: {kpct:.0f}%)")
            add(f"{case.name}, {t} thr: step time vs the memory's best (>= 95%)",
                f"{pct:.1f}%{note}", pct >= 95)
            peers = {k: ratio(case, t, k, step) for k in raw
                     if k.startswith(("torch", "DeepSpeed"))}
            if peers:
                best = min(peers, key=peers.get)  # the peer closest to (or ahead of) us
                note = (" (DeepSpeedCPUAdam updates the bf16 weights in place, with no fp32 "
                        f"master copy: it moves {DS_BF16_BYTES} B per parameter, offload "
                        f"{BYTES_PER_PARAM_BF16} B)"
                        if case.lowp and best == DeepSpeed.name and peers[best] < 1.0 else "")
                add(f"{case.name}, {t} thr: against the fastest peer, {best} (>= 1.0x)",
                    f"{peers[best]:.2f}x{note}", peers[best] >= 1.0)
    for t in thread_counts:
        if "flat" in by_key and "small" in by_key:
            small, flat = by_key["small"], by_key["flat"]
            # two cases, timed in different rounds: nothing to pair, the ratio of the medians
            value = (small.results[t][step] / small.numel) / (flat.results[t][step] / flat.numel)
            # what the target leaves beside the kernel call, against the reads no check can skip
            budget = (1.5 * flat.results[t][step] / flat.numel * small.numel
                      - small.results[t]["offload kernel call"])
            floor = small.results[t].get(MetadataFloor.name)
            note = (f" (the target leaves {budget * 1e3:.1f} ms beside the kernel call; the 3 "
                    f"torch reads per tensor alone take {floor * 1e3:.1f} ms)" if floor is not None
                    else "")
            add(f"{small.name}, {t} thr: step per-element time <= 1.5x flat",
                f"{value:.2f}x{note}", value <= 1.5)
    return out


def probe_summary(cases: list, thread_counts: list) -> list:
    """The probe's ways of walking memory, per case and thread count: Mparam/s of each (medians;
    the ceiling is the fastest of them round by round)."""
    out = []
    for case in cases:
        for t in thread_counts:
            modes = case.results[t].get("_probe_modes")
            if modes:
                best = min(modes, key=modes.get)
                others = ", ".join(f"{k} {case.numel / v / 1e6:.0f}" for k, v in modes.items())
                out.append(f"{case.name}, {t} thr: {best} (Mparam/s: {others})")
    return out


def isa_summary(cases: list, thread_counts: list) -> list:
    """The "is AVX-512 worth it?" answer, as speedups of the native path over forced AVX2."""
    case = next((c for c in cases if c.key == "isa" and c.results), None)
    if case is None:
        return []
    out = []
    for t in thread_counts:
        res = case.results[t]
        a2, nat = (next(v for k, v in res.items() if k.endswith(f"[{isa}]"))
                   for isa in ("avx2", case.native))
        out.append(f"{t} thr: {case.native} {a2 / nat:.2f}x the speed of forced avx2 "
                   f"(avx2 {res['bandwidth probe (ceiling)'] / a2 * 100:.0f}% of probe, "
                   f"{case.native} {res['bandwidth probe (ceiling)'] / nat * 100:.0f}%)")
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
        vals = [next((r["gb_per_s"] for r in records if (r["case"], r["threads"]) == lab
                      and r["impl"] == impl), 0)
                for lab in labels]
        ax.bar(np.arange(len(labels)) + j * width, vals, width, label=impl)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{c}\n{t} thr" for c, t in labels], fontsize=8)
    ax.set_ylabel(f"effective GB/s ({BYTES_PER_PARAM} B/param, bf16 case {BYTES_PER_PARAM_BF16})")
    ax.set_title("CPU Adam step: offload vs peers vs bandwidth probe")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


QUESTION = ("How fast is offload's CPU Adam step against torch's and DeepSpeed's optimizers on "
            "the same tensors, and how close does it get to the memory bandwidth (the probe)?")


def run(args) -> int:
    all_threads = _native.affinity_cpus()
    thread_counts = sorted({all_threads if t == "all" else int(t)
                            for t in args.threads.split(",")})
    _native.set_num_threads(max(thread_counts + [_native.get_num_threads()]))
    cases = make_cases(args.scale, args.cases, full=args.full)
    info = offload.build_info()
    print(f"CPU: {cpu_model()}  |  kernel ISA: {info['isa']} (available: "
          f"{', '.join(info['available_isas'])})  |  software prefetch: {info['stream_prefetch']} "
          f" |  cpus(affinity)={all_threads}")
    print(f"question: {QUESTION}")
    isa_note = None
    if any(c.key == "isa" for c in cases) and not has_avx512():
        isa_note = (f"'is AVX-512 worth it?' case skipped: this CPU has no AVX-512 "
                    f"(available ISAs: {', '.join(info['available_isas'])})")
        cases = [c for c in cases if c.key != "isa"]
        print(isa_note)
    cases, memory_notes = cases_that_fit(cases, host_memory().get("MemAvailable"), args.scale)
    for line in memory_notes:
        print(line)
    for c in cases:
        if c.key == "isa":
            c.native = info["isa"]
    use_ds = not args.no_deepspeed and deepspeed_available()
    print(f"offload {info['version']}  torch {torch.__version__}  DeepSpeed: "
          f"{'yes' if use_ds else 'not importable (skipped)'}  sizes: "
          f"{'--full' if args.full else 'default (--full: 128M)'}")
    print(f"median of {args.reps} round-robin repetitions, each contender timed on the second of "
          "two steps in a row; GB/s = params x the bytes a single pass must move / time "
          f"({BYTES_PER_PARAM} B/param; bf16 grad+out: {BYTES_PER_PARAM_BF16} B)")
    # (3 probe modes; the floor runs in the many-tensor cases only: an estimate)
    n_contenders = 9 + int(use_ds)
    progress = Progress(len(cases) * len(thread_counts) * args.reps * n_contenders, "kernel bench",
                        enabled=not args.no_progress)
    moments = next((c for c in cases if c.key == "moments"), None)
    cases = [c for c in cases if c.key != "moments"]
    for case in cases:
        run_case(case, thread_counts, args.reps, use_ds, progress)
    mom = None
    if moments is not None:
        from . import moments as bench_moments
        mom = bench_moments.run(moments.numel, thread_counts, args.reps, probe_modes, progress)
    progress.close()
    table, records = summarize(cases, thread_counts)
    print(table)
    verdict = verdicts(cases, thread_counts)
    if verdict:
        print("\nverdict (median step times of this run; above 1.00x offload is faster):")
        print("\n".join("  " + v["line"] for v in verdict))
    if mom is not None:
        print("\ncompressed moments, kernel call only; B/param = bytes a single pass moves")
        print(mom[0])
        records += mom[1]
    modes = probe_summary(cases, thread_counts)
    if modes:
        print("\nbandwidth probe: how fast each way of walking memory went (the ceiling is the "
              "fastest, round by round)")
        print("\n".join("  " + line for line in modes))
    isa = isa_summary(cases, thread_counts)
    if isa:
        print("\nis AVX-512 worth it? (same run, kernel call only)")
        print("\n".join("  " + line for line in isa))
    targets = check_targets(cases, thread_counts) + (mom[2] if mom is not None else [])
    if targets:
        print("\nspeed targets (PASS: this run reached the speed offload aims for on this CPU; "
              "MISS: it did not, results are still correct; medians of this run):")
        print("\n".join("  " + t for t in targets))
    write_json(args.json, dict(bench="kernel", question=QUESTION, machine=machine_info(),
                               build=info, reps=args.reps, scale=args.scale, full=args.full,
                               results=records, verdicts=verdict, targets=targets,
                               target_definitions=list(TARGETS), isa_case=isa or isa_note,
                               probe_modes=modes, skipped=memory_notes,
                               raw={f"{c.name}|{t}": c.results[t]["_raw"] for c in cases
                                    for t in thread_counts}))
    if args.plot:
        plot(args.plot, records)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kernel",
                       help="CPU Adam kernel vs torch/DeepSpeed vs memory bandwidth (default)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,all",
                   help="comma-separated thread counts ('all' = affinity CPUs)")
    p.add_argument("--full", action="store_true",
                   help="the speed targets' full sizes: 128M flat, 1000x131072 (slower)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply tensor sizes (e.g. 0.05 for a quick run)")
    p.add_argument("--cases", default="",
                   help=f"subset of {','.join(CASE_KEYS)} (default: all but {','.join(OPT_IN)})")
    p.add_argument("--no-deepspeed", action="store_true",
                   help="skip DeepSpeedCPUAdam even if importable")
    add_common_options(p, reps=5)  # --reps, --json, --no-progress
    p.add_argument("--plot", metavar="PATH", help="draw a PNG chart (needs matplotlib)")
    p.set_defaults(func=run)
