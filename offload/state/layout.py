"""state/layout.py: where each byte of optimizer state sits (pure: shapes in, offsets out, no
allocation).

One layout serves every mode: the NVMe/mmap state file, the host-RAM tier, the device-parameter
staging ring and the planner (``offload.plan``) all call :func:`build_layout`, so what the planner
prints is what the engine allocates.

Parameters are packed, group by group and in order, into *buckets*. A bucket holds runs
(*pieces*) of one or more parameters and stores each state kind as one contiguous *section*:
``[master_param |] exp_avg | exp_avg_sq [| max_exp_avg_sq]``. A section is ``cap`` fp32 elements;
a piece starts on a 16-element (64-byte) boundary inside every section. Buckets start on
``align`` bytes (4 KiB: one O_DIRECT request per bucket).

Rules:
  * a master section exists iff the parameter is bf16/fp16 or lives on a device (a host fp32
    parameter is its own master);
  * parameters with ``requires_grad=False`` (``Shape.active`` False) get no piece: no bytes;
  * a bucket closes when its state would exceed ``max_state_bytes`` (the NVMe slot size) or its
    parameter bytes would exceed ``max_param_bytes`` (the device staging bucket);
  * a parameter that fits in one bucket is never split; a larger one is cut into pieces of whole
    4 KiB pages per section, each in a bucket of its own (so a split parameter's section pieces
    are page-aligned and can be mapped side by side as one tensor).
Sections are described by (key, element bytes), as the moment format gives them.

Moment formats (``Shape.moments``, a MomentFormat of offload/moments/format.py): a bucket holds
parameters of one format; its sections are ``[master_param |]`` followed by the format's
``state_sections`` (fp32: ``exp_avg | exp_avg_sq [| max_exp_avg_sq]``; 8bit: ``exp_avg`` int8,
``exp_avg_sq`` uint8 and one fp32 scale per 256-element block each). Pieces start on a multiple
of the format's ``block`` (a whole block for compressed moments), and a split parameter is cut on
block boundaries, so the kernel's blocks are the same whatever the bucketing (RAM == NVMe == mmap
bitwise, any ``host_budget``).
"""
from __future__ import annotations

import operator
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..base.memory import ALIGN, round_up
from ..moments.format import FP32, MomentFormat

__all__ = ["Shape", "Piece", "Bucket", "Layout", "build_layout", "split_buckets", "stagger_gap",
           "piece_columns", "section_keys", "unit", "round_up", "ELEM", "ALIGN"]

ELEM = 16          # pieces start on 16-element (64-byte) boundaries inside a section
_PAGE_ELEMS = ALIGN // 4   # ALIGN: buckets start (and end) on 4 KiB


@dataclass(frozen=True)
class Shape:
    """What the layout needs to know about one parameter (its local shard under FSDP2)."""
    group: int
    index: int            # position inside its group
    numel: int
    itemsize: int         # bytes per element of the parameter (and its gradient)
    master: bool          # needs an fp32 master section
    active: bool = True   # requires_grad: only active parameters get state
    moments: MomentFormat = FP32  # how exp_avg / exp_avg_sq are stored (moments/format.py)


@dataclass(frozen=True)
class Piece:
    param: int            # index of the parameter inside its group
    start: int            # first element of the parameter in this piece
    n: int                # elements
    pos: int              # element offset inside every section of the bucket
    boff: int             # byte offset in the bucket's staging (grad / weights in the param dtype)
    itemsize: int


def section_keys(master: bool, amsgrad: bool,
                 moments: MomentFormat = FP32) -> Tuple[Tuple[str, int], ...]:
    """(state key, bytes per entry) of a bucket's sections, in storage order. Some sections of a
    format may have one entry per block, not per element (the format's ``entries``)."""
    return ((("master_param", 4),) if master else ()) + tuple(
        (s.key, s.size) for s in moments.state_sections(amsgrad))


def unit(moments: MomentFormat) -> int:
    """Element granularity of pieces: 16 (64 bytes of fp32), or the format's block if larger."""
    return round_up(moments.block, ELEM)


@dataclass
class Bucket:
    index: int
    group: int
    master: bool
    amsgrad: bool
    # elements per section (multiple of ELEM, of the block if compressed)
    cap: int = 0
    offset: int = 0                   # byte offset in the state (file / arena), ALIGN-aligned
    nbytes: int = 0                   # ALIGN-aligned state bytes
    stage_bytes: int = 0              # staging bytes (64-byte aligned pieces in the param dtype)
    pieces: List[Piece] = field(default_factory=list)
    moments: MomentFormat = FP32      # moment format of every piece in this bucket
    gap: int = 0                      # fp32 elements left after each section (stagger, below)

    @property
    def keys(self) -> Tuple[Tuple[str, int], ...]:
        return section_keys(self.master, self.amsgrad, self.moments)

    def section(self, key: str) -> int:
        """Byte offset of section ``key`` inside the bucket."""
        off = 0
        for k, size in self.keys:
            if k == key:
                return off
            off += self.moments.entries(k, self.cap) * size + 4 * self.gap
        raise KeyError(key)

    def span(self, key: str, pc: "Piece") -> Tuple[int, int]:
        """(byte offset inside the bucket, bytes) of piece ``pc``'s part of section ``key``."""
        size = dict(self.keys)[key]
        return (self.section(key) + self.moments.entries(key, pc.pos) * size,
                self.moments.entries(key, pc.n) * size)

    @property
    def state_bytes(self) -> int:
        entries = self.moments.entries
        return sum(entries(k, self.cap) * size + 4 * self.gap for k, size in self.keys)


@dataclass
class Layout:
    buckets: List[Bucket]
    # (group, index) -> [(bucket index, piece)]
    of_param: Dict[Tuple[int, int], List[Tuple[int, Piece]]]
    nbytes: int                                                # total state bytes (ALIGN multiple)
    # group -> (what it was computed for, the mask of unplaced())
    _unplaced: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_bucket_bytes(self) -> int:
        return max([b.nbytes for b in self.buckets] + [0])

    @property
    def max_stage_bytes(self) -> int:
        return max([b.stage_bytes for b in self.buckets] + [0])

    def extend(self, other: "Layout") -> "Layout":
        """``other`` (laid out for new groups) appended after this layout (``add_param_group``)."""
        base, shift = self.nbytes, len(self.buckets)
        for b in other.buckets:
            b.index += shift
            b.offset += base
        self.buckets.extend(other.buckets)
        for k, v in other.of_param.items():
            self.of_param[k] = [(bi + shift, pc) for bi, pc in v]
        self.nbytes += other.nbytes
        return self

    def truncate(self, nb: int, nbytes: int, was: dict) -> set:
        """Back to the first ``nb`` buckets (``nbytes`` bytes): the entries of ``of_param`` that
        point into the buckets that go are removed, those of ``was`` ((group, index) -> entry;
        None: none) put back. Returns the indices of the buckets that went."""
        gone = {b.index for b in self.buckets[nb:]}
        del self.buckets[nb:]
        self.nbytes = nbytes
        for key in [k for k, v in self.of_param.items() if any(bi in gone for bi, _pc in v)]:
            del self.of_param[key]
        for key, v in was.items():
            if v is not None:
                self.of_param[key] = v
        return gone

    def drop_groups(self, gi: int) -> None:
        """The ``of_param`` entries of the groups from ``gi`` on go (their buckets: truncate)."""
        for key in [k for k in self.of_param if k[0] >= gi]:
            del self.of_param[key]

    def unplaced(self, gi: int, numels: list) -> np.ndarray:
        """Bool mask of group gi's non-empty parameters (``numels``: their element counts) that
        have no state laid out (yet); cached until the layout or the group changes."""
        key = (len(self.buckets), len(self.of_param), len(numels))
        got = self._unplaced.get(gi)
        if got is None or got[0] != key:
            mask = np.array([bool(n) and not self.of_param.get((gi, i))
                             for i, n in enumerate(numels)], dtype=bool)
            got = self._unplaced[gi] = (key, mask)
        return got[1]


@lru_cache(maxsize=None)
def _per_elem_state(master: bool, amsgrad: bool, moments: MomentFormat = FP32) -> float:
    u = unit(moments)
    keys = section_keys(master, amsgrad, moments)
    return sum(moments.entries(k, u) * size for k, size in keys) / u


def stagger_gap(cap: int) -> int:
    """fp32 elements left after each section of a bucket whose sections hold ``cap`` elements, in
    host RAM (``build_layout(stagger=True)``). Sections exactly ``cap`` apart are congruent modulo
    a large power of two whenever the sizes are (128M parameters: 512 MiB), and the kernel's
    streams then contend for the same cache sets and DRAM banks (measured on an AVX2 EPYC: a 128M
    step took 250 ms instead of 134 ms). 64 KiB + 64 B breaks that; small buckets fit the caches,
    and one cache line of gap is enough there."""
    return 16400 if cap >= (1 << 18) else ELEM


def _limits(s: Shape, amsgrad: bool, max_state_bytes: Optional[int]) -> Tuple[int, Optional[int]]:
    """(piece granularity, most elements of ``s`` a bucket holds: None for unbounded buckets)."""
    u = unit(s.moments)
    if not max_state_bytes:
        return u, None
    per = _per_elem_state(s.master, amsgrad, s.moments)
    cap_max = int(max_state_bytes // per) // u * u
    if cap_max < u:
        raise ValueError(f"a state bucket of {max_state_bytes} bytes cannot hold one {u}-element "
                         f"piece ({int(u * per)} bytes): raise host_budget")
    return u, cap_max


def _split_step(cap_max: int) -> int:
    """Elements per piece of a parameter too large for one bucket: whole pages of every section
    (a budget too small for one page per section: 16-element pieces, views then join by
    copying)."""
    return cap_max // _PAGE_ELEMS * _PAGE_ELEMS or cap_max


def split_buckets(shapes: Sequence[Shape], *, amsgrad: Sequence[bool],
                  max_state_bytes: Optional[int]) -> int:
    """The buckets :func:`build_layout` gives to parameters too large for one bucket (one per
    piece), counted without laying them out: the other parameters take at most one bucket each."""
    n = 0
    for s in shapes:
        if s.active and s.numel:
            u, cap_max = _limits(s, bool(amsgrad[s.group]), max_state_bytes)
            if cap_max is not None and round_up(s.numel, u) > cap_max:
                n += -(-s.numel // _split_step(cap_max))
    return n


def build_layout(shapes: Sequence[Shape], *, amsgrad: Sequence[bool],
                 max_state_bytes: Optional[int] = None,
                 max_param_bytes: Optional[int] = None, align: int = ALIGN, first_bucket: int = 0,
                 stagger: bool = False) -> Layout:
    """Buckets for ``shapes`` (in group order); ``amsgrad[g]`` per group. ``None`` limits:
    unbounded. ``stagger``: fp32-moment buckets leave :func:`stagger_gap` elements after each
    section (the host-RAM tier; a state file keeps its sections back to back)."""
    buckets: List[Bucket] = []
    of_param: Dict[Tuple[int, int], List[Tuple[int, Piece]]] = {}
    offset = 0

    def close(b: Optional[Bucket]) -> None:
        nonlocal offset
        if b is None or not b.pieces:
            return
        if stagger and b.moments.stagger:
            b.gap = stagger_gap(b.cap)
        b.nbytes = round_up(b.state_bytes, align)
        b.offset = offset
        offset += b.nbytes
        b.index = first_bucket + len(buckets)
        buckets.append(b)
        for pc in b.pieces:
            of_param[(b.group, pc.param)].append((b.index, pc))

    open_b: Dict[Tuple[int, bool], Bucket] = {}
    group = None
    for s in shapes:
        if s.group != group:
            for b in open_b.values():
                close(b)
            open_b, group = {}, s.group
        of_param[(s.group, s.index)] = []
        if not s.active or s.numel == 0:
            continue
        ams = bool(amsgrad[s.group])
        mf = s.moments
        u, cap_max = _limits(s, ams, max_state_bytes)
        key = (s.group, s.master, mf)
        need_cap = round_up(s.numel, u)
        need_stage = round_up(s.numel * s.itemsize, 64)
        b = open_b.get(key)
        if cap_max is None or need_cap <= cap_max:      # fits alone: never split
            if b is not None and ((cap_max is not None and b.cap + need_cap > cap_max) or
                                  (max_param_bytes is not None and b.stage_bytes
                                   and b.stage_bytes + need_stage > max_param_bytes)):
                close(b)
                b = None
            if b is None:
                b = open_b[key] = Bucket(0, s.group, s.master, ams, moments=mf)
            b.pieces.append(Piece(s.index, 0, s.numel, b.cap, b.stage_bytes, s.itemsize))
            b.cap += need_cap
            b.stage_bytes += need_stage
            continue
        # larger than a bucket: whole pages per section, one bucket per piece
        close(b)
        open_b.pop(key, None)
        step = _split_step(cap_max)
        punit = _PAGE_ELEMS if step % _PAGE_ELEMS == 0 else u
        start = 0
        while start < s.numel:
            n = min(step, s.numel - start)
            pb = Bucket(0, s.group, s.master, ams, moments=mf)
            pb.pieces.append(Piece(s.index, start, n, 0, 0, s.itemsize))
            pb.cap = round_up(n, punit)  # every fp32 section page-aligned (see engine/views.py)
            pb.stage_bytes = round_up(n * s.itemsize, 64)
            close(pb)
            start += n
    for b in open_b.values():
        close(b)
    return Layout(buckets, of_param, offset)


def piece_columns(b: "Bucket", pieces, *fields: str) -> tuple:
    """One int64 array per attribute in ``fields`` (e.g. "param", "start", "pos", "n") of
    ``pieces`` of bucket ``b``; cached on the bucket when ``pieces`` is its full piece list (the
    per-step case)."""
    full = pieces is b.pieces or (len(pieces) == len(b.pieces)
                                  and all(map(operator.is_, pieces, b.pieces)))
    if full:
        got = b.__dict__.get("_piece_cols", {}).get(fields)
        if got is not None and got[0] == len(b.pieces):
            return got[1]
    cols = tuple(np.fromiter((getattr(pc, f) for pc in pieces), dtype=np.int64, count=len(pieces))
                 for f in fields)
    if full:
        b.__dict__.setdefault("_piece_cols", {})[fields] = (len(b.pieces), cols)
    return cols
