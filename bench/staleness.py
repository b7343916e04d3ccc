"""bench/staleness.py: does a pass over memory cost more the longer that memory went untouched?

Two sets of the kernel bench's bandwidth probe streams, X and Y (fp32, Adam's pattern: p, m, v and g
read, p, m, v written). One pass over X, then a pause of T seconds spent sleeping, spinning the CPU
without touching memory, or walking Y over and over, then the pass over X that is timed. If the time grows with T
whatever fills the pause, the machine (typically the hypervisor's or the host's memory management, or
a cache shared with other tenants) makes stale memory slow, and a benchmark that times contenders in
turn must give each one memory it walked equally recently: the kernel bench times every contender on
the second of two steps in a row (offload.bench.common.time_warm).

    python bench/staleness.py 134217728 4 0.1,0.5,1.5,3     # elements, rounds, pauses in seconds

docs/benchmarks.md has the results; one thread.
"""
import statistics
import sys
import time

import torch

from offload.bench.kernel_cases import Probe


def one_pass(probe: Probe) -> float:
    t0 = time.perf_counter()
    probe.step()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 27
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    pauses = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0.1,0.5,1.5,3").split(",")]
    torch.set_num_threads(1)
    x, y = Probe(n, 1, mode=0), Probe(n, 1, mode=0)   # the kernel bench's probe, one thread

    def walk_other(sec: float) -> None:
        end = time.time() + sec
        while time.time() < end:
            one_pass(y)

    def spin(sec: float) -> None:
        end = time.time() + sec
        while time.time() < end:
            pass

    fills = {"sleep": time.sleep, "spin the CPU": spin, "walk other memory": walk_other}
    one_pass(x)
    one_pass(y)
    res: dict = {}
    for _ in range(rounds):
        for name, fill in fills.items():
            for sec in pauses:
                one_pass(x)
                fill(sec)
                res.setdefault((name, sec), []).append(one_pass(x))
    print(f"{n} elements, 4 fp32 streams, 1 thread: ms of a pass over memory last walked T s ago "
          f"(median of {rounds})")
    print(f"{'pause filled by':>18}  " + "  ".join(f"T={s:<5g}" for s in pauses))
    for name in fills:
        print(f"{name:>18}  " + "  ".join(f"{statistics.median(res[(name, s)]):7.1f}" for s in pauses))


if __name__ == "__main__":
    main()
