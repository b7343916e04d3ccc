"""bench/checkpoint.py: save/load throughput of offload.save/load against its peers, same run.

Peers: torch.save(optimizer.state_dict()), safetensors.torch.save_file of the flattened state,
and the ceiling: plain sequential os.write of the same number of bytes (16 MiB chunks), plus the
same plain writes through aiofiles (the question was whether aiofiles helps: it runs the same
write() calls on a thread pool). Every writer fsyncs before the clock stops. Medians of --reps.

    python bench/checkpoint.py --mparams 32 --dir /tmp/ckbench --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time

import torch

import offload

CHUNK = 16 << 20


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_bytes(opt) -> list:
    return [t.reshape(-1).view(torch.uint8).numpy() for st in opt.state.values() for k, t in st.items() if k != "step"]


def plain_write(arrays, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in arrays:
            mv = memoryview(a)
            for b in range(0, len(mv), CHUNK):
                part = mv[b:b + CHUNK]
                while len(part):
                    part = part[os.write(fd, part):]
        os.fsync(fd)
    finally:
        os.close(fd)


def aiofiles_write(arrays, path):
    import aiofiles

    async def go():
        async with aiofiles.open(path, "wb") as f:
            for a in arrays:
                mv = memoryview(a)
                for b in range(0, len(mv), CHUNK):
                    await f.write(mv[b:b + CHUNK])
            await f.flush()
            await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())
    asyncio.run(go())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mparams", type=float, default=32, help="millions of fp32 parameters (state = 8 B each)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/offload-ckpt-bench")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    n = int(args.mparams * 1e6) // args.tensors
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(args.tensors)]
    opt = offload.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    arrays = state_bytes(opt)
    nbytes = sum(a.nbytes for a in arrays)
    os.makedirs(args.dir, exist_ok=True)
    d = args.dir

    def torch_save():
        path = os.path.join(d, "torch.pt")
        torch.save(opt.state_dict(), path)
        _fsync_path(path)

    def st_save():
        from safetensors.torch import save_file
        flat = {f"{i}.{k}": v for i, st in opt.state_dict()["state"].items() for k, v in st.items() if k != "step"}
        path = os.path.join(d, "st.safetensors")
        save_file(flat, path)
        _fsync_path(path)

    def async_save():
        h = offload.save_async(opt, os.path.join(d, "offload_async"))
        t_ret = time.perf_counter()
        h.result()
        return t_ret

    fresh = offload.AdamW([torch.nn.Parameter(torch.zeros(n)) for _ in range(args.tensors)])

    def torch_load():
        sd = torch.load(os.path.join(d, "torch.pt"), weights_only=True)
        fresh.load_state_dict(sd)

    cases = [
        ("plain os.write (ceiling)", lambda: plain_write(arrays, os.path.join(d, "plain.bin"))),
        ("aiofiles write", lambda: aiofiles_write(arrays, os.path.join(d, "aio.bin"))),
        ("offload.save", lambda: offload.save(opt, os.path.join(d, "offload"))),
        ("offload.save_async (total)", async_save),
        ("torch.save(state_dict)", torch_save),
        ("safetensors save_file", st_save),
        ("offload.load (verify + read)", lambda: offload.load(fresh, os.path.join(d, "offload"))),
        ("torch.load + load_state_dict", torch_load),
    ]
    results, blocking = {}, []
    for _ in range(args.reps):
        for name, fn in cases:
            t0 = time.perf_counter()
            r = fn()
            t1 = time.perf_counter()
            results.setdefault(name, []).append(t1 - t0)
            if name.startswith("offload.save_async"):
                blocking.append(r - t0)
    ceiling = statistics.median(results[cases[0][0]])
    print(f"state: {nbytes / 2**20:.0f} MiB in {len(arrays)} tensors; dir {d}; median of {args.reps}")
    print(f"{'method':<32} {'seconds':>9} {'GiB/s':>8} {'vs plain write':>15}")
    rows = []
    for name, ts in results.items():
        m = statistics.median(ts)
        rows.append({"method": name, "median_s": m, "gib_s": nbytes / m / 2**30, "vs_plain": ceiling / m})
        print(f"{name:<32} {m:9.3f} {nbytes / m / 2**30:8.2f} {ceiling / m:14.2f}x")
    print(f"offload.save_async returns after {statistics.median(blocking) * 1e3:.1f} ms (the caller's blocking part)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "reps": args.reps, "rows": rows,
                       "async_blocking_s": statistics.median(blocking)}, f, indent=1)
    shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
