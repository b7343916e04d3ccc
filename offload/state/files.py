"""state/files.py: the state file: a private 0700 directory, an O_EXCL|O_NOFOLLOW file, space
reserved.

Every optimizer gets a new directory (mkdtemp: a leftover directory of a crashed run is never
reused) and creates its file inside it with O_EXCL|O_NOFOLLOW, so no existing file, symlink or
user data is ever opened or deleted. ``reserve`` preallocates (posix_fallocate) so that a full
disk fails at construction with the size needed, not in the middle of a step.
"""
from __future__ import annotations

import errno
import os

from . import statedir
from ..base.units import human

__all__ = ["STATE_FILE", "make_private_dir", "new_state_dir", "open_exclusive", "reserve",
           "remove_dir"]

STATE_FILE = statedir.STATE_FILE


def check_dir(nvme_dir, mode: str) -> str:
    if nvme_dir is None:
        raise ValueError(f"storage={mode!r} needs nvme_dir: a directory on the disk that will "
                         "hold the state file")
    nvme_dir = os.fspath(nvme_dir)
    if not os.path.exists(nvme_dir):
        raise FileNotFoundError(errno.ENOENT, "nvme_dir does not exist", nvme_dir)
    if not os.path.isdir(nvme_dir):
        raise NotADirectoryError(errno.ENOTDIR, "nvme_dir is not a directory", nvme_dir)
    return nvme_dir


def make_private_dir(parent: str) -> str:
    """A new directory, mode 0700, only this process knows about (never an existing one)."""
    return statedir.make_private_dir(parent)


def new_state_dir(parent: str) -> str:
    """Report leftovers of killed runs, then a new private directory with this process's owner
    marker."""
    statedir.warn_stale(parent)
    try:
        d = make_private_dir(parent)
    except OSError as e:
        raise OSError(e.errno, f"cannot create the optimizer state directory in {parent}: "
                               f"{os.strerror(e.errno)}", parent) from e
    statedir.write_marker(d)
    return d


def open_exclusive(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def reserve(fd: int, start: int, nbytes: int, directory: str, nvme_dir: str, path: str) -> None:
    """Preallocate [start, start + nbytes) of the file; a clear OSError naming the size if it does
    not fit."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, start, nbytes)
    except OSError as e:
        try:
            st = os.statvfs(directory)
            free = f"{human(st.f_bavail * st.f_frsize)} available"
        except OSError:
            free = "free space unknown"
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(e.errno, f"not enough space in {nvme_dir} for the optimizer state file: "
                                   f"needs {human(nbytes)} ({nbytes} bytes), {free}",
                          path) from None
        raise OSError(e.errno, f"cannot reserve {nbytes} bytes for the optimizer state: "
                               f"{os.strerror(e.errno)}", path) from None


def remove_dir(directory, keep: bool) -> None:
    """Our own directory at close: kept (marked so) or removed file by file (only names offload
    wrote)."""
    if directory:
        if keep:
            statedir.mark_kept(directory)
        else:
            statedir.remove_own(directory)
