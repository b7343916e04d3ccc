"""state/statedir.py: the private directories that hold NVMe/mmap optimizer state, and their
leftovers.

Every state directory is a new ``offload-state-XXXXXXXX`` directory (mkdtemp, mode 0700) with an
owner marker (``owner.json``: pid, process start time, boot id, pid namespace, host) written next
to the state file. A process that is killed (SIGKILL, OOM killer, power loss) cannot remove its
directory; the marker lets a later process tell such a leftover from the live state of another
optimizer: the owner is dead when the boot id differs, or the pid no longer runs, or it now
belongs to a process started at another time (pid reuse). Directories of other hosts or other pid
namespaces (a shared filesystem, containers) are never judged, so never reported or removed.

``find_stale_state(nvme_dir)`` lists leftovers, ``remove_stale_state(nvme_dir)`` removes them: only
directories whose name matches the pattern, that hold a valid marker of a dead owner, owned by this
user, and that contain nothing but the files offload writes there (anything else: left alone).
Removal unlinks those file names and ``rmdir``s, so it can never delete a file offload did not
create.
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import tempfile
import time
import warnings
from typing import List, NamedTuple, Optional

from ..base.units import human

__all__ = ["STATE_FILE", "EXPORT_FILE", "MARKER", "make_private_dir", "write_marker", "mark_kept",
           "remove_own",
           "find_stale_state", "remove_stale_state", "warn_stale", "StaleState", "parse_dirs"]

STATE_FILE = "state.bin"
MARKER = "owner.json"
_MARKER_TMP = MARKER + ".tmp"
# decoded state_dict() tensors (offload/engine/export.py): unlinked once mapped
EXPORT_FILE = "export.tmp"
_OWN_FILES = (STATE_FILE, MARKER, _MARKER_TMP, EXPORT_FILE)
_PREFIX = "offload-state-"
_NAME = re.compile(r"offload-state-[a-z0-9_]{8}")  # tempfile.mkdtemp's random part
_FORMAT = "offload-state-owner/1"


def make_private_dir(parent: str) -> str:
    """A new directory, mode 0700, only this process knows about (never an existing one)."""
    return tempfile.mkdtemp(prefix=_PREFIX, dir=parent)


def _path(d, what: str) -> str:
    """``d`` as a str path; a TypeError naming ``what`` (nvme_dir or an entry) if it is not one."""
    try:
        p = os.fspath(d)
    except TypeError:
        raise TypeError(f"{what} must be a directory path (str, bytes or os.PathLike; several "
                        f"drives: a list or tuple of them), got {type(d).__name__}") from None
    return os.fsdecode(p) if isinstance(p, bytes) else p


def parse_dirs(nvme_dir) -> List[Optional[str]]:
    """The drives ``nvme_dir`` names: a str or path (one directory; a str that is not an existing
    directory and holds commas is a comma-separated list), or a list/tuple of them. ``[None]`` for
    None."""
    if nvme_dir is None:
        return [None]
    if isinstance(nvme_dir, (list, tuple)):
        dirs = [_path(d, f"nvme_dir[{k}]") for k, d in enumerate(nvme_dir)]
    else:
        one = _path(nvme_dir, "nvme_dir")
        if "," in one and not os.path.isdir(one):
            dirs = [d.strip() for d in one.split(",")]
        else:
            dirs = [one]
    if not dirs or any(not d for d in dirs):
        what = "names an empty path" if dirs else "is empty"
        raise ValueError(f"nvme_dir={nvme_dir!r} {what}: give one or more existing directories (a "
                         "list, or one comma-separated string)")
    seen = {}
    for d in dirs:
        key = os.path.realpath(d)
        if key in seen:
            raise ValueError(f"nvme_dir lists the directory {d!r} twice (also as {seen[key]!r}): "
                             "give each drive once")
        seen[key] = d
    return dirs


# ------------------------------------------------------------------ who owns a directory
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22); None if it does
    not run (or is a zombie: it has already released everything)."""
    s = _read(f"/proc/{pid}/stat")
    if s is None:
        return None
    fields = s[s.rfind(")") + 2:].split()  # the command name may contain spaces and parentheses
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _identity() -> dict:
    pid = os.getpid()
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = None
    return {"format": _FORMAT, "pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _read(
        "/proc/sys/kernel/random/boot_id"), "pid_ns": ns, "host": socket.gethostname()}


def write_marker(directory: str) -> None:
    """Record this process as the owner of ``directory`` (a file created 0600 with
    O_EXCL|O_NOFOLLOW)."""
    d = _identity()
    d.update(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), kept=False)
    fd = os.open(os.path.join(directory, MARKER),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(d, f)


def mark_kept(directory: str) -> None:
    """The owner closed the store with keep_files=True: the directory is kept on purpose, not
    stale."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            d = json.load(f)
        d["kept"] = True
        tmp = os.path.join(directory, _MARKER_TMP)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(d, f)
        os.replace(tmp, os.path.join(directory, MARKER))
    except (OSError, ValueError):
        pass  # best effort: at worst a kept directory is later reported as a leftover


def _owner_dead(m: dict, me: dict) -> bool:
    """True only when we can be sure the owner no longer runs."""
    if m.get("format") != _FORMAT or not isinstance(m.get("pid"), int) or m.get("kept"):
        return False
    if m.get("host") != me["host"]:
        return False  # another machine sharing the filesystem: we cannot know
    if m.get("boot_id") and me["boot_id"] and m["boot_id"] != me["boot_id"]:
        return True  # the machine rebooted since
    if m.get("pid_ns") != me["pid_ns"]:
        return False  # another pid namespace (container): its pids mean nothing here
    if m["pid"] == me["pid"] and m.get("start_ticks") == me["start_ticks"]:
        return False  # ours
    ticks = _start_ticks(m["pid"])
    if ticks is None:
        if os.path.exists("/proc/self/stat"):
            return True
        try:  # no /proc: ask the kernel whether the pid exists
            os.kill(m["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False
    # pid reused by another process
    return m.get("start_ticks") is not None and ticks != m["start_ticks"]


# ------------------------------------------------------------------ leftovers
class StaleState(NamedTuple):
    path: str
    nbytes: int          # disk space it holds (allocated blocks)
    pid: int             # the dead owner
    created: str
    removable: bool      # False: it holds files offload did not create (left alone)


def _scan_dir(path: str, me: dict) -> Optional[StaleState]:
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            mfd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(mfd) as f:
                m = json.loads(f.read(4096))
        except (OSError, ValueError, UnicodeDecodeError):
            return None  # no (valid) marker: not ours to judge
        if not isinstance(m, dict) or not _owner_dead(m, me):
            return None
        nbytes, removable = 0, True
        for name in os.listdir(dfd):
            s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            nbytes += s.st_blocks * 512 if stat.S_ISREG(s.st_mode) else 0
            removable &= name in _OWN_FILES and not stat.S_ISDIR(s.st_mode)
        return StaleState(path, nbytes, m["pid"], str(m.get("created", "?")), removable)
    except OSError:
        return None
    finally:
        os.close(dfd)


def find_stale_state(nvme_dir) -> List[StaleState]:
    """State directories in ``nvme_dir`` (one directory, or several as the optimizer takes them)
    left by offload processes that no longer run."""
    dirs = parse_dirs(nvme_dir)
    if len(dirs) > 1:
        return [s for d in dirs for s in find_stale_state(d)]
    nvme_dir = os.fspath(dirs[0])
    me = _identity()
    try:
        names = sorted(os.listdir(nvme_dir))
    except OSError:
        return []
    found = (_scan_dir(os.path.join(nvme_dir, n), me) for n in names if _NAME.fullmatch(n))
    return [s for s in found if s is not None]


def remove_stale_state(nvme_dir) -> List[str]:
    """Remove the state directories of dead offload processes in ``nvme_dir`` (see
    ``find_stale_state``).

    Only the files offload writes into its directories are unlinked, then the empty directory is
    removed; a directory holding anything else is left as it is. Returns the removed paths.
    """
    removed = []
    for s in find_stale_state(nvme_dir):
        if s.removable and remove_own(s.path):
            removed.append(s.path)
    return removed


def remove_own(directory: str) -> bool:
    """Unlink offload's own files in ``directory`` (never following a link), then rmdir it.
    Returns False (leaving the directory) when anything else is in it."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        for name in _OWN_FILES:
            try:
                if not stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
    except OSError:
        return False
    finally:
        os.close(dfd)
    try:
        os.rmdir(directory)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            warnings.warn(f"offload left the optimizer state directory {directory} in place: it "
                          "holds files offload did not create", RuntimeWarning, stacklevel=3)
        return False
    return True


def warn_stale(nvme_dir: str) -> List[StaleState]:
    """Warn (RuntimeWarning) about leftovers of dead processes in ``nvme_dir``: paths, sizes, the
    call to remove them."""
    nvme_dir = os.path.abspath(nvme_dir)  # the call in the message works from any directory
    stale = find_stale_state(nvme_dir)
    if stale:
        lines = [f"  {s.path}: {human(s.nbytes)}, process {s.pid}, created {s.created}"
                 + ("" if s.removable else " (holds other files: left alone)") for s in stale]
        total = sum(s.nbytes for s in stale)
        warnings.warn(f"{len(stale)} optimizer state director{'y' if len(stale) == 1 else 'ies'} "
                      "of offload processes that no longer run "
                      f"{'is' if len(stale) == 1 else 'are'} left in {nvme_dir}, holding "
                      f"{human(total)}:\n" + "\n".join(lines)
                      + f"\nRemove them with: offload.store.remove_stale_state({nvme_dir!r})",
                      RuntimeWarning, stacklevel=5)  # the line that constructs the optimizer
    return stale
