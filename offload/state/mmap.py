"""state/mmap.py: MmapTier, the state file mapped shared; the kernel works on the mapping.

The page cache does the I/O. After a bucket's update its pages are released from this process
(``MADV_DONTNEED``: dirty pages stay in the page cache and are written back by the OS), so RSS
stays bounded by one bucket at a time.
"""
from __future__ import annotations

import mmap as _mmap
import os
import weakref

import torch

from ..layout import ALIGN
from . import files
from .tier import Block, StateTier

__all__ = ["MmapTier"]


def _cleanup(maps, fd_box, directory, keep: bool, pid: int) -> None:
    maps.clear()   # never close(): views handed out keep their mapping alive and valid
    if fd_box and fd_box[0] >= 0:
        os.close(fd_box[0])
        fd_box[0] = -1
    if os.getpid() == pid:   # a fork()ed child never touches the parent's directory
        files.remove_dir(directory, keep)


class MmapTier(StateTier):
    kind = "mmap"
    resident = True

    def __init__(self, *, nvme_dir, keep: bool = False):
        super().__init__()
        self.keep = bool(keep)
        self.nvme_dir = files.check_dir(nvme_dir, "mmap")
        self.directory = files.new_state_dir(self.nvme_dir)
        self.path = os.path.join(self.directory, files.STATE_FILE)
        self._maps: list = []
        self._fd = [-1]
        self._finalizer = weakref.finalize(self, _cleanup, self._maps, self._fd, self.directory, self.keep,
                                           os.getpid())
        self._fd[0] = files.open_exclusive(self.path)
        self.file_bytes = 0
        self._base = None
        self.telemetry.update(direct=False, file_bytes=0, slots=1, slot_bytes=0)

    def allocate(self, layout) -> None:
        new = max(ALIGN, layout.nbytes)
        if new > self.file_bytes:
            try:
                files.reserve(self._fd[0], self.file_bytes, new - self.file_bytes, self.directory,
                              self.nvme_dir, self.path)
            except OSError:
                if self.file_bytes == 0:
                    self.close()
                raise
            self.file_bytes = new
            # earlier mappings stay valid (and coherent: MAP_SHARED) for views handed out before
            mm = _mmap.mmap(self._fd[0], self.file_bytes, _mmap.MAP_SHARED, _mmap.PROT_READ | _mmap.PROT_WRITE)
            self._maps.append(mm)
            self._base = torch.frombuffer(mm, dtype=torch.uint8)
        self.layout = layout
        self.telemetry.update(file_bytes=self.file_bytes, slot_bytes=max([ALIGN, layout.max_bucket_bytes]))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._base[offset:offset + nbytes]

    def own_memory(self):
        return self._base

    def mapping(self):
        return self.view, self._fd[0]

    def acquire(self, b, read: bool) -> Block:
        v = self.view(b.offset, b.nbytes)
        return Block(v.data_ptr(), v)

    def release(self, b, blk: Block) -> None:
        if hasattr(_mmap, "MADV_DONTNEED") and b.nbytes >= _mmap.PAGESIZE:
            self._maps[-1].madvise(_mmap.MADV_DONTNEED, b.offset, b.nbytes)

    def write(self, b, data: torch.Tensor) -> None:
        self.view(b.offset, b.nbytes).copy_(data)

    def where(self) -> str:
        return self.path

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._base = None
        self._finalizer()

    def info(self) -> dict:
        d = dict(self.telemetry)
        d.update(path=self.path)
        return d
