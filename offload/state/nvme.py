"""state/nvme.py: NvmeTier, state in private O_DIRECT files streamed through a small ring of host
slots.

Host memory is ``depth + 2`` slots of at most one bucket each, whatever the model size: while the
kernel updates the acquired bucket, up to ``depth`` later buckets are being read and earlier ones
written back. A bucket acquired without a prefetch (out of the expected order) is read on demand:
slower, never wrong. Slots are ordinary (pageable) memory: the GPU never copies from them.
Several directories in ``nvme_dir`` are several drives (state/drives.py): bucket ``b`` lives on
drive ``b % k``, each drive with its own file and I/O engine. A filesystem that refuses O_DIRECT
gets buffered I/O, logged at INFO on ``offload.state``.
"""
from __future__ import annotations

import errno
import logging
import mmap
import time
import os
import weakref
from collections import deque

import torch

from ..base.memory import HostArena
from .layout import ALIGN
from . import files
from .drives import Drive, Placement, named, parse_dirs
from .tier import Block, StateTier

__all__ = ["NvmeTier"]

log = logging.getLogger("offload.state")


def _cleanup(res: list, keep: bool, pid: int) -> None:
    """``res``: [aio, file, directory] per drive, as far as each was created."""
    for aio, file, directory in res:
        if os.getpid() != pid:
            # a fork()ed child: the I/O threads, the file and the directory are the parent's; only
            # this process's copies of the descriptors are closed, nothing on disk is touched
            if file is not None:
                file.close()
            continue
        # order matters: no transfer may be in flight when descriptors or buffers go away
        if aio is not None:
            aio.close()
        if file is not None:
            file.close()
        files.remove_dir(directory, keep)


class NvmeTier(StateTier):
    storage = "nvme"

    def __init__(self, *, nvme_dir, keep: bool = False, depth: int = 2, queue_depth: int = 8,
                 block_size: int = 1 << 20, direct: bool = True):
        super().__init__()
        if not isinstance(depth, int) or not 1 <= depth <= 64:
            raise ValueError("depth (buckets read ahead) must be an int in [1, "
                             f"64], got {depth!r}")
        self.depth = depth
        self.keep = bool(keep)
        dirs = parse_dirs(nvme_dir)
        if dirs == [None]:
            files.check_dir(None, "nvme")
        for d in dirs:   # every directory checked before any is written to
            files.check_dir(d, "nvme")
        res: list = []
        self._finalizer = weakref.finalize(self, _cleanup, res, self.keep, os.getpid())
        self.drives: list = []
        try:
            for d in dirs:
                self.drives.append(Drive(d, res=res, queue_depth=queue_depth,
                                         block_size=block_size, direct=direct))
        except BaseException:
            self._finalizer()   # the directories already created are removed
            raise
        first = self.drives[0]
        # the first drive's state directory and file, as a mmap tier has them (decoded moments are
        # exported there, engine/export.py; offload.testing.state_dir/state_file report them)
        self.directory, self.path = first.directory, first.path
        self.place = Placement(len(self.drives))
        for dr in self.drives:
            if direct and not dr.file.direct:
                log.info(f"O_DIRECT is not supported in the NVMe state directory {dr.nvme_dir} "
                         "(the filesystem refused it): the state file uses buffered I/O through "
                         "the page cache instead (correct, but it competes with the page cache "
                         "for RAM); an nvme_dir on an ext4 or xfs NVMe disk gets direct I/O")
        self.file_bytes = 0
        self.arena = None
        self.slots: list = []
        self._free: list = []
        self._reads: dict = {}          # bucket index -> (slot, request or None, drive)
        self._writes: deque = deque()   # (slot, request, drive)
        self.telemetry.update(direct=all(dr.file.direct for dr in self.drives), slots=depth + 2,
                              slot_bytes=0,
                              file_bytes=0, demand_reads=0, evicted=0, ndrives=len(self.drives))

    # ------------------------------------------------------------------ space
    def allocate(self, layout) -> None:
        self.drain()
        new, used = self.place.plan(layout, [dr.used for dr in self.drives])
        for dr, u in zip(self.drives, used):
            try:
                dr.reserve(max(ALIGN, u))
            except OSError:
                if self.layout is None:
                    self.close()   # construction: nothing saved yet, every drive's directory goes
                raise
        self.place.commit(new)
        for dr, u in zip(self.drives, used):
            dr.used = u
        self.file_bytes = sum(dr.file_bytes for dr in self.drives)
        need = max(ALIGN, layout.max_bucket_bytes)
        if self.arena is None or self.arena.slot_bytes < need:
            # no larger than the largest bucket: a small model under a big budget uses only what it
            # needs
            self.arena = HostArena(self.depth + 2, need)
            self.slots = self.arena.slots
            self._free = list(range(len(self.slots)))[::-1]
        self.layout = layout
        self.telemetry.update(slot_bytes=self.arena.slot_bytes, file_bytes=self.file_bytes)

    def shrink(self, layout) -> None:
        self.drain()
        for dr, u in zip(self.drives, self.place.truncate(len(layout.buckets), len(self.drives))):
            dr.used = u
        self.layout = layout

    # ------------------------------------------------------------------ slots
    def _io(self, op: str, b, s: int):
        """Start reading or writing bucket ``b`` from/into slot ``s`` on its drive: (request,
        drive)."""
        d, off = self.place.where[b.index]
        dr = self.drives[d]
        try:
            return getattr(dr.aio, op)(dr.file, self.slots[s], off, b.nbytes), d
        except OSError as e:
            raise self._named(e, d) from None

    def _named(self, e: OSError, d: int) -> OSError:
        return named(e, self.drives[d].nvme_dir) if len(self.drives) > 1 else e

    def _wait(self, req, d: int, key: str) -> int:
        try:
            n = req.wait()
        except OSError as e:
            raise self._named(e, d) from None
        self.telemetry[key] += n
        dr = self.drives[d]
        if key == "bytes_read":
            dr.bytes_read += n
        else:
            dr.bytes_written += n
        return n

    def _retire_write(self) -> None:
        s, req, d = self._writes.popleft()
        t = time.perf_counter()
        try:
            self._wait(req, d, "bytes_written")
        finally:
            self.telemetry["write_wait_s"] += time.perf_counter() - t
            self._free.append(s)

    def _slot(self, wait: bool):
        if not self._free and self._writes and (wait or self._writes[0][1].done()):
            self._retire_write()
        if not self._free and wait and self._reads:
            # a bucket out of the expected order: drop a read-ahead, read on demand
            self._evict_read()
        if not self._free and wait:
            raise RuntimeError("offload NvmeTier: no free slot (more buckets acquired than "
                               "the ring holds)")
        return self._free.pop() if self._free else None

    def _drop_read(self, bi: int) -> None:
        """Give up bucket ``bi``'s read-ahead: wait for it, free its slot."""
        s, req, d = self._reads.pop(bi)
        try:
            if req is not None:
                try:
                    req.wait()
                except OSError as e:
                    raise self._named(e, d) from None
        finally:
            self._free.append(s)
        self.telemetry["evicted"] += 1

    def _evict_read(self) -> None:
        """Give up the read-ahead issued last (the furthest ahead)."""
        self._drop_read(next(reversed(self._reads)))

    def keep_reads(self, wanted) -> None:
        """Cancel the read-aheads of buckets not in ``wanted`` (mispredicted): wait for them, free
        the slots."""
        for bi in [bi for bi in self._reads if bi not in wanted]:
            self._drop_read(bi)

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
        try:
            req, d = self._io("read", b, s) if read else (None, self.place.where[b.index][0])
        except BaseException:
            self._free.append(s)
            raise
        self._reads[b.index] = (s, req, d)

    def acquire(self, b, read: bool) -> Block:
        got = self._reads.pop(b.index, None)
        if got is None:
            if read:   # not read ahead: this bucket came out of the expected order
                self.telemetry["demand_reads"] += 1
            s = self._slot(True)
            try:
                req, d = self._io("read", b, s) if read else (None, 0)
            except BaseException:
                self._free.append(s)
                raise
            got = (s, req, d)
        s, req, d = got
        if req is not None:
            t = time.perf_counter()
            try:
                self._wait(req, d, "bytes_read")
            except BaseException:
                self._free.append(s)
                raise
            finally:
                self.telemetry["read_wait_s"] += time.perf_counter() - t
        buf = self.slots[s][:b.nbytes]
        return Block(buf.data_ptr(), buf, s)

    def release(self, b, blk: Block) -> None:
        req, d = self._io("write", b, blk.slot)
        self._writes.append((blk.slot, req, d))

    def drain(self) -> None:
        err = None
        while self._writes:
            try:
                self._retire_write()
            except BaseException as e:
                err = err or e
        for s, req, d in self._reads.values():
            try:
                if req is not None:
                    try:
                        req.wait()
                    except OSError as e:
                        raise self._named(e, d) from None
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
        for dr in self.drives:
            dr.aio.wait_all()   # nothing may still write into buffers or the files
        self._writes.clear()
        self._reads.clear()
        self._free = list(range(len(self.slots)))[::-1]

    # ------------------------------------------------------------------ state_dict / load
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        view, _fd = self.mapping()
        return view(offset, nbytes)

    def mapping(self):
        """(view function over the whole state, fd) for state_dict views; every write-back done
        first. With several drives ``fd`` is a function: layout offset -> (fd, offset in that
        drive's file)."""
        self.drain()
        # (a shorter file cannot be mapped: mmap's own ValueError names no file)
        for dr in self.drives:
            size = os.fstat(dr.fd()).st_size
            if size < dr.file_bytes:
                e = OSError(errno.EIO, f"unexpected end of file: the state file {dr.path} holds "
                                       f"{size} bytes, its layout {dr.file_bytes} (truncated by "
                                       "something else?)")
                self.fail(e)   # its state is gone: the optimizer is failed until a load
                raise e
        # a fresh shared mapping after all direct writes completed reads what is on disk
        maps = [mmap.mmap(dr.fd(), dr.file_bytes, mmap.MAP_SHARED,
                          mmap.PROT_READ | mmap.PROT_WRITE)
                for dr in self.drives]
        if len(self.drives) == 1:
            def view(offset: int, nbytes: int, mm=maps[0]) -> torch.Tensor:
                return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
            return view, self.drives[0].fd()
        place, fds = self.place, [dr.fd() for dr in self.drives]

        def view(offset: int, nbytes: int) -> torch.Tensor:
            d, off = place.locate(offset, nbytes)
            return torch.frombuffer(maps[d], dtype=torch.uint8, count=nbytes, offset=off)

        def locate(offset: int) -> tuple:
            d, off = place.locate(offset, 0)
            return fds[d], off
        return view, locate

    def write(self, b, data: torch.Tensor) -> None:
        self.drain()
        s = self._slot(True)
        try:
            self.slots[s][:b.nbytes].copy_(data)
            req, d = self._io("write", b, s)
            self._wait(req, d, "bytes_written")
        finally:
            self._free.append(s)

    # ------------------------------------------------------------------ lifecycle
    def where(self) -> str:
        return ", ".join(dr.path for dr in self.drives)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for outstanding I/O, release the slots and delete the state (unless ``keep``)."""
        self._finalizer()

    def info(self) -> dict:
        d = dict(self.telemetry)
        d.update(path=self.path, depth=self.depth, engine=self.drives[0].aio.telemetry())
        if len(self.drives) > 1:
            d.update(paths=[dr.path for dr in self.drives],
                     drives=[dr.info() for dr in self.drives])
        return d
