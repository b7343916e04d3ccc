"""engine/views.py: torch-layout tensors of one parameter's state, as views of the tier (never
copies).

A parameter in one bucket: each state key is a plain view of the tier's bytes (for NVMe a shared
mapping of the file, read lazily by the page cache). A parameter split over several buckets has
page-aligned pieces (offload/state/layout.py); its sections are mapped side by side into one
reserved address range (``MAP_FIXED``), so it is still one tensor whose bytes are read only when
used: ``torch.save(opt.state_dict())`` streams from the file instead of materializing the state.
Every view keeps its mapping alive, also after the optimizer is closed.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

import torch

__all__ = ["param_views"]

_libc = None


def _mmap_fixed():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        _libc = lib
    return _libc.mmap


def _joined(fd, spans: list, total: int) -> torch.Tensor:
    """uint8 tensor of ``total`` bytes whose consecutive parts map the file ``spans`` [(offset,
    nbytes)]. ``fd``: the file, or (state on several drives) a function: offset -> (fd, offset in
    that file)."""
    page = mmap.PAGESIZE
    size = (total + page - 1) // page * page
    region = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    base = torch.frombuffer(region, dtype=torch.uint8)
    addr = base.data_ptr()
    fixed = _mmap_fixed()
    at = 0
    for off, nb in spans:
        length = (nb + page - 1) // page * page
        f, off = fd(off) if callable(fd) else (fd, off)
        # MAP_FIXED
        r = fixed(addr + at, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10, f,
                  off)
        if r is None or r == ctypes.c_void_p(-1).value or r != addr + at:
            e = ctypes.get_errno()
            raise OSError(e, f"cannot map the optimizer state file: {os.strerror(e)}")
        at += nb
    return base[:total]   # the view holds `region`; freeing it unmaps every part


def param_views(tier, layout, gi: int, i: int, shape, mapping, fd: Optional[int], only=None,
                copied: Optional[set] = None) -> dict:
    """{key: fp32 tensor shaped like the parameter} for parameter ``i`` of group ``gi``.

    ``mapping``: uint8 tensor over the whole state (a file mapping or the RAM arena view function);
    ``fd``: the file (for split parameters; a function offset -> (fd, offset) for several drives),
    None for the RAM tier. ``copied``: gets the keys whose tensors had to be joined by a copy (not
    views: pieces of under a page per section).
    """
    entries = layout.of_param.get((gi, i), [])
    out = {}
    if not entries:
        return out
    b0 = layout.buckets[entries[0][0]]
    numel = sum(pc.n for _, pc in entries)
    for key, size in b0.keys:
        # e.g. the fp32 master of a compressed-moment bucket
        if only is not None and key not in only:
            continue
        if len(entries) == 1:
            bi, pc = entries[0]
            b = layout.buckets[bi]
            off = b.offset + b.section(key) + pc.pos * size
            raw = mapping(off, pc.n * size)
        else:
            spans = []
            for bi, pc in entries:
                b = layout.buckets[bi]
                spans.append((b.offset + b.section(key) + pc.pos * size, pc.n * size))
            page = mmap.PAGESIZE
            aligned = (all(off % page == 0 for off, _ in spans)
                       and all(nb % page == 0 for _, nb in spans[:-1]))
            raw = _joined(fd, spans, numel * size) if fd is not None and aligned else None
        if raw is None:  # RAM tier or a host_budget below one page per section: joined by a copy
            parts = []
            for bi, pc in entries:
                b = layout.buckets[bi]
                parts.append(mapping(b.offset + b.section(key) + pc.pos * size, pc.n * size))
            raw = torch.cat(parts)
            if copied is not None:
                copied.add(key)
        out[key] = raw.view(torch.float32).view(shape)
    return out
