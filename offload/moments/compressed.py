"""moments/compressed.py: the torch-layout views of compressed moments in the state engine.

A parameter whose bucket stores its moments compressed (a format whose ``compressed`` is set,
"bf16" or "8bit": offload/moments/format.py) has no fp32 ``exp_avg``/``exp_avg_sq`` bytes
anywhere. This module:

* reads its compressed tensors out of the tier (``raw``: copies joined over the pieces of a split
  parameter; blocks never straddle pieces, see offload/state/layout.py),
* decodes them to fp32 for ``opt.state`` / ``state_dict()`` (:class:`CompressedState`: decoded on
  every access into a fresh tensor, which the engine keeps in step with the state while the caller
  holds it: moments/handouts.py),
* turns whatever ``load_state_dict`` receives (torch's fp32/bf16 moments, or compressed tensors
  ``<key>.<format>`` of this or another format) into the bytes of the parameter's format.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Dict, Optional

import torch

from ..moments import format as mformat
from ..moments.format import MomentFormat
from ..base.dist import local

__all__ = ["CompressedState", "bitwise_equal", "raw", "to_format", "write_piece"]


def bitwise_equal(a, b: torch.Tensor) -> bool:
    """``a`` is a tensor with ``b``'s shape, dtype and bytes (on any device; NaN payloads and -0
    count)."""
    if not isinstance(a, torch.Tensor):
        return False
    a, b = local(a), local(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    flat = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)   # noqa: E731
    return torch.equal(flat(a.to(b.device)), flat(b))


def raw(layout, gi: int, i: int, fmt: MomentFormat, mapping) -> Dict[str, torch.Tensor]:
    """{kernel key: flat tensor} of parameter ``i`` of group ``gi`` (copies, in the tier's
    dtype)."""
    entries = layout.of_param.get((gi, i), [])
    out = {}
    for s in fmt.sections:
        parts = []
        for bi, pc in entries:
            b = layout.buckets[bi]
            off, nb = b.span(s.key, pc)
            parts.append(mapping(b.offset + off, nb))
        flat = torch.cat(parts) if len(parts) != 1 else parts[0].clone()
        out[s.key] = flat.view(s.dtype)
    return out


def write_piece(b, pc, data: torch.Tensor, src: Dict[str, torch.Tensor], keys=None) -> None:
    """Copy piece ``pc``'s part of the parameter-level flat compressed tensors ``src`` into bucket
    bytes (only the sections ``keys``, when given)."""
    fmt = b.moments
    for s in fmt.sections:
        if keys is not None and s.key not in keys:
            continue
        off, nb = b.span(s.key, pc)
        lo = pc.start // mformat.BLOCK if s.per_block else pc.start
        cnt = fmt.entries(s.key, pc.n)
        part = src[s.key].reshape(-1)[lo:lo + cnt]
        data[off:off + nb].copy_(part.contiguous().view(torch.uint8))


def to_format(st: dict, fmt: MomentFormat, numel: int, where: str) -> Dict[str, torch.Tensor]:
    """The flat compressed tensors of format ``fmt`` for a loaded state ``st``: taken as they are
    (``<key>.fmt``), converted from another compressed format, or encoded from torch's moments."""
    saved: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, t in st.items():
        parsed = mformat.parse_saved_key(k)
        if parsed is not None and isinstance(t, torch.Tensor):
            saved.setdefault(parsed[1], {})[parsed[0]] = local(t).detach().reshape(-1)
    if len(saved) > 1:
        raise ValueError(f"{where} holds compressed moments of several formats "
                         f"({sorted(saved)}): corrupted")
    if saved:
        (name, tensors), = saved.items()
        sfmt = mformat.moment_format(name)
        for k, (dt, cnt) in sfmt.spec(numel).items():
            t = tensors.get(k)
            if t is None or t.dtype != dt or t.numel() != cnt:
                raise ValueError(f"{where}: '{sfmt.saved_key(k)}' must be a {dt} tensor of {cnt} "
                                 f"entries for a parameter of {numel} elements, got "
                                 f"{None if t is None else (t.dtype, t.numel())}")
        sfmt.check_values(tensors, where)
        if sfmt is fmt:
            return tensors
        m, v = sfmt.decode(tensors)
    else:
        for k in mformat.MOMENT_KEYS:
            t = st.get(k)
            if not isinstance(t, torch.Tensor):
                raise KeyError(f"{where} has no '{k}'")
            if local(t).numel() != numel:
                raise ValueError(f"state '{k}' of {where} does not match the parameter's "
                                 f"{numel} elements")
        m, v = local(st["exp_avg"]), local(st["exp_avg_sq"])
    return fmt.encode(m, v)


class CompressedState(MutableMapping):
    """``opt.state[p]`` of a parameter with compressed moments.

    ``step`` and ``master_param`` are the live objects (as with fp32 moments); ``exp_avg`` and
    ``exp_avg_sq`` are decoded to fp32 on every access (a fresh tensor shaped like the parameter:
    reading costs one decode of the parameter's moments). Each one is handed to ``watch(key,
    tensor)``, through which the engine adopts in-place writes into it before the next step or read
    of the state and refreshes it after each step while the caller holds it (moments/handouts.py),
    as torch's live state tensors behave. Assigning or deleting a moment is refused (use
    ``load_state_dict``), except assigning a tensor that holds exactly the decoded values
    (frameworks that move every state tensor to the model's device do that): the state stays where
    it is.
    """

    def __init__(self, base: dict, decode: Optional[Callable[[], Dict[str, torch.Tensor]]],
                 fmt: MomentFormat, watch: Optional[Callable[[str, torch.Tensor], None]] = None):
        self._d = dict(base)
        self.moments = fmt
        self.bind(decode, watch)

    def bind(self, decode, watch=None, owner=None, origin=None, stored=None) -> None:
        """Whose moments this entry holds: ``decode()`` reads them, ``watch`` hears of each one
        handed out, ``stored()`` gives copies of them compressed (``{'<key>.<format>': tensor}``,
        as offload.save writes them); ``owner`` and ``origin`` say which state engine and parameter
        (an entry moved to another parameter in ``opt.state`` is bound to it by the engine:
        engine/adopt.py)."""
        self._decode, self._watch, self._stored = decode, watch, stored
        self.owner, self.origin = owner, origin

    def stored(self) -> Dict[str, torch.Tensor]:
        """The compressed moments, copied, under their saved keys (``exp_avg.8bit``, ...)."""
        return self._stored()

    def detach(self, shape) -> None:
        """Hold copies of the moments from here on: the parameter left the state engine (removed
        from its param group) and keeps this entry, as torch's state keeps it, for its return."""
        frozen = self.stored()
        raw = {mformat.parse_saved_key(k)[0]: t for k, t in frozen.items()}
        fmt = self.moments

        def decode():
            m, v = fmt.decode(raw)
            return {"exp_avg": m.view(shape), "exp_avg_sq": v.view(shape)}
        self.bind(decode, stored=lambda: {k: t.clone() for k, t in frozen.items()})

    def plain(self) -> dict:
        """The entries that need no decoding (step, master_param, user additions)."""
        return dict(self._d)

    @property
    def live(self) -> dict:
        """The dict that holds those entries itself (the state engine's per-step check reads
        it)."""
        return self._d

    def __getitem__(self, key):
        if key in mformat.MOMENT_KEYS:
            t = self._decode()[key]
            if self._watch is not None:
                self._watch(key, t)
            return t
        return self._d[key]

    def __setitem__(self, key, value) -> None:
        if key in mformat.MOMENT_KEYS:
            if bitwise_equal(value, self._decode()[key]):
                # its own values back, e.g. Lightning's _optimizer_to_device (v[k] =
                # v[k].to(device))
                return
            raise ValueError(f"state[{key!r}] of a parameter with moments="
                             f"{self.moments.name!r} is decoded from the compressed state on each "
                             "access and cannot be replaced; load a whole state with "
                             "load_state_dict() (it re-quantizes torch's fp32 moments)")
        self._d[key] = value

    def __delitem__(self, key) -> None:
        if key in mformat.MOMENT_KEYS:
            raise ValueError(f"state[{key!r}] of a parameter with moments="
                             f"{self.moments.name!r} cannot be deleted; del opt.state[p] (or "
                             "opt.state[p] = {}) restarts the parameter's state")
        del self._d[key]

    def __iter__(self):
        yield from (k for k in self._d if k == "step")
        yield from mformat.MOMENT_KEYS
        yield from (k for k in self._d if k != "step")

    def __len__(self) -> int:
        return len(self._d) + len(mformat.MOMENT_KEYS)

    def __contains__(self, key) -> bool:
        return key in mformat.MOMENT_KEYS or key in self._d

    def __repr__(self) -> str:
        return f"CompressedState(moments={self.moments.name!r}, keys={list(self)})"
