"""bench/common.py: helpers shared by the benchmark subcommands: timing, medians, progress, tables,
JSON."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Iterable, Optional


def add_common_options(p, *, reps: int, what: str = "repetitions") -> None:
    """Options every benchmark subcommand takes, spelled and meaning the same everywhere."""
    p.add_argument("--reps", type=int, default=reps,
                   help=f"timed {what} (median reported; default {reps})")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")


def cpu_model() -> str:
    """The model name, and the family/model numbers (a VM may show only "Intel(R) Xeon(R)
    Processor", which names no generation)."""
    info = machine_info()
    name = info.get("cpu", "unknown CPU")
    return f"{name} ({info['cpu_id']})" if info.get("cpu_id") else name


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def paired_ratio(num: list, den: list) -> float:
    """Median over rounds of num[k] / den[k]: two contenders timed in the same round-robin round
    see the same memory bandwidth, so the per-round ratio cancels the drift that a ratio of two
    medians (each from a different mix of fast and slow moments) keeps. The targets use it."""
    if len(num) != len(den) or not num:
        raise ValueError("paired_ratio needs two equally long, non-empty series (one "
                         "time per round)")
    return statistics.median([a / b for a, b in zip(num, den)])


def time_warm(contender) -> float:
    """Seconds of one ``contender.step()``, timed right after an untimed one (each preceded by
    ``contender.prepare()`` where it has one). On some machines a pass over memory costs more the
    longer that memory went untouched (up to 1.6x after 3 s on a VM measured: docs/benchmarks.md),
    whatever ran meanwhile; timing the second of two steps in a row puts every contender on memory
    it walked a moment ago, however long a round takes and whichever contenders share memory (the
    probe's ways of walking one set of streams, the kernel call and the step on the same
    tensors)."""
    prepare = getattr(contender, "prepare", None)
    for _ in range(2):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        contender.step()
        dt = time.perf_counter() - t0
    return dt


def verdict(ours: float, peers: dict, *, higher_is_better: bool = False,
            ours_name: str = "offload", label: str = "", ceiling: bool = False) -> Optional[dict]:
    """One line comparing ``ours`` with the best of ``peers`` (name -> figure of the same run):
    times (lower is better) or rates (``higher_is_better``). Against peers ``speedup`` > 1 means
    ours is faster (within 2 %: even). With ``ceiling`` the one entry of ``peers`` is a limit (a
    disk's fio figure, a step's slowest part alone) and ``speedup`` is ours / the ceiling: how
    close ours gets to it. None when nothing was measured to compare with."""
    peers = {k: v for k, v in peers.items() if v}
    if ours is None or not peers:
        return None
    head = f"{label}: " if label else ""
    best = (max if higher_is_better else min)(peers, key=peers.get)
    if ceiling:
        ratio = ours / peers[best]
        word = ("at the ceiling (within 2 %)" if abs(ratio - 1) <= 0.02 else
                f"{abs(ratio - 1) * 100:.0f} % {'over' if ratio > 1 else 'under'} it")
        verb = "reaches" if higher_is_better else "takes"
        return dict(peer=best, speedup=ratio, line=f"{head}{ours_name} {verb} {ratio:.2f}x its "
                                                   f"ceiling ({best}): {word}")
    ratio = ours / peers[best] if higher_is_better else peers[best] / ours
    word = ("offload faster" if ratio >= 1.02 else "the peer faster" if ratio <= 0.98
            else "even (within 2 %)")
    return dict(peer=best, speedup=ratio, line=f"{head}{ours_name} is {ratio:.2f}x the fastest "
                                               f"peer ({best}): {word}")


class Progress:
    """tqdm when installed, else a one-line counter on stderr (silent when not a terminal)."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.bar = None
        self.n, self.total, self.desc = 0, total, desc
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
            except ImportError:
                pass

    def update(self, label: str = "") -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.enabled and sys.stderr.isatty():
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} {label[:50]:<50}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and sys.stderr.isatty():
            sys.stderr.write("\r" + " " * 80 + "\r")


def format_table(headers: list, rows: list) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        fields = {}
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        if "model name" in fields:
            info["cpu"] = fields["model name"]
        if "cpu family" in fields and "model" in fields:
            info["cpu_id"] = f"family {fields['cpu family']} model {fields['model']}" + (
                f" stepping {fields['stepping']}" if "stepping" in fields else "")
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def output_path_problem(path: str) -> Optional[str]:
    """Why a result file could not be written at `path` (None: it can), asked before a run so that
    minutes of measurements are not lost to a missing folder at the end. Creates the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder {folder}: {e.strerror or e}"
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return None


def write_json(path: Optional[str], payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def scratch_dirs(spec, prefix: str) -> list:
    """A fresh directory in each directory ``spec`` names (several: a list or comma-separated, as
    ``nvme_dir`` takes them; None: the system temp dir), for a benchmark's state files. The caller
    removes them (:func:`remove_dirs`); the directories ``spec`` names are never removed."""
    import tempfile
    from ..state.statedir import parse_dirs
    return [tempfile.mkdtemp(prefix=prefix, dir=d if d is not None else tempfile.gettempdir())
            for d in parse_dirs(spec)]


def remove_dirs(dirs: list) -> None:
    import shutil
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
