"""bench/io_peers.py: the peers of ``python -m offload.bench io`` (bench/io.py): buffered
``pwrite`` / ``preadv``, ``numpy.memmap``, aiofiles and DeepSpeed's AIO handle, each writing then
reading the same region as our I/O engine; the buffered ones drop the file's cached pages before
reading. Each returns {"write", "read"} in bytes/s, or None where the peer is not installed.
"""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import torch

__all__ = ["bench_pwrite", "bench_memmap", "bench_aiofiles", "bench_deepspeed", "drop_cache"]


def drop_cache(path: str) -> None:
    """fsync and drop the file's pages from the page cache: the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_pwrite(path: str, size: int, buf: torch.Tensor, chunk: int = 1 << 20) -> dict:
    out = {}
    mv = memoryview(buf.numpy())
    nbuf = buf.numel() // chunk
    fd = os.open(path, os.O_RDWR)
    try:
        t = time.perf_counter()
        for k, off in enumerate(range(0, size, chunk)):
            s = (k % nbuf) * chunk
            os.pwrite(fd, mv[s:s + min(chunk, size - off)], off)
        os.fsync(fd)
        out["write"] = size / (time.perf_counter() - t)
        drop_cache(path)
        t = time.perf_counter()
        for k, off in enumerate(range(0, size, chunk)):
            s = (k % nbuf) * chunk
            os.preadv(fd, [mv[s:s + min(chunk, size - off)]], off)
        out["read"] = size / (time.perf_counter() - t)
    finally:
        os.close(fd)
    return out


def bench_memmap(path: str, size: int, buf: torch.Tensor) -> dict:
    out = {}
    src = buf.numpy()
    n = src.size
    t = time.perf_counter()
    mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
    for off in range(0, size, n):
        k = min(n, size - off)
        mm[off:off + k] = src[:k]
    mm.flush()
    del mm
    drop_cache(path)
    out["write"] = size / (time.perf_counter() - t)
    t = time.perf_counter()
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
    for off in range(0, size, n):
        k = min(n, size - off)
        src[:k] = mm[off:off + k]
    del mm
    out["read"] = size / (time.perf_counter() - t)
    return out


def bench_aiofiles(path: str, size: int, buf: torch.Tensor, chunk: int = 1 << 20):
    try:
        import aiofiles
    except ImportError:
        return None
    mv = memoryview(buf.numpy())
    nbuf = buf.numel() // chunk

    async def run():
        out = {}
        async with aiofiles.open(path, "r+b") as f:
            t = time.perf_counter()
            for k, off in enumerate(range(0, size, chunk)):
                s = (k % nbuf) * chunk
                await f.write(mv[s:s + min(chunk, size - off)])
            await f.flush()
            os.fsync(f.fileno())
            out["write"] = size / (time.perf_counter() - t)
        drop_cache(path)
        async with aiofiles.open(path, "rb") as f:
            t = time.perf_counter()
            k = 0
            while True:
                s = (k % nbuf) * chunk
                n = await f.readinto(mv[s:s + chunk])
                if not n:
                    break
                k += 1
            out["read"] = size / (time.perf_counter() - t)
        return out

    return asyncio.run(run())


def bench_deepspeed(path: str, size: int, request: int, qd: int, block: int, inflight: int,
                    threads: int):
    """DeepSpeed's AIO handle (libaio, O_DIRECT) on its own page-locked buffer: batches of
    ``inflight`` async requests of ``request`` bytes, then wait(). None if DeepSpeed is not
    usable."""
    try:
        import logging
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.op_builder import AsyncIOBuilder
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None
        ds = builder.load(verbose=False)
    except Exception:
        return None
    h = ds.aio_handle(block, qd, False, True, threads)
    locked = h.new_cpu_locked_tensor(request * inflight, torch.empty(0, dtype=torch.uint8))
    out = {}
    try:
        for op in ("write", "read"):
            fn = h.async_pwrite if op == "write" else h.async_pread
            t = time.perf_counter()
            queued = 0
            for off in range(0, size, request):
                n = min(request, size - off)
                fn(locked[queued * request:queued * request + n], path, off)
                queued += 1
                if queued == inflight:
                    h.wait()
                    queued = 0
            if queued:
                h.wait()
            if op == "write":
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            out[op] = size / (time.perf_counter() - t)
    finally:
        h.free_cpu_locked_tensor(locked)
    return out
