"""bench/gpu_table.py: the markdown table and the target lines of ``python -m offload.bench gpu``,
from the rows offload/bench/gpu.py collected (one dict per row, as offload/bench/gpu_rows.py
measured it)."""
from __future__ import annotations

from typing import Optional


def iter_ms(r: dict) -> Optional[float]:
    """The row's iteration time: the median of the CUDA-event times (the host clock on the CPU)."""
    return r.get("event_median_ms", r.get("host_median_ms"))


def _by_size(results: list) -> dict:
    out = {}
    for r in results:
        out.setdefault(r["size"], {})[r["row"]] = r
    return out


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _threads(t: Optional[dict]) -> str:
    if not t:
        return "-"
    return " ".join(f"{k}={v}" for k, v in t.items() if v not in (None, 0, ""))


def markdown(head: dict, results: list) -> str:
    gpu = head.get("gpu") or "CPU (plumbing only: a tiny model, offload through its fake device)"
    others = ", ".join(f"{k} {v}" for k, v in head.get("versions", {}).items() if k != "torch")
    lines = [f"GPU: {gpu}; torch {head.get('versions', {}).get('torch')}; "
             f"{others}; "
             f"host CPU: {head.get('machine', {}).get('cpu', '?')}, "
             f"{head.get('machine', {}).get('cpus')} CPUs; {head.get('time')}", ""]
    cols = ["size", "row", "iter ms (median)", "mean", "wall", "exposed ms", "x fwd+bwd",
            "GPU peak GB",
            "host GB", "host B/param", "loss[0]", "loss[last]", "setup s", "threads", "note"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for size, rows in _by_size(results).items():
        base = rows.get("baseline")
        b_ms = iter_ms(base) if base and "error" not in base else None
        b_host = base.get("host_growth_gb") if base else None
        first = base["losses"][0] if base and base.get("losses") else None
        for name, r in rows.items():
            if "skipped" in r or "error" in r:
                why = r.get("skipped") or r["error"]
                extra = f" (GPU peak {r['gpu_peak_gb']:.1f} GB)" if r.get("gpu_peak_gb") else ""
                lines.append(f"| {size} | {r.get('label', name)} | "
                             f"{'skipped' if 'skipped' in r else 'error'}: {why}{extra} |"
                             + " |" * (len(cols) - 3))
                continue
            t = iter_ms(r)
            mean = r.get("event_mean_ms", r.get("host_mean_ms"))
            exposed = t - b_ms if b_ms is not None and name != "baseline" else None
            per_param = None
            if b_host is not None and r.get("host_growth_gb") is not None and r.get("params"):
                per_param = max(0.0, r["host_growth_gb"] - b_host) * 1e9 / r["params"]
            loss0 = r["losses"][0]
            mark = "" if first is None or loss0 == first else " (differs)"
            note = r.get("note", "")
            lines.append("| " + " | ".join([
                size, r.get("label", name), _f(t), _f(mean), _f(r.get("wall_ms")), _f(exposed),
                _f(t / b_ms if b_ms else None, ".2f"), _f(r.get("gpu_peak_gb"), ".2f"),
                _f(r.get("host_growth_gb"), ".1f"),
                _f(per_param, ".1f"), f"{loss0:.6f}{mark}", f"{r['losses'][-1]:.6f}",
                _f(r.get("setup_s")), _threads(r.get("threads")), note]) + " |")
    return "\n".join(lines) + "\n"


def targets(results: list) -> list:
    """One line per target the table can decide (PASS / MISS, with the figures), per size."""
    out = []
    for size, rows in _by_size(results).items():
        ok = {k: r for k, r in rows.items() if "losses" in r}
        base = ok.get("baseline")
        if base is None:
            continue
        fb = iter_ms(base)
        fwd, bwd = base.get("fwd_ms"), base.get("bwd_ms")

        def line(cond, text):
            out.append(f"{size}: {'PASS' if cond else 'MISS'} {text}")
        # spare GPU memory may hold state (gpu_state='auto')
        for name in ("offload", "offload_clip"):
            r = ok.get(name)
            if r is not None:
                line(iter_ms(r) <= 1.10 * fb, f"{name} {iter_ms(r):.1f} ms <= 1.10x forward + "
                                              f"backward ({1.10 * fb:.1f} ms)")
        r = ok.get("offload_host")   # every state on the host
        if (r is not None and fwd is not None and bwd is not None
            and r.get("cpu_step_ms") is not None):
            cpu = r["cpu_step_ms"]
            bound = 1.10 * (fwd + max(bwd, cpu))
            line(iter_ms(r) <= bound, f"offload_host {iter_ms(r):.1f} ms <= forward {fwd:.1f} + "
                                      f"max(backward {bwd:.1f}, CPU step {cpu:.1f}) + 10 % "
                                      f"= {bound:.1f} ms")
        r = ok.get("offload_delayed")
        if r is not None and r.get("cpu_step_ms") is not None:
            bound = 1.05 * max(fb, r["cpu_step_ms"])
            line(iter_ms(r) <= bound, f"offload_delayed {iter_ms(r):.1f} ms <= 1.05x max(forward "
                                      f"+ backward, CPU step {r['cpu_step_ms']:.1f}) "
                                      f"= {bound:.1f} ms")
        ours = ok.get("offload")
        for peer in ("deepspeed_zero2", "torchao"):
            p = ok.get(peer)
            if ours is None or p is None:
                continue
            speed = iter_ms(p) / iter_ms(ours)
            mem_ok = (ours.get("gpu_peak_gb") or 0) <= (p.get("gpu_peak_gb") or 0) * 1.001
            line(speed >= 1.5 and mem_ok, f"offload {speed:.2f}x faster than {peer} (target >= "
                                          f"1.5x), GPU peak {_f(ours.get('gpu_peak_gb'), '.1f')} "
                                          f"vs {_f(p.get('gpu_peak_gb'), '.1f')} GB")
        first = {k: r["losses"][0] for k, r in ok.items() if k != "deepspeed_zenflow"}
        if first:
            same = len(set(first.values())) == 1
            line(same, "iteration 0 loss equal in every row" + ("" if same else f": {first}"))
    return out
