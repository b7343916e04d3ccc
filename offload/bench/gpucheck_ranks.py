"""bench/gpucheck_ranks.py: check 20 of ``bench/gpu_check.py`` - 2 ranks on the one GPU against one
process.

Two processes (``python -m offload.bench.gpucheck_ranks``, one per rank) share the GPU (both on the
current CUDA device; NCCL refuses two ranks on one GPU, so gloo, which moves CUDA tensors through
pinned host buffers) and run the scenarios of offload/bench/ranks.py: DDP, ZeroRedundancyOptimizer
over DDP (optimizer_class=offload.AdamW) and FSDP2 (fully_shard, CUDA parameters, offload's GPU
mode), each with and without clipping, every rank against single-process torch.optim.AdamW on the
full batch on the same GPU, to rounding (rtol 2e-5, atol 2e-6); DDP and ZeRO-1 replicas bitwise
across ranks. With ``--device fake`` the same processes run on the CPU through the fake device.

First each rank probes the collectives the scenarios need with tensors on its device (gloo's CUDA
support differs by collective and torch version); a scenario whose collective fails or gives a
wrong value on any rank is skipped, with the collective and its error as the reason. After each
scenario the ranks exchange verdicts through a file store (not a collective: a rank that failed
mid-collective cannot leave the other hanging in the next scenario); a rank stops when its peer
does not report in time. The parent kills both process groups at the check's deadline, or shortly
after one rank exits with an error, and always before it returns; a rank also exits by itself when
its parent is gone.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import torch

from .gpucheck_common import Ctx, Result, Skip

WORLD = 2
GRACE_S = 10.0    # how long the other ranks may still run after one exits with an error
# the collectives each kind of scenario needs, probed first with tensors on the scenario's device
NEEDS = {"ddp": ("broadcast", "all_reduce", "all_gather"),
         "zero1": ("broadcast", "all_reduce", "all_gather"),
         "fsdp2": ("all_gather_single", "reduce_scatter_avg", "all_reduce_fp64")}


# ---------------------------------------------------------------------------- the parent: check 20
def run_group(cmds, timeout_s: float, logs, env=None, cwd=None, grace_s: float = GRACE_S) -> list:
    """Run ``cmds`` at once, each in its own process group (stdout and stderr to its log file);
    kill every group still running at ``timeout_s``, or ``grace_s`` after one exits with an error.
    Returns per command ``dict(rc, timed_out, killed, seconds, pid)``; every process has exited on
    return, whatever happened."""
    procs, out, t0 = [], [], time.time()
    try:
        for cmd, log in zip(cmds, logs):
            with open(log, "w") as fh:
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                              cwd=cwd, start_new_session=True))
        ends = [None] * len(procs)
        deadline = t0 + timeout_s
        while any(e is None for e in ends) and time.time() < deadline:
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.time() - t0
                    if p.returncode != 0:
                        deadline = min(deadline, time.time() + grace_s)
            time.sleep(0.05)
        now = time.time() - t0
        for i, p in enumerate(procs):
            end = now if ends[i] is None else ends[i]
            out.append(dict(rc=None, timed_out=ends[i] is None and now >= timeout_s,
                            killed=ends[i] is None, seconds=round(end, 2), pid=p.pid))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
    for rec, p in zip(out, procs):
        rec["rc"] = p.returncode
    return out


def _read(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tail(path: str, n: int = 1200) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _commands(ctx: Ctx, work: str, outs: list, timeout: float) -> list:
    # the runner's --inject-fail 20_two_ranks:<scenario>: that scenario raises on the last rank
    inject = [x.split(":", 1)[1] for x in (getattr(ctx.args, "inject_fail", "") or "").split(",")
              if x.startswith("20_two_ranks:")]
    return [[sys.executable, "-m", "offload.bench.gpucheck_ranks", "--rank", str(r), "--dir", work,
             "--device", ctx.kind, "--out", outs[r], "--timeout", f"{min(40.0, timeout / 2):.0f}",
             "--parent", str(os.getpid()), "--inject-fail", ",".join(inject)]
            for r in range(WORLD)]


def check_ranks(ctx: Ctx, res: Result) -> None:
    import torch.distributed as dist
    from .ranks import ATOL, RTOL, SCENARIOS
    if not (dist.is_available() and dist.is_gloo_available()):
        raise Skip("torch.distributed with the gloo backend is not available")
    work = ctx.disk_dir("ranks")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    timeout = max(5.0, min(ctx.check_deadline, ctx.global_deadline) - time.time())
    outs = [os.path.join(work, f"rank{r}.jsonl") for r in range(WORLD)]
    logs = [os.path.join(work, f"rank{r}.log") for r in range(WORLD)]
    procs = run_group(_commands(ctx, work, outs, timeout), timeout, logs, env=env, cwd=root)
    res.data["processes"] = procs
    recs = [_read(p) for p in outs]
    res.data["probe"] = next((x["probe"] for x in recs[0] if "probe" in x), None)
    skipped, unreported, worst = [], [], 0.0
    for name in SCENARIOS:
        got = [next((x for x in rr if x.get("scenario") == name and "ok" in x), None)
               for rr in recs]
        if any(g is None for g in got):
            unreported.append(name)
        elif all(g.get("skip") for g in got):
            skipped.append(f"{name} ({got[0]['skip']})")
        else:
            errors = {r: g["error"] for r, g in enumerate(got) if not g["ok"]}
            worst = max([worst] + [(g.get("data") or {}).get("max_abs_diff", 0.0) for g in got])
            res.data[name] = dict(seconds=max(g["seconds"] for g in got), tracebacks={
                r: g.get("traceback") for r, g in enumerate(got) if not g["ok"]})
            res.data[name].update({f"rank{r}": g.get("data") for r, g in enumerate(got)})
            res.expect(not errors, f"{name}: 2 ranks == one process",
                       **({"errors": errors} if errors else {}))
    if unreported:   # where each rank was, and why it stopped
        last = {r: next((x["scenario"] for x in reversed(rr) if "scenario" in x), None)
                for r, rr in enumerate(recs)}
        res.expect(False, f"not reported by both ranks: {', '.join(unreported)}", last=last,
                   killed_at_the_budget=[p["timed_out"] for p in procs])
    for r, pr in enumerate(procs):
        res.expect(pr["rc"] == 0, f"rank {r} exits 0",
                   **({} if pr["rc"] == 0 else dict(pr, log=_tail(logs[r]))))
    if res.n_expect == len(procs) and not res.failures and skipped:
        raise Skip("every scenario skipped: " + "; ".join(skipped))
    res.note(f"2 gloo processes on one {'GPU' if ctx.cuda else 'fake device'}; parameters against "
             f"one process to rtol {RTOL:g}, atol {ATOL:g} (largest |diff| {worst:.3g}); DDP and "
             "ZeRO-1 replicas bitwise")
    if skipped:
        res.note("skipped: " + "; ".join(skipped))


# ---------------------------------------------------------------------------- a rank
def _probe(device) -> dict:
    """Each collective the scenarios use, on tensors of ``device``: None when it gave the right
    values, else what went wrong."""
    import torch.distributed as dist
    rank = dist.get_rank()
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def full(v, dtype=torch.float32, n=4):
        return torch.full((n,), float(v), dtype=dtype, device=device)

    def all_reduce(dtype=torch.float32):
        t = full(rank + 1, dtype)
        dist.all_reduce(t)
        return t, full(sum(range(1, WORLD + 1)), dtype)

    def broadcast():
        t = full(rank + 7)
        dist.broadcast(t, src=0)
        return t, full(7)

    def all_gather():
        every = [full(-1) for _ in range(WORLD)]
        dist.all_gather(every, full(rank))
        return torch.cat(every), torch.cat([full(r) for r in range(WORLD)])

    def all_gather_single():   # FSDP2's all-gather, DTensor.full_tensor()
        out = full(-1, n=4 * WORLD)
        gather_single(out, full(rank))
        return out, torch.cat([full(r) for r in range(WORLD)])

    def reduce_scatter_avg():   # FSDP2's gradient reduction (fp32, several ranks: AVG)
        ramp = torch.arange(4 * WORLD, dtype=torch.float32, device=device)
        out = full(-1)
        scatter_single(out, ramp * (rank + 1), op=dist.ReduceOp.AVG)
        return out, (ramp * sum(range(1, WORLD + 1)) / WORLD)[4 * rank:4 * rank + 4]

    probes = dict(broadcast=broadcast, all_reduce=all_reduce, all_gather=all_gather,
                  all_gather_single=all_gather_single, reduce_scatter_avg=reduce_scatter_avg,
                  all_reduce_fp64=lambda: all_reduce(torch.float64))   # offload's global norm
    found = {}
    for name, fn in probes.items():
        try:
            got, want = (t.cpu() for t in fn())
            found[name] = None if torch.equal(got, want) else \
                f"wrong values {got.tolist()} (expected {want.tolist()})"
        except Exception as e:  # noqa: BLE001 - an unsupported collective is a finding
            found[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return found


def _watch_parent(ppid: int, limit_s: float) -> None:
    """Exit when the process ``ppid`` is no longer the parent, or after ``limit_s``: a rank never
    outlives its check."""
    t0 = time.time()

    def watch():
        while os.getppid() == ppid and time.time() - t0 < limit_s:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _scenarios(a, cuda: bool, probe: dict, verdicts, emit) -> None:
    from .ranks import SCENARIOS, Rig
    wait = datetime.timedelta(seconds=a.timeout)
    for name in SCENARIOS:
        broken = [f"gloo {c} on {a.device} tensors: {probe[c]}" for c in NEEDS[name.split("_")[0]]
                  if probe[c]]
        if broken:
            emit(dict(scenario=name, ok=True, skip="; ".join(broken), seconds=0.0))
            continue
        emit(dict(scenario=name, started=True))
        t0 = time.time()
        rec = dict(scenario=name, ok=True, error=None, data=None)
        try:
            rec["data"] = SCENARIOS[name](Rig(a.rank, cuda=cuda))
            if name in a.inject_fail.split(",") and a.rank == WORLD - 1:   # after its collectives
                raise RuntimeError("failure injected by --inject-fail")
        except Exception as e:  # noqa: BLE001 - this scenario's FAIL, reported with its traceback
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:600],
                       traceback=traceback.format_exc(limit=6))
        rec["seconds"] = round(time.time() - t0, 2)
        emit(rec)
        verdicts.set(f"{name}/{a.rank}", "ok" if rec["ok"] else "error")
        try:   # the peer finished this scenario too: no collective of it is left pending
            verdicts.wait([f"{name}/{r}" for r in range(WORLD) if r != a.rank], wait)
        except Exception:  # noqa: BLE001
            emit(dict(scenario="(stopped)",
                      error=f"the other rank did not finish {name} in {a.timeout:.0f} s"))
            os._exit(2)


def rank_main(argv=None) -> int:
    import torch.distributed as dist
    p = argparse.ArgumentParser(prog="python -m offload.bench.gpucheck_ranks")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dir", required=True, help="the rendezvous and verdict files")
    p.add_argument("--device", choices=["cuda", "fake"], default="cuda")
    p.add_argument("--out", required=True, help="JSON lines: the probe, then a line per scenario")
    p.add_argument("--timeout", type=float, default=40.0,
                   help="seconds a collective or the other rank may take")
    p.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--inject-fail", dest="inject_fail", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    _watch_parent(os.getppid() if a.parent is None else a.parent, 6 * a.timeout)
    torch.set_num_threads(1)
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)   # both ranks on the one GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    wait = datetime.timedelta(seconds=a.timeout)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(a.dir, 'rendezvous')}",
                            rank=a.rank, world_size=WORLD, timeout=wait)
    verdicts = dist.FileStore(os.path.join(a.dir, "verdicts"), WORLD)
    verdicts.set_timeout(wait)
    with open(a.out, "a") as out:
        def emit(rec):
            out.write(json.dumps(rec, default=str) + "\n")
            out.flush()
        probe = _probe(torch.device("cuda") if cuda else torch.device("cpu"))
        # a collective that failed on any rank: every rank skips the scenarios that need it
        verdicts.set(f"probe/{a.rank}", json.dumps(probe))
        for r in range(WORLD):
            for c, err in json.loads(verdicts.get(f"probe/{r}")).items():
                probe[c] = probe[c] or (err and f"(rank {r}) {err}")
        emit(dict(probe=probe))
        _scenarios(a, cuda, probe, verdicts, emit)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
