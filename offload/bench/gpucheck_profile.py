"""bench/gpucheck_profile.py: what ``bench/gpu_check.py``'s performance section reads from a
torch.profiler run: the copy kinds (pinned or pageable), the copy time in each direction, and the
share of it that overlaps GPU kernels; with ``keep``, a gzip of the Chrome trace beside the JSON
lines, to read the timeline afterwards (chrome://tracing or ui.perfetto.dev).
"""
from __future__ import annotations

import gzip
import json
import os
import shutil

from .gpucheck_common import Ctx

__all__ = ["profile_summary"]


def profile_summary(ctx: Ctx, prof, keep: str = "") -> dict:
    path = os.path.join(ctx.disk_dir("prof"), "trace.json")
    prof.export_chrome_trace(path)
    if keep and ctx.out_dir:
        with open(path, "rb") as src, gzip.open(
                os.path.join(ctx.out_dir, f"profile_{keep}.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    with open(path) as f:
        evs = json.load(f).get("traceEvents", [])
    copies = [e for e in evs if e.get("cat") == "gpu_memcpy"]
    kernels = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in evs if e.get("cat") == "kernel"]
    kinds = {}
    for e in copies:
        kinds[e.get("name", "?")] = kinds.get(e.get("name", "?"), 0) + 1
    kernels.sort()
    merged = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def overlap(a, b):
        return sum(max(0, min(b, y) - max(a, x)) for x, y in merged if x < b and y > a)
    tot = {"d2h": [0.0, 0.0], "h2d": [0.0, 0.0]}
    for e in copies:
        k = ("d2h" if "DtoH" in e.get("name", "") else "h2d" if "HtoD" in e.get("name", "")
             else None)
        if k:
            a, d = e["ts"], e.get("dur", 0)
            tot[k][0] += d
            tot[k][1] += overlap(a, a + d)
    return dict(copy_kinds=kinds, pageable=sum(n for k, n in kinds.items() if "Pageable" in k),
                d2h_ms=tot["d2h"][0] / 1e3, h2d_ms=tot["h2d"][0] / 1e3,
                d2h_overlap=tot["d2h"][1] / tot["d2h"][0] if tot["d2h"][0] else None,
                h2d_overlap=tot["h2d"][1] / tot["h2d"][0] if tot["h2d"][0] else None)
