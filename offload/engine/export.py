"""engine/export.py: where ``state_dict()`` puts the fp32 moments it decodes from compressed state.

With ``state="nvme"|"mmap"`` the state is on disk because it does not fit in RAM; ``state_dict()``
(what HF Trainer, Lightning and accelerate ``torch.save``) must hand out fp32 ``exp_avg`` /
``exp_avg_sq`` in torch's layout, and for compressed moments those bytes exist nowhere. Decoding
them into ordinary tensors would cost 8 B per parameter of anonymous memory at once. Instead
they are decoded, a chunk at a time, into a file-backed shared mapping in the tier's own private
state directory: page cache the kernel writes back and evicts under pressure, so anonymous memory
stays bounded by one chunk whatever the model size. The file is created O_EXCL, its space
reserved up front (a full disk raises a clear OSError here, never a SIGBUS mid-copy), and
unlinked as soon as it is mapped: its space returns when the last exported tensor is freed, and
a crash leaves at most a file of a name offload owns (removed with the directory).
Resident (RAM) tiers decode into ordinary tensors: their state is in RAM already.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..moments import format as mformat
from ..state import statedir
from ..state import files

__all__ = ["DecodedSink", "CHUNK"]

CHUNK = 1 << 18   # elements decoded per call (a multiple of mformat.BLOCK): ~10 MiB of transients


class DecodedSink:
    """fp32 output space for ``n`` elements, file-backed in ``directory`` (None: ordinary
    memory)."""

    def __init__(self, directory: Optional[str], n: int):
        self.n, self.used = int(n), 0
        self.buf: Optional[torch.Tensor] = None
        if directory is None or self.n == 0:
            return
        path = os.path.join(directory, statedir.EXPORT_FILE)
        fd = files.open_exclusive(path)
        try:
            files.reserve(fd, 0, self.n * 4, directory, directory, path)
            storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=self.n * 4)
        finally:
            os.close(fd)
            os.unlink(path)   # ours (O_EXCL above); the mapping keeps the bytes alive
        self.buf = torch.empty(0, dtype=torch.float32).set_(storage, 0, (self.n,), (1,))

    def take(self, n: int) -> torch.Tensor:
        if self.buf is None:
            return torch.empty(n, dtype=torch.float32)
        if self.used + n > self.n:
            raise RuntimeError(f"DecodedSink: {self.used} + {n} elements exceed the "
                               f"{self.n} reserved")
        out = self.buf[self.used:self.used + n]
        self.used += n
        return out


def decode_into(raw: dict, fmt, n: int, sink: DecodedSink) -> tuple:
    """fp32 (exp_avg, exp_avg_sq), flat, of ``n`` elements of format ``fmt`` (``raw``: the flat
    compressed tensors by kernel key), decoded CHUNK elements at a time into ``sink``."""
    m, v = sink.take(n), sink.take(n)
    step = CHUNK - CHUNK % mformat.BLOCK
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        part = {k: (t[lo // mformat.BLOCK:(hi + mformat.BLOCK - 1) // mformat.BLOCK]
                    if fmt.per_block(k) else t[lo:hi]) for k, t in raw.items()}
        dm, dv = fmt.decode(part)
        m[lo:hi].copy_(dm)
        v[lo:hi].copy_(dv)
    return m, v
