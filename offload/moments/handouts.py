"""moments/handouts.py: the decoded moment tensors that ``opt.state[p]['exp_avg']`` /
``['exp_avg_sq']`` hand out for compressed moments (moments/compressed.py CompressedState), kept to
the semantics of torch's live state tensors for as long as the caller holds one:

* an in-place write into it (``.zero_()``, ``[mask] = 0``, ``.mul_()``, even through ``.data`` or
  numpy) is adopted before the next step or the next read of the state (``opt.state[p][key]``,
  ``state_dict()``, ``offload.save``): the written moment is re-encoded into the state (quantized
  like any state the format stores, as ``load_state_dict`` would);
* after each step it holds the new moments.

The same holds for the fp32 state tensors of ``opt.state`` that cannot be views of the tier (a
parameter split over buckets in pieces of under a page per section, with a tiny ``host_budget``):
they are copies, held here so that they behave as views (engine/torchstate.py ``entry_views``).

Held tensors are found through weak references, so this costs nothing when none is alive (the usual
case: a moment read and dropped). While one is held, a GPU-offload step that overlaps the next
forward (stepping during backward) waits for its last bucket before ``step()`` returns, so that the
refresh on the CPU worker cannot race with the caller's next write. Per held tensor, each step
costs one decode and compare before the update and one decode and copy after it. Writes are found
by comparing bytes with the state, not by version counters, which ``.data`` and numpy writes do not
bump.

:class:`Handouts` is the registry (one per engine, held by engine/torchstate.py TorchViews);
:func:`write_moments` re-encodes a written moment into the parameter's buckets.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict

import torch

from ..moments.format import MomentFormat
from ..base.dist import local
from . import compressed
from .compressed import bitwise_equal

__all__ = ["Handouts", "write_moments"]


class Handouts:
    def __init__(self):
        # (gi, i, key) -> weak references to the tensors handed out
        self._held: Dict[tuple, list] = {}
        # watch() runs on the caller's thread after a read, refresh() on the CPU worker at the end
        # of an overlapped step: the registry itself is guarded so that no reference is lost
        # between them
        self._mu = threading.Lock()

    def watch(self, gi: int, i: int, key: str, t: torch.Tensor) -> None:
        with self._mu:
            self._held.setdefault((gi, i, key), []).append(weakref.ref(t))

    def forget(self, gi: int, i: int) -> None:
        """Parameter (gi, i)'s state was replaced or restarted: what it handed out before is no
        longer its state (as torch's old state tensors after ``del opt.state[p]`` or
        ``load_state_dict``)."""
        with self._mu:
            for key in [k for k in self._held if k[:2] == (gi, i)]:
                del self._held[key]

    def remap(self, moved: dict, replaced) -> None:
        """Whole entries moved between parameters (``moved``: {to (gi, i): from (gj, j)}): what
        each handed out goes with it, as torch's tensors go with their dict; what the entries of
        ``moved``'s keys and of ``replaced`` handed out before is no parameter's state now."""
        if not moved and not replaced:
            return
        with self._mu:
            gone = set(moved) | set(replaced)
            dest = {src: dst for dst, src in moved.items()}
            held = {}
            for (gi, i, key), refs in self._held.items():
                if (gi, i) in dest:
                    held[dest[(gi, i)] + (key,)] = refs
                elif (gi, i) not in gone:
                    held[(gi, i, key)] = refs
            self._held = held

    def empty(self) -> bool:
        """Nothing handed out is watched (not even a tensor dropped since the last step)."""
        return not self._held

    def any_alive(self) -> bool:
        return bool(self._held) and bool(self._alive())

    def clear(self) -> None:
        with self._mu:
            self._held.clear()

    def _alive(self) -> Dict[tuple, Dict[str, list]]:
        """{(gi, i): {key: [tensors]}} of the tensors still held; the dead references are
        dropped."""
        out: Dict[tuple, Dict[str, list]] = {}
        with self._mu:
            for k, refs in list(self._held.items()):
                ts = [t for t in (r() for r in refs) if t is not None]
                if not ts:
                    del self._held[k]
                    continue
                self._held[k] = [weakref.ref(t) for t in ts]
                out.setdefault(k[:2], {})[k[2]] = ts
        return out

    def adopt(self, decoded: Callable[[int, int], dict],
              write: Callable[[int, int, dict, dict], None], only=None) -> None:
        """Before a step or a read of the state: ``write(gi, i, {key: tensor}, current)`` the
        moments a caller changed in place (``current``: the state's decoded moments); ``only``: of
        that (gi, i). Two held tensors of one moment written with different values are refused by
        name: which one the state should take is not defined."""
        for (gi, i), keys in self._alive().items():
            if only is not None and (gi, i) != only:
                continue
            cur = decoded(gi, i)
            new = {}
            for key, ts in keys.items():
                changed = [t for t in ts if not bitwise_equal(t, cur[key])]
                if not changed:
                    continue
                bad = [t for t in changed if local(t).shape != local(cur[key]).shape]
                if bad:
                    raise ValueError(f"state[{key!r}] of parameter {i} of group {gi} was resized "
                                     f"in place to {tuple(local(bad[0]).shape)}; the parameter "
                                     f"has shape {tuple(local(cur[key]).shape)}")
                if any(not bitwise_equal(t, changed[0]) for t in changed[1:]):
                    raise ValueError(
                        f"state[{key!r}] of parameter {i} of group {gi}: {len(changed)} tensors "
                        "read from opt.state were written in place with different values; each "
                        "read is its own copy here, so the state cannot take both (write one of "
                        "them, or load a state with load_state_dict())")
                new[key] = changed[0]
            if new:
                write(gi, i, new, cur)

    def refresh(self, decoded: Callable[[int, int], dict]) -> None:
        """After a step: every held tensor takes its moment's new values."""
        for (gi, i), keys in self._alive().items():
            cur = decoded(gi, i)
            for key, ts in keys.items():
                for t in ts:
                    local(t).copy_(local(cur[key]))


def write_moments(layout, fmt: MomentFormat, gi: int, i: int, new: dict, cur: dict,
                  rewrite: Callable) -> None:
    """Re-encode the moments ``new`` ({key: tensor shaped like the parameter}) of compressed-moment
    parameter (gi, i) (stored in ``fmt``) into its buckets, leaving its other moment as it is
    (``cur``: both, decoded); ``rewrite(hits, apply)`` reads, changes and writes back the buckets
    (engine/load.py)."""
    flat = lambda t: local(t).detach().to(  # noqa: E731
        device="cpu", dtype=torch.float32).reshape(-1)
    try:   # validates (e.g. a negative exp_avg_sq) before the tier is touched
        conv = fmt.encode(*(flat(new.get(k, cur[k])) for k in ("exp_avg", "exp_avg_sq")))
    except ValueError as e:
        raise ValueError(f"state {sorted(new)} of parameter {i} of group {gi}, written in place "
                         f"through opt.state: {e}") from None
    keys = {k for mk in new for k in fmt.keys_of(mk)}
    hits: dict = {}
    for bi, pc in layout.of_param.get((gi, i), []):
        hits.setdefault(bi, []).append(pc)

    def apply(b, pieces, blk):
        for pc in pieces:
            compressed.write_piece(b, pc, blk.data, conv, keys)
    rewrite(hits, apply)
