"""moments/format.py: the moment formats: how Adam's exp_avg / exp_avg_sq are stored, as objects.

A format is a :class:`MomentFormat`, built by the one factory :func:`moment_format` (``"fp32"``,
``"bf16"`` or ``"8bit"``, the strings of the optimizer's ``moments=``). Everything that depends on
the format asks the object, never its name:

* ``sections``: its tensors (:class:`Section`: key, dtype, one entry per element or per ``BLOCK``
  elements), in storage order; ``state_sections(amsgrad)`` adds what a bucket stores beside them
  (fp32: ``max_exp_avg_sq``); ``entries``, ``spec``, ``zeros``, ``bytes_per_element``;
* ``compressed``: whether torch's fp32 ``exp_avg`` / ``exp_avg_sq`` exist only decoded (opt.state
  then holds decoded copies, not views of the state);
* ``encode`` / ``decode`` / ``check_values``: fp32 moments to its tensors and back, and the refusal
  of tensors its encoder cannot have written; ``saved_key``: a tensor's key in a saved state;
* ``kernel`` and ``columns``: the native entry that steps a bucket stored in it, and the columns of
  that entry's task-table rows (:class:`Columns`, exported by the native layer), from which
  offload/engine/table.py builds every bucket's rows the same way.

The update math never branches on the format: the kernel entry and its columns come with it.
The zero state of every format is all-zero bytes. A test (tests/test_moment_formats.py) checks the
declared sections against the kernel's ``moment_state`` and the columns against its tables, so a
change of the kernel's format fails loudly.

Names: inside the engine a compressed format's tensors keep the kernel's keys (``exp_avg``,
``exp_avg_sq``, ``exp_avg_scale``, ...). In a saved state (``offload.save``, or a state dict
handed to ``load_state_dict``) they are stored as ``<key>.<format>`` (e.g. ``exp_avg.8bit``,
``exp_avg_scale.8bit``), so a compressed tensor can never be mistaken for torch's ``exp_avg``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..native import adam as _fp32_kernel
from ..native import moments as _kernel

__all__ = ["MomentFormat", "Section", "Columns", "moment_format", "FORMATS", "FP32", "BLOCK",
           "CODE_VERSIONS", "MOMENT_KEYS", "check_moments", "check_min_size", "check_amsgrad",
           "parse_saved_key"]

BLOCK = _kernel.MOMENT_BLOCK
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# The version of each compressed format's byte code (what bytes a value becomes). offload.save
# records it in the checkpoint and offload.load refuses compressed moments of another version,
# which would decode to different values. Bump it whenever the kernel's encoder changes its bytes
# for the same input: tests/test_moment_codes.py pins a digest of each format's bytes per version
# and fails until you do.
CODE_VERSIONS = {"bf16": 1, "8bit": 1}


@dataclass(frozen=True)
class Section:
    """One tensor of a format: its key, its dtype, one entry per element or per ``BLOCK`` ones."""
    key: str
    dtype: torch.dtype
    per_block: bool = False

    @property
    def size(self) -> int:
        """Bytes per entry."""
        return self.dtype.itemsize


class Columns:
    """The columns of a kernel's task-table row: ``p`` (the fp32 master, or the parameter
    itself), ``g``, ``gdtype``, ``out``, ``odtype``, ``n``, ``step``; ``sections``: {state key:
    column of its address}; ``fixed``: (column, value) pairs of every row (the format's code)."""
    __slots__ = ("ncols", "p", "g", "gdtype", "out", "odtype", "n", "step", "sections", "fixed",
                 "dynamic")

    def __init__(self, ncols: int, *, p: int, g: int, gdtype: int, out: int, odtype: int, n: int,
                 step: int, sections: Dict[str, int], fixed: Tuple[Tuple[int, int], ...] = ()):
        self.ncols, self.p, self.g, self.gdtype, self.out = ncols, p, g, gdtype, out
        self.odtype, self.n, self.step = odtype, n, step
        self.sections, self.fixed = sections, fixed
        self.dynamic = [g, gdtype, out, odtype]   # the gradient and output columns, in that order


class MomentFormat:
    """The interface of a moment format (the module's docstring). One instance per format: compare
    formats with ``is``; ``name`` is the ``moments=`` string."""
    name = ""
    compressed = True    # torch's fp32 moments exist only decoded
    stagger = False      # state/layout.py stagger_gap: measured for fp32 moments' equal streams
    block = BLOCK        # elements that share per-block entries (a piece starts on a block)
    sections: Tuple[Section, ...] = ()

    def __init__(self, kernel, columns: Columns) -> None:
        self.kernel = kernel   # kernel(table, hyper, grad_multiplier, threads): steps the rows
        self.columns = columns
        self._per_block = frozenset(s.key for s in self.sections if s.per_block)

    def __repr__(self) -> str:
        return f"moment_format({self.name!r})"

    def __reduce__(self):
        return moment_format, (self.name,)

    # ---- what is stored
    def state_sections(self, amsgrad: bool) -> Tuple[Section, ...]:
        """The sections a bucket stores besides the fp32 master, in storage order. A compressed
        format keeps no max_exp_avg_sq: amsgrad with it is refused before anything is laid out
        (check_amsgrad)."""
        return self.sections

    def per_block(self, key: str) -> bool:
        return key in self._per_block

    def entries(self, key: str, n):
        """Entries of tensor ``key`` for ``n`` elements (an int or an int64 array): n, or its
        blocks for a per-block tensor (any other key, e.g. master_param: n)."""
        return -(-n // BLOCK) if key in self._per_block else n

    @property
    def bytes_per_element(self) -> int:
        """Bytes of exp_avg and exp_avg_sq per element, per-block tensors left out."""
        return sum(s.size for s in self.sections if not s.per_block)

    def moment_bytes(self, numel: Optional[int] = None) -> float:
        """Bytes of all of the format's tensors per element of a tensor of ``numel`` elements
        (None: per-block tensors over whole blocks)."""
        n = numel or BLOCK
        return sum(s.size * self.entries(s.key, n) for s in self.sections) / n

    def for_size(self, numel: int, min_size: int) -> "MomentFormat":
        """The format of a parameter of ``numel`` elements: this one from ``min_size`` elements on
        (and never for an empty one), fp32 below."""
        return self if numel >= max(min_size, 1) else FP32

    def spec(self, numel: int) -> Dict[str, Tuple[torch.dtype, int]]:
        """{key: (dtype, number of entries)} of a parameter of ``numel`` elements."""
        return {s.key: (s.dtype, self.entries(s.key, numel)) for s in self.sections}

    def zeros(self, numel: int) -> Dict[str, torch.Tensor]:
        """The zero state of ``numel`` elements (all-zero bytes), flat tensors by key."""
        return {k: torch.zeros(cnt, dtype=dt) for k, (dt, cnt) in self.spec(numel).items()}

    def saved_key(self, key: str) -> str:
        """Tensor ``key``'s key in a saved state."""
        return f"{key}.{self.name}"

    def keys_of(self, moment: str) -> Tuple[str, ...]:
        """The tensors that hold ``moment`` ("exp_avg" or "exp_avg_sq"): the codes and their
        scales, if any (``<moment>_scale``); each moment is encoded on its own."""
        return tuple(s.key for s in self.sections if s.key in (moment, moment + "_scale"))

    # ---- values
    def encode(self, m: torch.Tensor, v: torch.Tensor) -> Dict[str, torch.Tensor]:
        """This format's flat tensors of fp32 moments, as the kernel's encoder would store them."""
        raise NotImplementedError

    def decode(self, raw: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """fp32 (exp_avg, exp_avg_sq), flat, from one parameter's tensors of this format."""
        extra = [raw[s.key].reshape(-1) for s in self.sections if s.key not in MOMENT_KEYS]
        return _kernel.decode_moments(raw["exp_avg"].reshape(-1), raw["exp_avg_sq"].reshape(-1),
                                      self.name, *extra)

    def check_values(self, raw: Dict[str, torch.Tensor], where: str) -> None:
        """Refuse tensors (flat, of the shapes spec() gives) that the encoder cannot have written,
        naming the first bad entry: such a state would decode to values no training produced and
        train on them silently."""

    def _refuse(self, key: str, idx: int, what: str, where: str):
        raise ValueError(f"{where}: '{self.saved_key(key)}'[{idx}] {what}: not a state the "
                         f"{self.name} encoder writes (a corrupted or hand-made state)")


def _flat32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to(torch.float32)


class Fp32Moments(MomentFormat):
    """torch's own: fp32 exp_avg and exp_avg_sq (and max_exp_avg_sq with amsgrad), viewable as
    they are; the fp32 kernel (offload/native/adam.py)."""
    name, compressed, stagger, block = "fp32", False, True, 1
    sections = (Section("exp_avg", torch.float32), Section("exp_avg_sq", torch.float32))

    def __init__(self) -> None:
        k = _fp32_kernel
        super().__init__(k.step_table, Columns(
            k.TASK_COLS, p=k.COL_P, g=k.COL_G, gdtype=k.COL_GD, out=k.COL_OUT, odtype=k.COL_OD,
            n=k.COL_N, step=k.COL_STEP,
            sections={"exp_avg": k.COL_M, "exp_avg_sq": k.COL_V, "max_exp_avg_sq": k.COL_VMAX}))

    def state_sections(self, amsgrad: bool) -> Tuple[Section, ...]:
        return self.sections + ((Section("max_exp_avg_sq", torch.float32),) if amsgrad else ())

    def encode(self, m, v):
        return {"exp_avg": _flat32(m), "exp_avg_sq": _flat32(v)}

    def decode(self, raw):
        return raw["exp_avg"].reshape(-1).float(), raw["exp_avg_sq"].reshape(-1).float()


class _Compressed(MomentFormat):
    """A format of the compressed-moment kernel (offload/native/moments.py, csrc/moments.h)."""

    def __init__(self) -> None:
        c = _kernel.MOMENT_COLS
        names = {"exp_avg": "m", "exp_avg_sq": "v", "exp_avg_scale": "m_scale",
                 "exp_avg_sq_scale": "v_scale"}
        super().__init__(_kernel.step_moment_table, Columns(
            _kernel.MOMENT_TASK_COLS, p=c["p"], g=c["g"], gdtype=c["gd"], out=c["out"],
            odtype=c["od"], n=c["n"], step=c["step"],
            sections={s.key: c[names[s.key]] for s in self.sections},
            fixed=((c["fmt"], _kernel.MOMENT_FORMATS[self.name]),)))


class Bf16Moments(_Compressed):
    """exp_avg and exp_avg_sq as bfloat16, rounded to nearest even."""
    name = "bf16"
    sections = (Section("exp_avg", torch.bfloat16), Section("exp_avg_sq", torch.bfloat16))

    def encode(self, m, v):
        return {k: _flat32(t).to(torch.bfloat16) for k, t in zip(MOMENT_KEYS, (m, v))}

    def check_values(self, raw, where):
        """exp_avg_sq is non-negative or NaN."""
        v = raw["exp_avg_sq"].reshape(-1)
        neg = v < 0
        if bool(neg.any()):
            i = int(neg.nonzero()[0])
            self._refuse("exp_avg_sq", i, f"= {v[i].item()!r} is negative", where)


# the largest scale bits the 8-bit encoder can write (shr1 of the largest finite float's bits) and
# the scale of a poisoned block (csrc/moments.h kQPoisonScale)
_MAX_SCALE_BITS = 0x7F7FFFFF >> 1
_POISON_BITS = 0x7FE00000


class Block8Moments(_Compressed):
    """Blockwise 8-bit: exp_avg int8, exp_avg_sq uint8, one fp32 scale per block and moment
    (csrc/moments.h)."""
    name = "8bit"
    sections = (Section("exp_avg", torch.int8), Section("exp_avg_sq", torch.uint8),
                Section("exp_avg_scale", torch.float32, True),
                Section("exp_avg_sq_scale", torch.float32, True))

    def encode(self, m, v):
        """The encoder described at the top of csrc/moments.h: r = shr1(|m|) with m's sign and
        u = shr1(sqrt(v)) (shr1: the float whose bit pattern is the input's shifted right by one),
        per block the maxima of |r| and u as scales, round-to-nearest-even codes against them. A
        block with a non-finite value is stored poisoned (the NaN scale 0x7FE00000, zero codes)
        like the kernel does. tests/test_moments_optim.py::test_encode_inverts_decode checks this
        against the kernel's decode."""
        m, v = _flat32(m), _flat32(v)
        if bool((v < 0).any()):
            raise ValueError("exp_avg_sq has negative entries: not a valid Adam second moment")
        n = m.numel()
        nb = (n + BLOCK - 1) // BLOCK
        pad = nb * BLOCK - n

        def shr1(x):  # x >= 0 (or NaN/inf magnitudes): bits < 2^31, so the int32 shift is logical
            return (x.view(torch.int32) >> 1).view(torch.float32)

        r = shr1(m.abs()).copysign(m)
        u = shr1(torch.sqrt(v))
        rb = torch.nn.functional.pad(r, (0, pad)).view(nb, BLOCK)
        ub = torch.nn.functional.pad(u, (0, pad)).view(nb, BLOCK)
        poison_bits = 0x7F800000 >> 1   # shr1(+inf): a magnitude at or above it came from inf/NaN
        bad = ((rb.abs().view(torch.int32) >= poison_bits).any(1)
               | (ub.view(torch.int32) >= poison_bits).any(1))
        max_m = rb.abs().amax(1)
        max_u = ub.amax(1)
        fmax = torch.finfo(torch.float32).max
        im = torch.where(max_m > 0, torch.clamp(127.0 / max_m, max=fmax), torch.zeros_like(max_m))
        iu = torch.where(max_u > 0, torch.clamp(255.0 / max_u, max=fmax), torch.zeros_like(max_u))
        qm = torch.round(rb * im[:, None]).clamp(-127, 127)
        qv = torch.round(ub * iu[:, None]).clamp(0, 255)
        qm[bad] = 0
        qv[bad] = 0
        poison = torch.tensor([_POISON_BITS], dtype=torch.int32).view(torch.float32)
        max_m = torch.where(bad, poison.expand_as(max_m), max_m)
        max_u = torch.where(bad, poison.expand_as(max_u), max_u)
        return {"exp_avg": qm.reshape(-1)[:n].to(torch.int8),
                "exp_avg_sq": qv.reshape(-1)[:n].to(torch.uint8),
                "exp_avg_scale": max_m.contiguous(), "exp_avg_sq_scale": max_u.contiguous()}

    def check_values(self, raw, where):
        """Scales are the bits of a non-negative float up to shr1(FLT_MAX) or the poison NaN
        (a negative or huge scale flips or inflates a whole block); m codes lie in [-127, 127]."""
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            bits = raw[key].reshape(-1).view(torch.int32)
            bad = ((bits < 0) | (bits > _MAX_SCALE_BITS)) & (bits != _POISON_BITS)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                self._refuse(key, i, f"= {raw[key].reshape(-1)[i].item()!r} (bits "
                                    f"{int(bits[i]) & 0xFFFFFFFF:#010x}) is no block scale", where)
        low = raw["exp_avg"].reshape(-1) == -128
        if bool(low.any()):
            self._refuse("exp_avg", int(low.nonzero()[0]),
                         "= -128 is outside the codes [-127, 127]", where)


# ---- the factory
_ALL: Dict[str, MomentFormat] = {f.name: f for f in (Fp32Moments(), Bf16Moments(),
                                                       Block8Moments())}
FORMATS = tuple(_ALL)   # the moments= strings
FP32 = _ALL["fp32"]


def moment_format(name) -> MomentFormat:
    """The format named ``name`` (one of FORMATS; a MomentFormat is returned as it is)."""
    if isinstance(name, MomentFormat):
        return name
    return _ALL[check_moments(name)]


def check_moments(moments) -> str:
    """The ``moments=`` argument, checked: one of FORMATS."""
    if not isinstance(moments, str) or moments not in _ALL:
        raise ValueError(f"moments must be one of {', '.join(map(repr, FORMATS))}, "
                         f"got {moments!r}")
    return moments


def check_amsgrad(moments, amsgrad: bool) -> None:
    """amsgrad keeps max_exp_avg_sq, which only fp32 moments have (``moments``: name or format)."""
    fmt = moment_format(moments)
    if amsgrad and fmt.compressed:
        raise ValueError(f"amsgrad=True is not supported with moments={fmt.name!r} (compressed "
                         "moments keep no max_exp_avg_sq); use moments='fp32' for amsgrad")


def check_min_size(min_size) -> int:
    """``moments_min_size=``: the smallest tensor (elements) that keeps compressed moments."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"moments_min_size must be an int >= 0, got {min_size!r}")
    return min_size


def parse_saved_key(key) -> Optional[Tuple[str, str]]:
    """(kernel key, format name) of a saved compressed tensor's key, None for any other key."""
    if not isinstance(key, str) or "." not in key:
        return None
    k, name = key.rsplit(".", 1)
    fmt = _ALL.get(name)
    if fmt is None or not fmt.compressed or not any(s.key == k for s in fmt.sections):
        return None
    return k, name
