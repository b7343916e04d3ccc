"""tools/ab_step.py: is a change slower? The warm offload.AdamW.step() of two source trees, paired round-robin.

One resident worker process per tree, started in the tree with ``PYTHONPATH=<tree>`` (it checks
that ``offload`` comes from there: an editable install or the current directory would otherwise
win); each tree's own native module is used, so build it in both. Each round asks every worker, in
turn, to time ``--reps`` steps of each case at each thread count and reports the median; the
verdict is the median over rounds of the per-round ratio B/A (pairing cancels the VM's drift).
Cases: ``rows`` (10000 tensors x 1024 fp32), ``flat`` (one 32M fp32 tensor), ``small`` (10000 x
64), ``one`` (one tensor of 1024: a step that is all fixed cost), ``mid`` (10 x 65536).

    python tools/ab_step.py /tmp/before . --rounds 15 --threads 1,2
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {"rows": (10000, 1024), "flat": (1, 32 << 20), "small": (10000, 64), "one": (1, 1024), "mid": (10, 65536)}

WORKER = r"""
import json, sys, time, statistics, torch, offload
print(offload.__file__, flush=True)
def make(case, threads):
    n, size = json.loads(case)
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(size, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(size, generator=g)
    opt = offload.AdamW(ps, lr=1e-4, threads=threads)
    for _ in range(3):
        opt.step()
    return opt
cache = {}
for line in sys.stdin:
    case, threads, reps = line.split("|")
    key = (case, int(threads))
    if key not in cache:
        cache.clear()
        cache[key] = make(case, int(threads))
    opt = cache[key]
    ts = []
    for _ in range(int(reps)):
        t = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t)
    print(statistics.median(ts) * 1e3, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--cases", default="rows,flat")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    trees = [os.path.abspath(a.before), os.path.abspath(a.after)]
    work = [subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=t, env=dict(os.environ, PYTHONPATH=t)) for t in trees]
    pairs = list(zip(trees, work))
    for t, w in pairs:
        got = w.stdout.readline().strip()
        if not got.startswith(os.path.join(t, "offload") + os.sep):
            raise SystemExit(f"the worker for {t} imported offload from {got or 'nowhere'}")
    ratios, times = {}, {}
    try:
        for case in a.cases.split(","):
            for th in map(int, a.threads.split(",")):
                for r in range(a.rounds):
                    got = []
                    for t, w in (pairs if r % 2 == 0 else pairs[::-1]):
                        w.stdin.write(f"{json.dumps(CASES[case])}|{th}|{a.reps}\n")
                        w.stdin.flush()
                        line = w.stdout.readline()
                        if not line:
                            raise SystemExit(f"the worker for {t} stopped (its error is above)")
                        got.append(float(line))
                    ms_a, ms_b = got if r % 2 == 0 else got[::-1]
                    times.setdefault((case, th), []).append((ms_a, ms_b))
                    ratios.setdefault((case, th), []).append(ms_b / ms_a)
                rs = ratios[(case, th)]
                ta = statistics.median(x for x, _ in times[(case, th)])
                tb = statistics.median(y for _, y in times[(case, th)])
                print(f"{case:6} threads={th}  before {ta:8.2f} ms  after {tb:8.2f} ms  after/before median "
                      f"{statistics.median(rs):.3f} (rounds {min(rs):.3f}..{max(rs):.3f}, n={len(rs)})", flush=True)
    finally:
        for w in work:
            w.stdin.close()
            w.wait()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{c}/{t}": dict(ratios=v, times=times[(c, t)]) for (c, t), v in ratios.items()}, f, indent=1)


if __name__ == "__main__":
    main()
