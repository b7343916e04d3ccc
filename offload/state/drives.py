"""state/drives.py: several NVMe drives for one optimizer: which directories, and one drive's file.

``nvme_dir`` may name several directories (a list or tuple, or one comma-separated string); each is
one *drive*: its own private state directory (state/files.py, offload/state/statedir.py: created,
marked, removed exactly like the single one), its own state file and its own ``AioEngine`` (I/O
queue and threads), so a slow drive only delays the buckets it holds. Buckets are laid round-robin
(bucket ``b`` on drive ``b % k``, docs/nvme.md: "Several drives"); ``Placement`` maps the layout's
byte offsets (one virtual file) to (drive, offset in that drive's file).
"""
from __future__ import annotations

import bisect
import os

from ..native.aio import AioEngine
from .statedir import parse_dirs
from . import files

__all__ = ["parse_dirs", "check_one", "Drive", "Placement", "named"]


def named(e: OSError, drive: str) -> OSError:
    """``e`` with the drive it happened on in its message (errno and file name kept)."""
    msg = e.strerror or str(e)
    if drive in msg:
        return e
    out = OSError(e.errno, f"{msg} (on the state drive {drive})", e.filename)
    out.__cause__ = e
    return out


class Drive:
    """One directory of ``nvme_dir``: a private state directory, its state file, its own native
    I/O engine (``aio``, offload/native/aio.py). ``res`` (the owner's cleanup list) gets [aio,
    file, directory] as each is created."""

    def __init__(self, parent: str, *, res: list, queue_depth: int, block_size: int, direct: bool):
        self.nvme_dir = files.check_dir(parent, "nvme")
        self.directory = files.new_state_dir(self.nvme_dir)
        entry = [None, None, self.directory]
        res.append(entry)
        self.path = os.path.join(self.directory, files.STATE_FILE)
        self.aio = entry[0] = AioEngine(queue_depth=queue_depth, block_size=block_size)
        self.file = entry[1] = self.aio.open(self.path, create=True, direct=direct, mode=0o600)
        self.file_bytes = 0       # reserved in the file
        self.used = 0             # bytes of the buckets placed here
        self.bytes_read = self.bytes_written = 0

    def reserve(self, nbytes: int) -> None:
        """Grow the file to ``nbytes`` (preallocated): an OSError naming this drive if it does not
        fit."""
        if nbytes > self.file_bytes:
            files.reserve(self.file.fd, self.file_bytes, nbytes - self.file_bytes, self.directory,
                          self.nvme_dir, self.path)
            self.file_bytes = nbytes

    def fd(self) -> int:
        return self.file.tail_fd if self.file.tail_fd >= 0 else self.file.fd

    def info(self) -> dict:
        return dict(dir=self.nvme_dir, path=self.path, bytes=self.used, file_bytes=self.file_bytes,
                    bytes_read=self.bytes_read, bytes_written=self.bytes_written,
                    direct=bool(self.file.direct), engine=self.aio.telemetry())


class Placement:
    """Bucket -> (drive, offset in its file), round-robin; stable when the layout grows."""

    def __init__(self, k: int):
        self.k = k
        self.where: dict = {}     # bucket index -> (drive, local offset)
        self.starts: list = []    # layout offsets of the placed buckets, increasing
        self.buckets: list = []

    def plan(self, layout, used: list) -> tuple:
        """(new placements, bytes used per drive after them) for the buckets not yet placed."""
        used = list(used)
        new = []
        for b in layout.buckets[len(self.buckets):]:
            d = b.index % self.k
            new.append((b, d, b.offset if self.k == 1 else used[d]))
            used[d] = b.offset + b.nbytes if self.k == 1 else used[d] + b.nbytes
        return new, used

    def commit(self, new: list) -> None:
        for b, d, off in new:
            self.where[b.index] = (d, off)
            self.starts.append(b.offset)
            self.buckets.append(b)

    def truncate(self, n: int, drives: int) -> list:
        """Forget the placements of buckets ``n`` and later; returns the bytes used per drive by
        the rest."""
        for b in self.buckets[n:]:
            self.where.pop(b.index, None)
        del self.buckets[n:], self.starts[n:]
        used = [0] * drives
        for b in self.buckets:
            d, off = self.where[b.index]
            used[d] = max(used[d], off + b.nbytes)
        return used

    def locate(self, offset: int, nbytes: int) -> tuple:
        """(drive, offset in its file) of layout bytes [offset, offset + nbytes), all in one
        bucket."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if i < 0:
            raise ValueError(f"offset {offset} is before the optimizer state")
        b = self.buckets[i]
        if offset + nbytes > b.offset + b.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) of the optimizer state cross a "
                             "bucket boundary")
        d, off = self.where[b.index]
        return d, off + offset - b.offset


def check_one(nvme_dir, mode: str):
    """``storage='mmap'`` takes one directory: a clear error for several."""
    dirs = parse_dirs(nvme_dir)
    if len(dirs) > 1:
        raise ValueError(f"storage={mode!r} keeps its state in one mapped file: give one "
                         f"nvme_dir, not {len(dirs)} (several drives are for storage='nvme')")
    return dirs[0]

