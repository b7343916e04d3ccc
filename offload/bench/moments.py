"""bench/moments.py: the compressed-moment cases of ``python -m offload.bench kernel``.

One flat tensor, round-robin in one run: the kernel call with fp32 moments, bf16 moments and 8-bit
moments, each with fp32 gradients and with bf16 gradient + bf16 weight out, and the bandwidth
probe. Reports params/s, the true bytes moved per parameter, % of the probe, % of the format's own
probe (the same pass over that step's own streams: its memory ceiling) and the speedup over fp32
moments (same gradient/output dtypes, same run).
"""
from __future__ import annotations

import numpy as np
import torch

from offload.moments.format import FORMATS, MOMENT_KEYS, moment_format
# table-level entries (step_table, moment_table) are internal
from offload.native import adam as kernels
from offload.native import moments as native_moments

from .common import format_table, median, paired_ratio, time_warm

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
             amsgrad=False, maximize=False)
TARGETS = {"bf16": 1.25, "8bit": 1.5}   # the speedup over fp32 moments each format aims at


def true_bytes(fmt, lowp: bool, n: int) -> float:
    """Bytes a single pass must move per parameter (reads + writes)."""
    g_out = (2 + 2) if lowp else 4  # bf16 grad read + bf16 weight written, or fp32 grad read
    mom = 2 * moment_format(fmt).moment_bytes(n)  # m, v read + written (+ scales)
    return 8 + g_out + mom  # + fp32 master read and written


STAGGER = 65600  # bytes between the streams of one contender (64 KiB + 64 B, as the state arena)


def _carve(specs: list) -> list:
    """Tensors (numel, dtype) carved out of one allocation, streams staggered, so no contender
    gets (or escapes) the power-of-two stream distances of separate allocations."""
    nbytes = [(n * torch.empty(0, dtype=dt).element_size() + 63) // 64 * 64 + STAGGER
              for n, dt in specs]
    arena = torch.zeros(sum(nbytes), dtype=torch.uint8)
    out, off = [], 0
    for (n, dt), nb in zip(specs, nbytes):
        out.append(arena[off:off + n * torch.empty(0, dtype=dt).element_size()].view(dt))
        off += nb
    return out


def _streams(n: int, fmt, lowp: bool) -> list:
    """The buffers of one contender: p, g, m, v (+ out with bf16 grads) (+ the format's other
    tensors, such as the two 8-bit scales)."""
    gd = torch.bfloat16 if lowp else torch.float32
    fmt = moment_format(fmt)
    moments = [s for s in fmt.sections if s.key in MOMENT_KEYS]
    rest = [s for s in fmt.sections if s.key not in MOMENT_KEYS]
    specs = [(n, torch.float32), (n, gd)] + [(n, s.dtype) for s in moments] + (
        [(n, torch.bfloat16)] if lowp else []) + [(fmt.entries(s.key, n), s.dtype) for s in rest]
    return _carve(specs)


def probe_regions(n: int) -> list:
    """Five regions of 4 bytes per parameter in one allocation (streams staggered as in _carve),
    filled with fp32 0.5: the streams of every probe of the moments case. The probes run in turn,
    so they share it: stream k of every format (p, g, m, v, out) is a view of region k in its own
    dtype (about 20 B/param for all of them, where one set per format took 92). No probe writes g
    (the gradient stays 0.5, or 0 and 0.5 read as bf16), the others only add to their streams, so
    whatever bits one probe leaves in m, v or out, the next one's arithmetic on them is an addition
    (no multiply of a denormal)."""
    stride = (4 * n + 63) // 64 * 64 + STAGGER
    arena = torch.full((5 * stride // 4,), 0.5)
    return [arena[k * stride // 4:k * stride // 4 + n] for k in range(5)]


def region_streams(regions: list, n: int, fmt, lowp: bool) -> list:
    """The streams p, g, m, v (+ out with bf16 gradients) of one format as views of probe_regions
    (m and v both in exp_avg's dtype: the probe takes one moment dtype)."""
    gd = torch.bfloat16 if lowp else torch.float32
    md = moment_format(fmt).sections[0].dtype   # exp_avg's
    dts = [torch.float32, gd, md, md] + ([torch.bfloat16] if lowp else [])
    return [r.view(dt)[:n] for r, dt in zip(regions, dts)]


def _label(fmt, lowp: bool) -> str:
    return f"{moment_format(fmt).name} moments, {'bf16 grad+out' if lowp else 'fp32 grad'}"


def _probe_name(fmt, lowp: bool) -> str:
    return f"probe: {_label(fmt, lowp)} streams"


class _FormatProbe:
    """One candidate for the memory ceiling of one format: a native pass over that step's own
    streams (p, g, m and v in their element sizes, out) with trivial arithmetic, walking memory in
    one of the ways of kernels.MOMENT_PROBE_MODES (native_adam.bandwidth_probe_moments). The
    ceiling is, round by round, the fastest of the format's candidates (run)."""

    def __init__(self, n: int, fmt: str, lowp: bool, threads: int, mode: int, regions: list):
        self.fmt, self.lowp, self.threads, self.n, self.mode = fmt, lowp, threads, n, mode
        self.name = f"{_probe_name(fmt, lowp)} [{kernels.MOMENT_PROBE_MODES[mode]}]"
        bufs = region_streams(regions, n, fmt, lowp)
        self.p, self.g, self.m, self.v = bufs[:4]
        self.out = bufs[4] if lowp else None

    def step(self) -> None:
        kernels.bandwidth_probe_moments(self.p, self.m, self.v, self.g, self.out, self.threads,
                                        self.mode)


def _format_probes(n: int, fmt: str, lowp: bool, threads: int, regions: list) -> list:
    """The format's ceiling candidates, one per mode, on the shared probe regions (they run in
    turn)."""
    return [_FormatProbe(n, fmt, lowp, threads, m, regions)
            for m in range(len(kernels.MOMENT_PROBE_MODES))]


class _Contender:
    def __init__(self, n: int, fmt, lowp: bool, threads: int):
        fmt = moment_format(fmt)
        self.fmt, self.lowp, self.threads, self.n = fmt, lowp, threads, n
        self.name = _label(fmt, lowp)
        gen = torch.Generator().manual_seed(0)
        bufs = _streams(n, fmt, lowp)
        self.p, self.g = bufs[0], bufs[1]
        self.p.copy_(torch.randn(n, generator=gen))
        self.g.copy_(torch.randn(n, generator=gen) * 1e-2)
        self.out = bufs[4] if lowp else None
        outs = [self.out] if lowp else None
        if not fmt.compressed:   # the fp32 kernel's table
            self.m, self.v = bufs[2], bufs[3]
            kernels.adam_step([self.p], [self.g], [self.m], [self.v], None, [1], outs=outs, **{
                k: v for k, v in HYPER.items() if k != "amsgrad"})
            self.table = np.zeros((1, kernels.TASK_COLS), dtype=np.int64)
            self.table[0] = (self.p.data_ptr(), self.m.data_ptr(), self.v.data_ptr(), 0,
                             self.g.data_ptr(),
                             self.out.data_ptr() if lowp else 0, n, 10,
                             kernels.DTYPE_CODES[self.g.dtype],
                             kernels.DTYPE_CODES[torch.bfloat16] if lowp else 0)
        else:
            rest = [s.key for s in fmt.sections if s.key not in MOMENT_KEYS]
            tail = bufs[len(bufs) - len(rest):]   # the format's other tensors, last (_streams)
            st = self.st = dict(zip(MOMENT_KEYS + tuple(rest), bufs[2:4] + tail))
            scales = [[st[k]] if k in st else None for k in ("exp_avg_scale", "exp_avg_sq_scale")]
            self.table = native_moments.moment_table(
                [self.p], [self.g], [st["exp_avg"]], [st["exp_avg_sq"]], [10], fmt=fmt.name,
                outs=outs, m_scales=scales[0], v_scales=scales[1])

    def step(self) -> None:
        self.fmt.kernel(self.table, HYPER, 1.0, self.threads)


def run(n: int, thread_counts: list, reps: int, probe_modes, progress) -> tuple:
    """Returns (table text, records, summary lines). The summary's ratios are medians of per-round
    ratios (common.paired_ratio); the table shows medians of the times. ``probe_modes(n, threads,
    bufs=)``: the fp32 streams' ceiling candidates (kernel_cases.probe_modes), whose fastest, round
    by round, is the "% probe" column's 100 %."""
    rows, records, summary = [], [], []
    combos = [(fmt, lowp) for lowp in (False, True) for fmt in FORMATS]
    contenders = [_Contender(n, fmt, lowp, thread_counts[0]) for fmt, lowp in combos]
    regions = probe_regions(n)
    fprobes = {(fmt, lowp): _format_probes(n, fmt, lowp, thread_counts[0], regions)
               for fmt, lowp in combos}
    p, g, m, v = region_streams(regions, n, "fp32", False)
    probes = probe_modes(n, thread_counts[0], bufs=[g, p, m, v])
    probe_name = probes[0].CEILING
    ceilings = [(probe_name, probes)] + [(_probe_name(*key), ps) for key, ps in fprobes.items()]
    everyone = contenders + [p for _, ps in ceilings for p in ps]
    for t in thread_counts:
        for c in everyone:
            c.threads = t
        times = {c.name: [] for c in everyone}
        for rep in range(reps):
            # each round starts one later; each timed warm (common.time_warm)
            k = rep % len(everyone)
            for c in everyone[k:] + everyone[:k]:
                times[c.name].append(time_warm(c))
                progress.update(f"moments t={t} {c.name}")
        for name, ps in ceilings:   # each ceiling: its fastest candidate, round by round
            times[name] = [min(r) for r in zip(*(times[p.name] for p in ps))]
        med = {k: median(v) for k, v in times.items()}
        pr = med[probe_name]
        for c in contenders:
            sec = med[c.name]
            base_name = _label("fp32", c.lowp)
            own = _probe_name(c.fmt, c.lowp)
            b = true_bytes(c.fmt, c.lowp, n)
            rows.append([f"flat {n / 2**20:g}M", t, c.name, f"{sec * 1e3:.1f}",
                         f"{n / sec / 1e6:.0f}", f"{b:.2f}",
                         f"{n * b / sec / 1e9:.1f}", f"{pr / sec * 100:.0f}%",
                         f"{med[own] / sec * 100:.0f}%", f"{med[base_name] / sec:.2f}x"])
            speedup = paired_ratio(times[base_name], times[c.name])
            own_pct = paired_ratio(times[own], times[c.name]) * 100
            ceiling = paired_ratio(times[_probe_name("fp32", c.lowp)], times[own])
            records.append(dict(case="moments", threads=t, impl=c.name, seconds=sec, params=n,
                                bytes_per_param=b,
                                pct_of_probe=pr / sec * 100, pct_of_own_probe=own_pct,
                                speedup_vs_fp32_moments=speedup,
                                probe_speedup_vs_fp32_streams=ceiling))
            target = TARGETS.get(c.fmt.name)
            if target is not None:
                line = (f"{'PASS' if speedup >= target else 'MISS'}  [moments] {c.name}, {t} thr: "
                        f">= {target}x the fp32-moment step: {speedup:.2f}x ({own_pct:.0f}% of "
                        f"its own streams' probe; that probe is {ceiling:.2f}x the fp32 "
                        "streams' probe)")
                if speedup < target and kernels.get_isa() != "avx512":
                    line += (f"; expected with the {kernels.get_isa()} kernels (not reached on "
                             "AVX2-only CPUs: docs/moments.md)")
                summary.append(line)
        for (fmt, lowp), _ in fprobes.items():
            sec, b = med[_probe_name(fmt, lowp)], true_bytes(fmt, lowp, n)
            rows.append([f"flat {n / 2**20:g}M", t, _probe_name(fmt, lowp), f"{sec * 1e3:.1f}",
                         f"{n / sec / 1e6:.0f}",
                         f"{b:.2f}", f"{n * b / sec / 1e9:.1f}", f"{pr / sec * 100:.0f}%", "-",
                         "-"])
        rows.append([f"flat {n / 2**20:g}M", t, probe_name, f"{pr * 1e3:.1f}",
                     f"{n / pr / 1e6:.0f}", "28.00", f"{n * 28 / pr / 1e9:.1f}", "100%", "-", "-"])
    headers = ["case", "thr", "moments (kernel call)", "ms", "Mparam/s", "B/param", "GB/s (true)",
               "% probe", "% own probe", "vs fp32 moments"]
    return format_table(headers, rows), records, summary
