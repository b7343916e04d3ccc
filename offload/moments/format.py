"""moments/format.py: the storage description of compressed Adam moments, as the layout, the
engine, state_dict and the checkpoint need it.

Everything here is derived from the kernel's public API (``offload.native.moments.moment_state`` /
``decode_moments``): which tensors a format has, their dtype, and whether a tensor has one entry
per element or one per ``MOMENT_BLOCK`` block. Nothing hard-codes a byte size, so a change of the
kernel's format either flows through or fails loudly here (an unknown tensor shape raises at import).

Names: inside the engine the compressed tensors keep the kernel's keys (``exp_avg``,
``exp_avg_sq``, ``exp_avg_scale``, ...). In a saved state (``offload.save``, or a state dict
handed to ``load_state_dict``) they are stored as ``<key>.<format>`` (e.g. ``exp_avg.8bit``,
``exp_avg_scale.8bit``), so a compressed tensor can never be mistaken for torch's ``exp_avg``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, Optional, Tuple

import torch

from ..native.moments import MOMENT_BLOCK, MOMENT_FORMATS, decode_moments, moment_state

__all__ = ["FORMATS", "BLOCK", "CODE_VERSIONS", "check_moments", "check_min_size", "check_amsgrad",
           "sections",
           "per_block", "saved_key", "parse_saved_key",
           "spec", "encode", "decode", "check_values", "keys_of", "MOMENT_KEYS"]

FORMATS = ("fp32",) + tuple(MOMENT_FORMATS)
BLOCK = MOMENT_BLOCK
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# The version of each format's byte code (what bytes a value becomes). offload.save records it in
# the checkpoint and offload.load refuses compressed moments of another version, which would decode
# to different values. Bump it whenever the kernel's encoder changes its bytes for the same input:
# tests/test_moment_codes.py pins a digest of each format's bytes per version and fails until you do.
CODE_VERSIONS = {"bf16": 1, "8bit": 1}


def check_moments(moments) -> str:
    if not isinstance(moments, str) or moments not in FORMATS:
        raise ValueError(f"moments must be one of {', '.join(repr(f) for f in FORMATS)}, got {moments!r}")
    return moments


def check_amsgrad(moments: str, amsgrad: bool) -> None:
    """amsgrad keeps max_exp_avg_sq, which only fp32 moments have."""
    if moments != "fp32" and amsgrad:
        raise ValueError(f"amsgrad=True is not supported with moments={moments!r} (compressed "
                         "moments keep no max_exp_avg_sq); use moments='fp32' for amsgrad")


def check_min_size(min_size) -> int:
    """``moments_min_size=``: the smallest tensor (elements) that keeps compressed moments."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"moments_min_size must be an int >= 0, got {min_size!r}")
    return min_size


@lru_cache(maxsize=None)
def sections(fmt: str) -> Tuple[Tuple[str, int, bool], ...]:
    """(key, bytes per entry, per_block) of format ``fmt``'s tensors, in moment_state's order."""
    n = 3 * BLOCK + 1   # 4 blocks, the last one short: tells per-element from per-block tensors
    st = moment_state(n, fmt)
    out = []
    for k, t in st.items():
        if t.numel() == n:
            out.append((k, t.element_size(), False))
        elif t.numel() == (n + BLOCK - 1) // BLOCK:
            out.append((k, t.element_size(), True))
        else:  # a format this module does not understand: refuse rather than guess
            raise RuntimeError(f"moment_state({n}, {fmt!r})[{k!r}] has {t.numel()} entries: not per element "
                               "or per block; offload/moments/format.py needs updating for this format")
    if not all(k in st for k in MOMENT_KEYS):
        raise RuntimeError(f"moment_state(..., {fmt!r}) lacks {MOMENT_KEYS}")
    return tuple(out)


@lru_cache(maxsize=None)
def _dtypes(fmt: str) -> Dict[str, torch.dtype]:
    return {k: t.dtype for k, t in moment_state(1, fmt).items()}


def per_block(fmt: str, key: str) -> bool:
    return any(k == key and pb for k, _, pb in sections(fmt))


def nentries(fmt: str, key: str, n: int) -> int:
    return (n + BLOCK - 1) // BLOCK if per_block(fmt, key) else n


def spec(fmt: str, numel: int) -> Dict[str, Tuple[torch.dtype, int]]:
    """{key: (dtype, number of entries)} of a parameter of ``numel`` elements."""
    dt = _dtypes(fmt)
    return {k: (dt[k], nentries(fmt, k, numel)) for k, _, _ in sections(fmt)}


def saved_key(key: str, fmt: str) -> str:
    return f"{key}.{fmt}"


def parse_saved_key(key) -> Optional[Tuple[str, str]]:
    """(kernel key, format) of a saved compressed key, None for any other key."""
    if not isinstance(key, str) or "." not in key:
        return None
    k, fmt = key.rsplit(".", 1)
    if fmt not in MOMENT_FORMATS or k not in dict((s[0], 0) for s in sections(fmt)):
        return None
    return k, fmt


def keys_of(fmt: str, moment: str) -> Tuple[str, ...]:
    """The tensors of format ``fmt`` that hold ``moment`` ("exp_avg" or "exp_avg_sq"): the codes and
    their scales, if any (``<moment>_scale``); each moment is encoded on its own."""
    return tuple(k for k, _, _ in sections(fmt) if k == moment or k == moment + "_scale")


def decode(raw: Dict[str, torch.Tensor], fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 (exp_avg, exp_avg_sq), flat, from the flat compressed tensors of one parameter."""
    extra = [raw[k].reshape(-1) for k, _, _ in sections(fmt) if k not in MOMENT_KEYS]
    return decode_moments(raw["exp_avg"].reshape(-1), raw["exp_avg_sq"].reshape(-1), fmt, *extra)


# 8bit: the largest scale bits the encoder can write (shr1 of the largest finite float's bits) and
# the scale of a poisoned block (csrc/moments.h kQPoisonScale)
_MAX_SCALE_BITS = 0x7F7FFFFF >> 1
_POISON_BITS = 0x7FE00000


def check_values(raw: Dict[str, torch.Tensor], fmt: str, where: str) -> None:
    """Refuse compressed tensors (flat, of the shapes spec() gives) that the kernel's encoder cannot
    have written, naming the first bad entry: such a state would decode to values no training
    produced (a negative or huge scale flips or inflates a whole block of moments) and train on them
    silently. 8bit: scales are the bits of a non-negative float up to shr1(FLT_MAX) or the poison
    NaN, m codes lie in [-127, 127]; bf16: exp_avg_sq is non-negative or NaN."""
    def refuse(key, idx, what):
        raise ValueError(f"{where}: '{saved_key(key, fmt)}'[{idx}] {what}: not a state the {fmt} encoder "
                         "writes (a corrupted or hand-made state)")

    if fmt == "8bit":
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            bits = raw[key].reshape(-1).view(torch.int32)
            bad = ((bits < 0) | (bits > _MAX_SCALE_BITS)) & (bits != _POISON_BITS)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                refuse(key, i, f"= {raw[key].reshape(-1)[i].item()!r} (bits {int(bits[i]) & 0xFFFFFFFF:#010x}) is no "
                               "block scale")
        low = raw["exp_avg"].reshape(-1) == -128
        if bool(low.any()):
            refuse("exp_avg", int(low.nonzero()[0]), "= -128 is outside the codes [-127, 127]")
    elif fmt == "bf16":
        v = raw["exp_avg_sq"].reshape(-1)
        neg = v < 0
        if bool(neg.any()):
            i = int(neg.nonzero()[0])
            refuse("exp_avg_sq", i, f"= {v[i].item()!r} is negative")


def encode(m: torch.Tensor, v: torch.Tensor, fmt: str) -> Dict[str, torch.Tensor]:
    """Compressed tensors of fp32 moments (flat), as the kernel's encoder would store them.

    ``bf16``: round to nearest even. ``8bit``: the encoder described at the top of csrc/moments.h:
    r = shr1(|m|) with m's sign and u = shr1(sqrt(v)) (shr1: the float whose bit pattern is the
    input's shifted right by one), per block the maxima of |r| and u as scales, round-to-nearest-
    even codes against them. A block with a non-finite value is stored poisoned (the NaN scale
    0x7FE00000, zero codes) like the kernel does. The test
    tests/test_moments_optim.py::test_encode_inverts_decode checks this against ``decode_moments``.
    """
    m = m.detach().reshape(-1).to(torch.float32)
    v = v.detach().reshape(-1).to(torch.float32)
    if fmt == "bf16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    if fmt != "8bit" or [k for k, _, _ in sections(fmt)] != ["exp_avg", "exp_avg_sq", "exp_avg_scale",
                                                             "exp_avg_sq_scale"]:
        raise NotImplementedError(f"no encoder for moment format {fmt!r} (offload/moments/format.py)")
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
    bad = (rb.abs().view(torch.int32) >= poison_bits).any(1) | (ub.view(torch.int32) >= poison_bits).any(1)
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
    return {"exp_avg": qm.reshape(-1)[:n].to(torch.int8), "exp_avg_sq": qv.reshape(-1)[:n].to(torch.uint8),
            "exp_avg_scale": max_m.contiguous(), "exp_avg_sq_scale": max_u.contiguous()}
