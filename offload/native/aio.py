"""native/aio.py: Python wrapper of the native async file I/O engine (``offload._C.AioEngine``).

``AioEngine.open`` opens a file with O_DIRECT (falling back to buffered I/O with a warning
where the filesystem refuses it, e.g. tmpfs), ``read``/``write`` queue a transfer between the
file and a host buffer (a CPU tensor or numpy array, kept alive until the request finishes) and
return a ``Request`` to ``wait()`` on or ``done()``-poll. Failures surface as ``OSError`` with
errno, path, offset and length. ``telemetry()`` reports bytes, resumed short transfers, errors
and direct-I/O fallbacks.

Safety: an ``AioFile`` owns its descriptors; ``close()`` refuses new transfers at once but the
descriptors are closed only after the last queued transfer using them has finished, so a queued
write can never land in another file that reuses the descriptor number. Buffers reach the native
engine as buffer-protocol exports (never raw addresses), held until the transfer is waited for.
An engine works only in the process that created it: after ``fork()`` the child gets a
``RuntimeError`` on use, and exiting the child neither hangs nor touches the parent's transfers.
"""
from __future__ import annotations

import errno as _errno
import os
import warnings
import weakref
from typing import Optional

import numpy as np
import torch

from . import _C
from ..base.tensors import check_storage

__all__ = ["AioEngine", "AioFile", "Request", "DIRECT_ALIGN", "FAULT_EIO", "FAULT_SHORT",
           "FAULT_EINTR"]

DIRECT_ALIGN = int(_C.AIO_DIRECT_ALIGN)
READ, WRITE = 0, 1
FAULT_NONE, FAULT_EIO, FAULT_SHORT, FAULT_EINTR = 0, 1, 2, 3


class AioFile:
    """An open file: ``fd`` (O_DIRECT when ``direct``) plus a buffered ``tail_fd`` for unaligned
    tails.

    Takes ownership of both descriptors (``tail_fd`` -1: none). ``fd``/``tail_fd`` read -1 once
    closed; the descriptors themselves close when no queued transfer uses them any more.
    """

    def __init__(self, path: str, fd: int, tail_fd: int, direct: bool):
        self.path = path
        self._handle = _C.AioFile(int(fd), int(tail_fd))  # owns the descriptors from here on
        if bool(direct) != self._handle.direct:
            self._handle.close()
            raise ValueError(f"{path}: direct={direct} but the descriptor was opened "
                             f"{'with' if self._handle.direct else 'without'} O_DIRECT")

    @property
    def fd(self) -> int:
        return self._handle.fd

    @property
    def tail_fd(self) -> int:
        return self._handle.tail_fd

    @property
    def direct(self) -> bool:
        return self._handle.direct

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def size(self) -> int:
        if self.closed:
            raise ValueError(f"{self.path} is closed")
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        """No new transfers; the descriptors close once the queued ones have finished.
        Idempotent."""
        self._handle.close()

    def __repr__(self) -> str:
        return f"AioFile({self.path!r}, direct={self.direct}{', closed' if self.closed else ''})"


def _buffer(buf, what: str):
    """(buffer-protocol object over the bytes, nbytes) of a contiguous CPU tensor / numpy array."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise RuntimeError(f"{what} is on {buf.device}: I/O buffers must be CPU tensors")
        if buf.layout is not torch.strided:
            raise RuntimeError(f"{what} is {buf.layout}: I/O buffers must be dense tensors")
        if not buf.is_contiguous():
            raise RuntimeError(f"{what} is not contiguous")
        check_storage(buf, what)
        nbytes = buf.numel() * buf.element_size()
        try:
            view = buf.detach().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as e:
            raise RuntimeError(f"{what} cannot be used as an I/O buffer: {e}") from None
        return view, nbytes
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise RuntimeError(f"{what} is not C-contiguous")
        return buf, buf.nbytes
    raise TypeError(f"{what} must be a CPU torch.Tensor or numpy array, got {type(buf).__name__}")


def _timeout(timeout) -> Optional[float]:
    """None (wait forever) or a non-negative float; inf also means forever."""
    if timeout is None:
        return None
    t = float(timeout)
    if t != t or t < 0:
        raise ValueError("timeout must be a non-negative number of seconds, or None / inf to "
                         f"wait forever; got {timeout!r}")
    return t


class Request:
    """One queued transfer. ``wait()`` returns the byte count or raises ``OSError``."""

    __slots__ = ("_engine", "id", "file", "op", "offset", "length", "_buf", "_result",
                 "__weakref__")

    def __init__(self, engine: "AioEngine", rid: int, file: AioFile, op: int, offset: int,
                 length: int, buf):
        self._engine, self.id, self.file, self.op = engine, rid, file, op
        self.offset, self.length, self._buf, self._result = offset, length, buf, None

    def done(self) -> bool:
        return self._result is not None or self._engine._native.poll(self.id)

    def _finish(self, r) -> None:
        self._result = r
        self._buf = None

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block (GIL released) until finished; ``TimeoutError`` if ``timeout`` seconds pass first.

        ``timeout`` None or ``inf``: wait forever; negative or NaN: ``ValueError``.
        """
        t = _timeout(timeout)
        if self._result is None:
            native = self._engine._native
            if native is None:
                raise RuntimeError("the AioEngine was closed before this request was waited for")
            r = native.wait(self.id, t)
            if r is None:
                raise TimeoutError(f"I/O request on {self.file.path} not finished "
                                   f"after {timeout} s")
            self._result = r
            self._engine._pending.pop(self.id, None)
            self._buf = None
        nbytes, err, off, length = self._result
        if err:
            what = "read" if self.op == READ else "write"
            if err == -1:
                raise OSError(_errno.EIO, f"unexpected end of file: {what} of {length} bytes at "
                                          f"offset {off} of {self.file.path} (file is "
                                          "shorter than expected)", self.file.path)
            raise OSError(err, f"{os.strerror(err)} during {what} of {length} bytes "
                               f"at offset {off}",
                          self.file.path)
        return nbytes


def _drain(native, pending: dict) -> None:
    # Buffers must outlive the transfers that use them: wait for all before releasing anything.
    # Each finished request's outcome is handed to its Request object, if it still exists.
    if os.getpid() != native.owner_pid:
        # forked child: the parent's transfers run in the parent only; nothing here uses the
        # buffers
        pending.clear()
        return
    for rid in list(pending):
        _buf, ref = pending.pop(rid)
        r = native.wait(rid, None)
        req = ref()
        if req is not None:
            req._result = r
            req._buf = None


class AioEngine:
    """Async file I/O: ``queue_depth`` transfers of up to ``block_size`` bytes in flight."""

    def __init__(self, queue_depth: int = 8, block_size: int = 1 << 20):
        if not isinstance(queue_depth, int) or not 1 <= queue_depth <= 256:
            raise ValueError(f"queue_depth must be an int in [1, 256], got {queue_depth!r}")
        if not isinstance(block_size, int) or block_size <= 0 or block_size % DIRECT_ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {DIRECT_ALIGN}, "
                             f"got {block_size!r}")
        self._native = _C.AioEngine(queue_depth, block_size)
        self._pending: dict = {}
        self.direct_fallbacks: list = []
        self._finalizer = weakref.finalize(self, _drain, self._native, self._pending)

    @property
    def queue_depth(self) -> int:
        return self._native.queue_depth

    @property
    def block_size(self) -> int:
        return self._native.block_size

    # ------------------------------------------------------------------ files
    def open(self, path: str, *, write: bool = True, create: bool = False, direct: bool = True,
             mode: int = 0o600, nofollow: bool = True) -> AioFile:
        """Open ``path`` for I/O. ``create`` makes a new file (fails if anything exists there).

        With ``direct`` the main descriptor uses O_DIRECT; if the filesystem refuses it (EINVAL),
        the file is used buffered, a ``RuntimeWarning`` is issued and ``telemetry()`` records it.
        """
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC
        if nofollow:
            flags |= os.O_NOFOLLOW
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        fd = os.open(path, flags, mode)
        tail_fd = -1
        try:
            tail_flags = (flags & ~(os.O_CREAT | os.O_EXCL))
            is_direct = False
            if direct:
                try:
                    dfd = os.open(path, tail_flags | os.O_DIRECT)
                except OSError as e:
                    if e.errno != _errno.EINVAL:
                        raise
                    warnings.warn(f"O_DIRECT is not supported for {path} (filesystem refused it); "
                                  "using buffered I/O through the page cache instead",
                                  RuntimeWarning, stacklevel=2)
                    self.direct_fallbacks.append(path)
                else:
                    tail_fd, fd, is_direct = fd, dfd, True
            return AioFile(path, fd, tail_fd, is_direct)
        except BaseException:
            os.close(fd)
            if tail_fd >= 0 and tail_fd != fd:
                os.close(tail_fd)
            raise

    # ------------------------------------------------------------------ transfers
    def _submit(self, op: int, file: AioFile, buf, offset: int, length: Optional[int]) -> Request:
        if self._native is None:
            raise RuntimeError("AioEngine is closed")
        view, nbytes = _buffer(buf, "buffer")
        if length is None:
            length = nbytes
        if not 0 <= length <= nbytes:
            raise ValueError(f"length {length} out of range for a buffer of {nbytes} bytes")
        if offset < 0:
            raise ValueError(f"negative file offset {offset}")
        if file.closed:
            raise ValueError(f"{file.path} is closed")
        rid = self._native.submit(op, file._handle, view, int(length), int(offset))
        req = Request(self, rid, file, op, offset, length, buf)
        self._pending[rid] = (buf, weakref.ref(req))
        return req

    def read(self, file: AioFile, buf, offset: int = 0, length: Optional[int] = None) -> Request:
        """Queue a read of ``length`` (default: the buffer's size) bytes at ``offset`` into
        ``buf``."""
        return self._submit(READ, file, buf, offset, length)

    def write(self, file: AioFile, buf, offset: int = 0, length: Optional[int] = None) -> Request:
        """Queue a write of ``length`` (default: the buffer's size) bytes from ``buf`` at
        ``offset``."""
        return self._submit(WRITE, file, buf, offset, length)

    def outstanding(self) -> int:
        return len(self._pending)

    def wait_all(self) -> None:
        """Wait for every queued request (errors are reported by each request's own wait())."""
        if self._native is not None:
            _drain(self._native, self._pending)

    # ------------------------------------------------------------------ misc
    def telemetry(self) -> dict:
        d = dict(self._native.stats()) if self._native is not None else {}
        d.update(queue_depth=self.queue_depth if self._native else None,
                 block_size=self.block_size if self._native else None,
                 direct_fallbacks=list(self.direct_fallbacks))
        return d

    def _set_fault(self, kind: int, nth: int) -> None:
        """Test hook: the ``nth`` system call from now fails once (FAULT_EIO / FAULT_SHORT /
        FAULT_EINTR)."""
        self._native._set_fault(int(kind), int(nth))

    def close(self) -> None:
        if self._native is not None:
            self._finalizer()
            self._native = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
