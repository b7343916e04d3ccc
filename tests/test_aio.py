"""Tests of the native async I/O engine (csrc/aio.cpp via offload/native/aio.py): round trips swept over
direct/buffered, block sizes, queue depths and unaligned tails; many requests in flight; injected
faults (EIO, short transfers, EINTR); argument validation; the O_DIRECT fallback."""
import errno
import itertools
import os

import numpy as np
import pytest
import torch

from offload.native import aio
from offload.base.memory import HostArena, aligned_empty


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return buf


SIZES = [0, 1, 4095, 4096, 4097, 3 * 65536 + 123]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct,block,depth", list(itertools.product([True, False], [4096, 65536], [1, 4, 16])))
def test_round_trip_sweep(tmp_path, direct, block, depth):
    with aio.AioEngine(queue_depth=depth, block_size=block) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=direct)
        assert f.direct == direct
        off = 0
        placed = []
        for i, n in enumerate(SIZES):
            src = _pattern(n, i)
            assert eng.write(f, src, offset=off).wait(timeout=30) == n
            placed.append((off, src))
            off += (n + 4095) // 4096 * 4096  # direct I/O offsets stay aligned
        for off, src in placed:
            dst = aligned_empty(src.numel())
            dst.fill_(0xAB)
            assert eng.read(f, dst, offset=off).wait(timeout=30) == src.numel()
            assert torch.equal(dst, src)
        t = eng.telemetry()
        assert t["errors"] == 0 and t["bytes_written"] == sum(SIZES) == t["bytes_read"]
        f.close()


@pytest.mark.timeout(60)
def test_many_requests_in_flight_and_poll(tmp_path):
    n, k = 64 * 1024, 32
    with aio.AioEngine(queue_depth=8, block_size=16384) as eng:
        f = eng.open(str(tmp_path / "f"), create=True)
        srcs = [_pattern(n, i) for i in range(k)]
        reqs = [eng.write(f, s, offset=i * n) for i, s in enumerate(srcs)]
        assert eng.outstanding() == k
        for r in reqs:
            r.wait(timeout=30)
            assert r.done()
        dsts = [aligned_empty(n) for _ in range(k)]
        reqs = [eng.read(f, d, offset=i * n) for i, d in enumerate(dsts)]
        for r in reversed(reqs):  # completion order does not matter
            assert r.wait(timeout=30) == n
        assert all(torch.equal(a, b) for a, b in zip(srcs, dsts))
        assert eng.outstanding() == 0
        assert os.path.getsize(tmp_path / "f") == n * k


@pytest.mark.timeout(60)
def test_numpy_buffers_and_partial_length(tmp_path):
    with aio.AioEngine(queue_depth=2, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=False)
        a = np.arange(5000, dtype=np.float32)
        eng.write(f, a, offset=100, length=4000).wait()
        b = np.zeros(1000, dtype=np.float32)
        eng.read(f, b, offset=100).wait()
        assert np.array_equal(b, a[:1000])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("op", ["read", "write"])
def test_injected_eio_reports_errno_path_offset(tmp_path, direct, op):
    path = str(tmp_path / "f")
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(path, create=True, direct=direct)
        src = _pattern(8 * 4096, 1)
        eng.write(f, src).wait()
        eng._set_fault(aio.FAULT_EIO, 3)  # the third system call fails: piece at offset 8192
        req = eng.read(f, aligned_empty(src.numel())) if op == "read" else eng.write(f, src)
        with pytest.raises(OSError) as ei:
            req.wait(timeout=30)
        e = ei.value
        assert e.errno == errno.EIO and e.filename == path
        assert "at offset 8192" in str(e) and "4096 bytes" in str(e) and op in str(e)
        assert eng.telemetry()["errors"] == 1
        # the engine keeps working after a failed request
        dst = aligned_empty(src.numel())
        eng.read(f, dst).wait(timeout=30)
        assert torch.equal(dst, src)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("kind,counter", [(aio.FAULT_SHORT, "short_resumed"), (aio.FAULT_EINTR, "eintr_resumed")])
def test_short_transfers_and_eintr_are_resumed(tmp_path, direct, kind, counter):
    with aio.AioEngine(queue_depth=1, block_size=65536) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=direct)
        src = _pattern(4 * 65536, 2)
        eng._set_fault(kind, 2)
        assert eng.write(f, src).wait(timeout=30) == src.numel()
        eng._set_fault(kind, 3)
        dst = aligned_empty(src.numel())
        assert eng.read(f, dst).wait(timeout=30) == src.numel()
        assert torch.equal(dst, src)
        t = eng.telemetry()
        assert t[counter] == 2 and t["errors"] == 0


@pytest.mark.timeout(30)
def test_read_past_end_of_file(tmp_path):
    with aio.AioEngine(queue_depth=2, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True)
        eng.write(f, _pattern(8192, 3)).wait()
        with pytest.raises(OSError, match="unexpected end of file") as ei:
            eng.read(f, aligned_empty(16384)).wait(timeout=30)
        assert ei.value.errno == errno.EIO


@pytest.mark.timeout(30)
def test_argument_validation(tmp_path):
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=True)
        buf = aligned_empty(8192 + 1)
        with pytest.raises(ValueError, match="aligned"):
            eng.write(f, buf[1:], offset=0)          # unaligned address with O_DIRECT
        with pytest.raises(ValueError, match="aligned"):
            eng.write(f, buf[:4096], offset=512)     # unaligned offset with O_DIRECT
        with pytest.raises(ValueError, match="length"):
            eng.write(f, buf[:4096], length=5000)
        with pytest.raises(RuntimeError, match="contiguous"):
            eng.write(f, torch.zeros(4, 4).t())
        with pytest.raises(TypeError):
            eng.write(f, b"bytes")
        ro = eng.open(str(tmp_path / "f"), write=False, direct=False)
        with pytest.raises(ValueError, match="read-only"):
            eng.write(ro, buf[:4096])
        ro.close()
        with pytest.raises(ValueError, match="closed"):
            eng.read(ro, buf[:4096])
        with pytest.raises(ValueError, match="file descriptor"):
            aio._C.AioFile(10**6, -1)
        with pytest.raises(ValueError, match="unknown request"):
            eng._native.wait(12345, 0.0)
        with pytest.raises(ValueError):
            eng._set_fault(9, 1)
        assert eng.outstanding() == 0
    with pytest.raises(ValueError):
        aio.AioEngine(queue_depth=0)
    with pytest.raises(ValueError):
        aio.AioEngine(block_size=1000)
    with pytest.raises(RuntimeError, match="closed"):
        eng.read(f, buf[:4096])


@pytest.mark.timeout(30)
def test_open_refuses_symlink_and_existing_file(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    link = tmp_path / "link"
    link.symlink_to(target)
    with aio.AioEngine() as eng:
        with pytest.raises(OSError) as ei:
            eng.open(str(link), create=True)
        assert ei.value.errno == errno.EEXIST
        with pytest.raises(OSError) as ei:
            eng.open(str(link))  # O_NOFOLLOW
        assert ei.value.errno == errno.ELOOP
    assert target.read_bytes() == b"keep me"


@pytest.mark.timeout(30)
def test_direct_refused_falls_back_to_buffered_with_warning(tmp_path, no_o_direct):
    with aio.AioEngine(queue_depth=2, block_size=4096) as eng:
        with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported"):
            f = eng.open(str(tmp_path / "f"), create=True)
        assert not f.direct and f.tail_fd == -1
        assert eng.telemetry()["direct_fallbacks"] == [str(tmp_path / "f")]
        src = _pattern(10000, 4)
        eng.write(f, src).wait()
        dst = aligned_empty(10000)
        eng.read(f, dst).wait()
        assert torch.equal(src, dst)


@pytest.mark.timeout(30)
def test_close_waits_for_pending_and_keeps_outcomes(tmp_path):
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True)
        eng._set_fault(aio.FAULT_EIO, 4 * 256 + 1)  # one worker, FIFO: first piece of the 5th request
        reqs = [eng.write(f, _pattern(1 << 20, i), offset=i << 20) for i in range(4)]
        bad = eng.write(f, _pattern(4096, 9), offset=4 << 20)
    # leaving the block closed the engine only after every transfer had finished
    assert os.path.getsize(tmp_path / "f") == 4 << 20
    assert all(r.done() and r.wait() == 1 << 20 for r in reqs)
    with pytest.raises(OSError, match="offset 4194304"):
        bad.wait()


def test_arena_slots_are_aligned():
    a = HostArena(3, 8192)
    assert a.nbytes == 3 * 8192
    assert not a.pinned   # I/O slots are never page-locked (only the device staging ring is)
    for s in a.slots:
        assert s.data_ptr() % 4096 == 0 and s.numel() == 8192
    with pytest.raises(ValueError):
        HostArena(1, 1000)


@pytest.mark.timeout(60)
def test_wait_releases_the_gil(tmp_path):
    import threading
    import time
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=False)
        buf = aligned_empty(256 << 20)  # 65536 one-page system calls on one worker: well over 10 ms
        req = eng.write(f, buf)
        started = threading.Event()

        def waiter():
            started.set()
            req.wait(timeout=50)

        t = threading.Thread(target=waiter)
        t.start()
        started.wait()
        time.sleep(0.01)
        # this line runs before the transfer ends only if the waiting thread released the GIL
        still_running = not req.done()
        t.join()
        assert still_running


@pytest.mark.timeout(60)
def test_close_with_queued_write_never_reaches_a_reused_fd(tmp_path):
    # One worker, busy with a long transfer; a write to A is queued behind it; A is closed and B
    # opened (closing A's descriptors at once would hand B the same numbers: without deferred
    # close the queued write landed in B). The queued write must still land in A, never in B.
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        busy_file = eng.open(str(tmp_path / "busy"), create=True, direct=False)
        busy = eng.write(busy_file, aligned_empty(64 << 20))  # 16384 one-page system calls
        a = eng.open(str(tmp_path / "a"), create=True, direct=False)
        src = _pattern(8192, 7)
        queued = eng.write(a, src)
        fds_a = {a.fd, a.tail_fd} - {-1}
        a.close()
        assert a.fd == -1
        b = eng.open(str(tmp_path / "b"), create=True, direct=False)
        assert not busy.done(), "the busy transfer ended too early for this test to mean anything"
        assert not fds_a & {b.fd, b.tail_fd}  # A's descriptors stay open (and A's) while the write is queued
        assert queued.wait(timeout=30) == 8192
        busy.wait(timeout=60)
        assert os.path.getsize(tmp_path / "b") == 0
        assert (tmp_path / "a").read_bytes() == src.numpy().tobytes()
        with pytest.raises(ValueError, match="closed"):
            eng.write(a, src)
        b.close()
        busy_file.close()


@pytest.mark.timeout(30)
def test_closed_file_descriptors_are_released(tmp_path):
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=True)
        fds = [x for x in (f.fd, f.tail_fd) if x >= 0]
        eng.write(f, _pattern(4096, 1)).wait(timeout=10)
        f.close()
        f.close()  # idempotent
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)


@pytest.mark.timeout(30)
def test_wait_timeouts(tmp_path):
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=False)
        for t in (float("inf"), None, 1e300, 30, 30.0):
            assert eng.write(f, _pattern(4096, 2)).wait(timeout=t) == 4096
        req = eng.write(f, _pattern(4096, 2))
        for bad in (-1, -0.5, float("nan"), float("-inf")):
            with pytest.raises(ValueError, match="timeout"):
                req.wait(timeout=bad)
            with pytest.raises(ValueError, match="timeout"):
                eng._native.wait(req.id, bad)
        assert req.wait() == 4096


@pytest.mark.timeout(30)
def test_native_submit_takes_buffers_not_addresses(tmp_path):
    with aio.AioEngine(queue_depth=1, block_size=4096) as eng:
        f = eng.open(str(tmp_path / "f"), create=True, direct=False)
        buf = aligned_empty(4096)
        with pytest.raises(TypeError):
            eng._native.submit(1, f._handle, buf.data_ptr(), 4096, 0)  # an integer address
        with pytest.raises(ValueError, match="length"):
            eng._native.submit(1, f._handle, bytearray(100), 4096, 0)  # longer than the buffer
        with pytest.raises(BufferError):
            eng._native.submit(0, f._handle, b"read-only bytes", 4, 0)  # read into immutable memory
        data = bytearray(b"x" * 4096)
        rid = eng._native.submit(1, f._handle, data, 4096, 0)
        with pytest.raises(BufferError):
            data.extend(b"y")  # the engine holds the buffer until the request is waited for
        assert eng._native.wait(rid, None)[0] == 4096
        data.extend(b"y")
        # a tensor whose storage shrank under its view is refused before anything is queued
        t = torch.empty(8192, dtype=torch.uint8)   # (torch-owned: its storage can shrink)
        t.untyped_storage().resize_(16)
        with pytest.raises(RuntimeError, match="storage"):
            eng.write(f, t)
