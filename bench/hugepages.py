"""bench/hugepages.py: which streams of an fp32 Adam step get transparent huge pages, and what they are
worth: offload.AdamW (parameters and gradients huge-paged or not), torch AdamW(fused=True) (everything
huge-paged or not) and DeepSpeedCPUAdam when importable, stepped round-robin in one process.

    python bench/hugepages.py 134217728 1,2 7      # elements, threads, rounds

Linux only (madvise through ctypes); docs/benchmarks.md has the results.
"""
import ctypes
import ctypes.util
import statistics
import sys
import time

import torch

import offload

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def advise_huge(t):
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned inside of an untouched tensor."""
    huge = 1 << 21
    start = (t.data_ptr() + huge - 1) // huge * huge
    end = (t.data_ptr() + t.numel() * t.element_size()) // huge * huge
    return end > start and _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14) == 0

def thp_kb():
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])

def huge_empty(numel):
    t = torch.empty(numel + (1 << 19), dtype=torch.float32)
    off = (-(t.data_ptr() // 4)) % (1 << 19)
    t = t[off:off + numel]
    assert advise_huge(t)
    return t

N = int(float(sys.argv[1])); THREADS = [int(x) for x in sys.argv[2].split(",")]; ROUNDS = int(sys.argv[3])

def param(huge):
    g = torch.Generator().manual_seed(0)
    p = huge_empty(N) if huge else torch.empty(N)
    p.copy_(torch.randn(N, generator=g))
    gr = huge_empty(N) if huge else torch.empty(N)
    gr.copy_(torch.randn(N, generator=g))
    p = torch.nn.Parameter(p); p.grad = gr
    return p

C = {}
def add(name, kind, huge_state, huge_pg):
    before = thp_kb()
    p = param(huge_pg)
    if kind == "offload":
        opt = offload.AdamW([p], lr=1e-3)
        opt.step()   # (its state arena is a NumPy allocation: NumPy advises huge pages itself)
    else:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        if huge_state:
            opt.state[p]["step"] = torch.tensor(0.0)
            opt.state[p]["exp_avg"] = huge_empty(N).zero_()
            opt.state[p]["exp_avg_sq"] = huge_empty(N).zero_()
        opt.step()
    C[name] = (opt, (thp_kb() - before) / 1024)

add("offload", "offload", False, False)
add("offload thp-all", "offload", True, True)
add("torch fused", "torch", False, False)
add("torch fused thp-all", "torch", True, True)
try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    before = thp_kb(); p = param(False)
    ds = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True, fp32_optimizer_states=True); ds.step()
    C["deepspeed"] = (ds, (thp_kb() - before) / 1024)
except Exception as e:
    print("deepspeed not measured:", repr(e)[:200])
for k, (_, mb) in C.items():
    print(f"{k:22s} huge pages gained {mb:6.0f} MiB")
gb = 4 * N * 7 / 1e9
for th in THREADS:
    torch.set_num_threads(th)
    ts = {k: [] for k in C}
    for _ in range(ROUNDS):
        for k, (opt, _) in C.items():
            if isinstance(opt, offload.AdamW):
                opt.kernel_threads = th
            t0 = time.perf_counter(); opt.step(); ts[k].append(time.perf_counter() - t0)
    print(f"N={N / 2**20:.0f}M threads={th} rounds={ROUNDS} (GB/s = 28 B/param)")
    base = statistics.median(ts["offload"])
    for k, t in ts.items():
        m = statistics.median(t)
        print(f"  {k:22s} {m * 1e3:8.1f} ms {gb / m:6.1f} GB/s  vs offload {base / m:5.2f}x")
