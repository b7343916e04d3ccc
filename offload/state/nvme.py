"""state/nvme.py: NvmeTier, state in a private O_DIRECT file streamed through a small ring of host slots.

Host memory is ``depth + 2`` slots of at most one bucket each, whatever the model size: while the
kernel updates the acquired bucket, up to ``depth`` later buckets are being read and earlier ones
written back. A bucket acquired without a prefetch (out of the expected order) is read on demand:
slower, never wrong. Slots are ordinary (pageable) memory: the GPU never copies from them.
A filesystem that refuses O_DIRECT gets buffered I/O, logged at INFO on ``offload.state``.
"""
from __future__ import annotations

import logging
import mmap
import os
import time
import weakref
from collections import deque

import torch

from ..aio import AioEngine
from ..buffers import HostArena
from ..layout import ALIGN
from . import files
from .tier import Block, StateTier

__all__ = ["NvmeTier"]

log = logging.getLogger("offload.state")


def _cleanup(engine, file, directory, keep: bool, pid: int) -> None:
    if os.getpid() != pid:
        # a fork()ed child: the I/O threads, the file and the directory are the parent's; only this
        # process's copies of the descriptors are closed, nothing on disk is touched
        if file is not None:
            file.close()
        return
    # order matters: no transfer may be in flight when descriptors or buffers go away
    if engine is not None:
        engine.close()
    if file is not None:
        file.close()
    files.remove_dir(directory, keep)


class NvmeTier(StateTier):
    kind = "nvme"

    def __init__(self, *, nvme_dir, keep: bool = False, depth: int = 2, queue_depth: int = 8,
                 block_size: int = 1 << 20, direct: bool = True):
        super().__init__()
        if not isinstance(depth, int) or not 1 <= depth <= 64:
            raise ValueError(f"depth (buckets read ahead) must be an int in [1, 64], got {depth!r}")
        self.depth = depth
        self.keep = bool(keep)
        self.nvme_dir = files.check_dir(nvme_dir, "nvme")
        self.directory = files.new_state_dir(self.nvme_dir)
        self.path = os.path.join(self.directory, files.STATE_FILE)
        pid = os.getpid()
        self._finalizer = weakref.finalize(self, _cleanup, None, None, self.directory, self.keep, pid)
        self.engine = AioEngine(queue_depth=queue_depth, block_size=block_size)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self.engine, None, self.directory, self.keep, pid)
        self.file = self.engine.open(self.path, create=True, direct=direct, mode=0o600)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self.engine, self.file, self.directory, self.keep, pid)
        if direct and not self.file.direct:
            log.info(f"O_DIRECT is not supported in the NVMe state directory {self.nvme_dir} (the filesystem refused "
                     "it): the state file uses buffered I/O through the page cache instead (correct, but it competes "
                     "with the page cache for RAM); an nvme_dir on an ext4 or xfs NVMe disk gets direct I/O")
        self.file_bytes = 0
        self.arena = None
        self.slots: list = []
        self._free: list = []
        self._reads: dict = {}          # bucket index -> (slot, request or None)
        self._writes: deque = deque()   # (slot, request)
        self.telemetry.update(direct=bool(self.file.direct), slots=depth + 2, slot_bytes=0, file_bytes=0,
                              demand_reads=0, evicted=0)

    # ------------------------------------------------------------------ space
    def allocate(self, layout) -> None:
        self.drain()
        new = max(ALIGN, layout.nbytes)
        if new > self.file_bytes:
            try:
                files.reserve(self.file.fd, self.file_bytes, new - self.file_bytes, self.directory,
                              self.nvme_dir, self.path)
            except OSError:
                if self.file_bytes == 0:
                    self.close()
                raise
            self.file_bytes = new
        need = max(ALIGN, layout.max_bucket_bytes)
        if self.arena is None or self.arena.slot_bytes < need:
            # no larger than the largest bucket: a small model under a big budget uses only what it needs
            self.arena = HostArena(self.depth + 2, need)
            self.slots = self.arena.slots
            self._free = list(range(len(self.slots)))[::-1]
        self.layout = layout
        self.telemetry.update(slot_bytes=self.arena.slot_bytes, file_bytes=self.file_bytes)

    # ------------------------------------------------------------------ slots
    def _retire_write(self) -> None:
        s, req = self._writes.popleft()
        t = time.perf_counter()
        try:
            self.telemetry["bytes_written"] += req.wait()
        finally:
            self.telemetry["write_wait_s"] += time.perf_counter() - t
            self._free.append(s)

    def _slot(self, wait: bool):
        if not self._free and self._writes and (wait or self._writes[0][1].done()):
            self._retire_write()
        if not self._free and wait and self._reads:
            self._evict_read()   # a bucket out of the expected order: drop a read-ahead, read on demand
        if not self._free and wait:
            raise RuntimeError("offload NvmeTier: no free slot (more buckets acquired than the ring holds)")
        return self._free.pop() if self._free else None

    def _drop_read(self, bi: int) -> None:
        """Give up bucket ``bi``'s read-ahead: wait for it, free its slot."""
        s, req = self._reads.pop(bi)
        try:
            if req is not None:
                req.wait()
        finally:
            self._free.append(s)
        self.telemetry["evicted"] += 1

    def _evict_read(self) -> None:
        """Give up the read-ahead issued last (the furthest ahead)."""
        self._drop_read(next(reversed(self._reads)))

    def keep_reads(self, wanted) -> None:
        """Cancel the read-aheads of buckets not in ``wanted`` (mispredicted): wait for them, free the slots."""
        for bi in [bi for bi in self._reads if bi not in wanted]:
            self._drop_read(bi)

    def reading(self) -> int:
        """Read-aheads issued and not yet acquired."""
        return len(self._reads)

    def prefetched(self, b) -> bool:
        return b.index in self._reads

    def prefetch(self, b, read: bool) -> None:
        if b.index in self._reads:
            return
        if not self._free and self._writes:
            self._retire_write()
        if not self._free:
            return   # every slot busy with reads ahead: this bucket is read when acquired
        s = self._free.pop()
        req = self.engine.read(self.file, self.slots[s], b.offset, b.nbytes) if read else None
        self._reads[b.index] = (s, req)

    def acquire(self, b, read: bool) -> Block:
        got = self._reads.pop(b.index, None)
        if got is None:
            if read:   # not read ahead: this bucket came out of the expected order
                self.telemetry["demand_reads"] += 1
            s = self._slot(True)
            got = (s, self.engine.read(self.file, self.slots[s], b.offset, b.nbytes) if read else None)
        s, req = got
        if req is not None:
            t = time.perf_counter()
            try:
                self.telemetry["bytes_read"] += req.wait()
            except BaseException:
                self._free.append(s)
                raise
            finally:
                self.telemetry["read_wait_s"] += time.perf_counter() - t
        buf = self.slots[s][:b.nbytes]
        return Block(buf.data_ptr(), buf, s)

    def release(self, b, blk: Block) -> None:
        self._writes.append((blk.slot, self.engine.write(self.file, self.slots[blk.slot], b.offset, b.nbytes)))

    def drain(self) -> None:
        err = None
        while self._writes:
            try:
                self._retire_write()
            except BaseException as e:
                err = err or e
        for s, req in self._reads.values():
            try:
                if req is not None:
                    req.wait()
            except BaseException as e:
                err = err or e
            self._free.append(s)
        self._reads.clear()
        if err is not None:
            raise err

    def own_memory(self):
        return self.arena.memory if self.arena is not None else None

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.engine.wait_all()   # nothing may still write into buffers or the file
        self._writes.clear()
        self._reads.clear()
        self._free = list(range(len(self.slots)))[::-1]

    # ------------------------------------------------------------------ state_dict / load
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        self.drain()
        mm = self._mapping()
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)

    def mapping(self):
        """(view function over the whole file, fd) for state_dict views; every write-back done first."""
        self.drain()
        mm = self._mapping()
        fd = self.file.tail_fd if self.file.tail_fd >= 0 else self.file.fd

        def view(offset: int, nbytes: int, mm=mm) -> torch.Tensor:
            return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return view, fd

    def _mapping(self):
        # a fresh shared mapping after all direct writes completed reads what is on disk
        fd = self.file.tail_fd if self.file.tail_fd >= 0 else self.file.fd
        return mmap.mmap(fd, self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def write(self, b, data: torch.Tensor) -> None:
        self.drain()
        s = self._slot(True)
        try:
            self.slots[s][:b.nbytes].copy_(data)
            self.engine.write(self.file, self.slots[s], b.offset, b.nbytes).wait()
            self.telemetry["bytes_written"] += b.nbytes
        finally:
            self._free.append(s)

    # ------------------------------------------------------------------ lifecycle
    def where(self) -> str:
        return self.path

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for outstanding I/O, release the slots and delete the state (unless ``keep``)."""
        self._finalizer()

    def info(self) -> dict:
        d = dict(self.telemetry)
        d.update(path=self.path, depth=self.depth, engine=self.engine.telemetry())
        return d
