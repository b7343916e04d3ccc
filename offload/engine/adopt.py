"""engine/adopt.py: what a user put in ``opt.state`` in place of what the optimizer holds,
taken over as torch's AdamW would use it, in every tier and moment format: a replaced ``step``, a
replaced state tensor (its values are written into the state, the state's own view goes back into
``opt.state``), a whole entry moved from another parameter (swapped or rotated, as when experts or
heads are permuted: a compressed-moment entry takes the other parameter's compressed bytes), a
plain dict in place of a compressed-moment entry (encoded, as ``load_state_dict`` encodes torch's
moments), and the entry of a parameter without state yet that holds something (its state from then
on, as in torch).

``Adoption`` works in two passes. ``look`` reads and checks every changed entry and writes nothing:
a replacement must be a tensor with the parameter's number of elements (any dtype, layout or
device), may not share memory with a parameter (the step would write it while reading it), and may
not be held by two parameters at once (torch would update that one tensor once per parameter
holding it: refused by name). ``apply`` then copies every source that may view the state's own
memory (a swap reads what another write of the same pass overwrites), writes every change in one
read-change-write of the buckets involved, and puts the views back. A refused adoption changes
nothing.

Also here: a parameter given another shape (``p.data = p.data.reshape(...)``, the same elements)
has the views of its state in ``opt.state`` reshaped alike (the same memory), as torch's state
would need.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..base.dist import local
from ..moments import compressed, format as mformat
from ..moments.compressed import CompressedState
from ..params.guards import SharedMemoryError, extent
from . import export
from . import load as loader
from .registry import count_error

__all__ = ["Adoption", "follow_shapes", "missing_entry", "step_count"]


def missing_entry(key: str, where: str, t) -> Exception:
    """The error for an entry the step needs that is gone (``del opt.state[p]['exp_avg']``) or not
    a tensor, as torch's AdamW would fail on it (KeyError / TypeError), with what to do."""
    if t is None:
        return KeyError(f"{where} has no {key!r} (it was deleted or set to None): give it one "
                        "again, or clear the parameter's whole state (del opt.state[p]) to "
                        "start it afresh")
    return TypeError(f"{where}: {key!r} is a {type(t).__name__}, not a tensor")


def step_count(v, where: str) -> float:
    """The count of a ``step`` entry put in place of the optimizer's own (a one-element real
    tensor, as torch's code takes, or a plain number) if the kernel takes it (registry.py
    count_error); anything else is refused, naming ``where`` (its parameter), before it is used."""
    real = isinstance(v, torch.Tensor) and not (v.dtype == torch.bool or v.is_complex())
    if real and v.numel() == 1:
        v = v.item()
    elif v is None:
        raise missing_entry("step", f"state of {where}", v)
    if isinstance(v, torch.Tensor):
        got = f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    elif not isinstance(v, (int, float)) or isinstance(v, bool):
        got = f"{v!r} ({type(v).__name__})"
    else:
        err = count_error(float(v), where)
        if err is not None:
            raise err
        return float(v)
    raise ValueError(f"state 'step' of {where} is {got}, not a step count: give it one as a "
                     "one-element tensor (torch's is a 0-dim float32 tensor, e.g. "
                     "opt.state[p]['step'] = torch.tensor(10.0))")


def _check_replacement(t, n: int, shape, key: str, where: str, groups) -> None:
    """What torch would also accept of a tensor put in place of entry ``key`` (``n`` elements)."""
    if not isinstance(t, torch.Tensor):
        raise missing_entry(key, where, t)
    lt = local(t)
    if lt.numel() != n:
        raise ValueError(f"{where}: {key!r} has shape {tuple(lt.shape)} but the parameter has "
                         f"shape {tuple(shape)}: give it a tensor like the parameter")
    if lt.device.type != "cpu" or not n or lt.layout != torch.strided:
        return
    a = lt.data_ptr()
    e = a + extent(lt)
    for gi, params in enumerate(groups):
        for i, p in enumerate(params):
            lp = local(p)
            if lp.device.type != "cpu" or not lp.numel():
                continue
            s = lp.data_ptr()
            if a < s + lp.numel() * lp.element_size() and s < e:
                raise SharedMemoryError(
                    f"{where}: {key!r} shares memory with parameter {i} of group {gi}: the "
                    "step would write the parameter while reading its state. Give the state a "
                    f"tensor of its own (opt.state[p][{key!r}] = t.clone())")


def _span(t, name: str):
    """(start, end, name) of the host memory ``t`` covers; None: another device, empty, strided."""
    if not isinstance(t, torch.Tensor):
        return None
    lt = local(t)
    if lt.device.type != "cpu" or not lt.numel() or lt.layout != torch.strided:
        return None
    return (lt.data_ptr(), lt.data_ptr() + extent(lt), name)


def _own_step(v, steps: torch.Tensor, i: int) -> bool:
    return (isinstance(v, torch.Tensor) and v._base is steps and v.storage_offset() == i
            and v.data_ptr() == steps.data_ptr() + 4 * i)


def _external(t: torch.Tensor) -> bool:
    """``t`` lives in memory torch did not allocate for it (a view of the state's arena or state
    file, a mapping, numpy): it may be the state's own memory, which the writes change."""
    lt = local(t)
    return lt.device.type == "cpu" and not lt.untyped_storage().resizable()


class Adoption:
    """The changed entries of ``opt.state`` found in one pass (``look``), then taken over
    (``apply``). ``views``: the engine's TorchViews (engine/torchstate.py), whose per-group
    lists, tier, layout, registry, installed views (``ptrs``) and handed-out moments it reads and
    updates."""

    def __init__(self, views):
        self.v = views
        # each keyed by (gi, i), a parameter
        self.rows: list = []       # every entry looked at
        self.cleared: list = []    # the entry is gone or empty: the parameter starts afresh
        self.steps: dict = {}      # -> the replaced step count
        self.step_objs: dict = {}  # -> what replaced it (a tensor two entries may share)
        self.copies: dict = {}     # -> {key: tensor whose values the state takes}
        self.restores: dict = {}   # -> {key: the state's own view} (its values, on another device)
        self.moved: dict = {}      # -> (gj, j): it holds (gj, j)'s compressed-moment entry
        self.packed: dict = {}     # -> compressed tensors encoded from a plain dict's moments
        self.taken: list = []      # had no state; its entry in opt.state becomes its state
        self.remaster: set = set()   # taken without a 'master_param': the master is the parameter

    # ------------------------------------------------------------------ pass 1: read and check
    def look(self, gi: int, i: int, st, taking: bool = False) -> None:
        """Entry ``st`` of parameter (gi, i); ``taking``: the parameter has no state yet (never
        stepped, or restarted) and ``st`` is not empty: as in torch, its next step goes on from
        it."""
        v = self.v
        self.rows.append((gi, i))
        if not st:
            self.cleared.append((gi, i))
            return
        where = f"state of parameter {i} of group {gi}"
        s = st.get("step")
        if taking or not _own_step(s, v.registry.steps[gi], i):
            self.steps[(gi, i)] = step_count(s, f"parameter {i} of group {gi}")
            self.step_objs[(gi, i)] = s
        n = v.numels[gi][i]
        shape = local(v.groups[gi][i]).shape
        fmt = v.moment_format(gi, i)
        if fmt.compressed and n:
            if isinstance(st, CompressedState) and st.owner is v:
                if st.origin != (gi, i):
                    self.moved[(gi, i)] = st.origin
            elif isinstance(st, CompressedState):   # another engine's (a parameter that came back)
                self.packed[(gi, i)] = compressed.to_format(st.stored(), fmt, n, where)
            else:   # a plain dict: its moments are encoded, as load_state_dict encodes them
                ms = {}
                for key in mformat.MOMENT_KEYS:
                    t = st.get(key)
                    _check_replacement(t, n, shape, key, where, ())
                    ms[key] = local(t).detach().to(device="cpu", dtype=torch.float32).reshape(-1)
                try:
                    self.packed[(gi, i)] = fmt.encode(ms["exp_avg"], ms["exp_avg_sq"])
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
        keys = v.ptrs.get((gi, i), {}) if not taking else dict.fromkeys(v.entry_keys(gi, i))
        if taking:
            self.taken.append((gi, i))
            if "master_param" in keys and st.get("master_param") is None:
                del keys["master_param"]
                self.remaster.add((gi, i))
            if v.has_master(gi, i) and "master_param" not in keys and (gi, i) not in self.remaster:
                self.remaster.add((gi, i))   # an fp32 device parameter: its master is itself
        for key, ptr in keys.items():
            t = st.get(key)
            if not isinstance(t, torch.Tensor):
                raise missing_entry(key, where, t)
            lt = local(t)
            if (lt.data_ptr() == ptr and lt.dtype == torch.float32 and lt.is_contiguous()
                    and lt.numel() == n):
                continue   # the state's own memory (perhaps another view object of it)
            if not n:
                continue   # nothing to take over
            cur = v.holding(gi, i, key, t) if not taking else None
            if cur is not None:   # the same values elsewhere (Lightning's _optimizer_to_device)
                self.restores.setdefault((gi, i), {})[key] = cur
                continue
            _check_replacement(t, n, shape, key, where, v.local_groups)
            self.copies.setdefault((gi, i), {})[key] = t

    def check_shared(self) -> None:
        """Refuse a tensor (or a compressed entry, or a step counter) that two parameters' entries
        hold, as torch would update it once for each of them: nothing has changed yet."""
        if not (self.copies or self.moved
                or any(isinstance(s, torch.Tensor) for s in self.step_objs.values())):
            return
        v, gone = self.v, set(self.cleared)
        spans = []
        for (gi, i), keys in v.ptrs.items():   # the state's own views that stay in opt.state
            if (gi, i) in gone:
                continue
            for key, ptr in keys.items():
                if key in self.copies.get((gi, i), ()) or key in self.restores.get((gi, i), ()):
                    continue
                if v.numels[gi][i]:
                    spans.append((ptr, ptr + 4 * v.numels[gi][i], _name(key, gi, i)))
        for (gi, i), keys in self.copies.items():
            spans += [sp for k, t in keys.items() if (sp := _span(t, _name(k, gi, i)))]
        for gi, steps in enumerate(v.registry.steps):
            for i in range(len(v.groups[gi])):
                if (gi, i) in self.steps or (gi, i) in gone or not v.registry.ready[gi][i]:
                    continue
                a = steps.data_ptr() + 4 * i
                spans.append((a, a + 4, _name("step", gi, i)))
        for (gi, i), s in self.step_objs.items():
            sp = _span(s, _name("step", gi, i))
            spans += [sp] if sp else []
        spans.sort()
        for (s0, e0, a), (s1, _e1, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise _shared(b, a)
        kept = {(gi, int(i)) for gi, ready in enumerate(v.registry.ready)
                for i in np.flatnonzero(ready)}
        kept -= gone | set(self.moved) | set(self.packed)
        seen: dict = {}
        for dst, src in self.moved.items():
            other = seen.setdefault(src, dst)
            if other != dst or src in kept:
                b = other if other != dst else src
                raise _shared(f"the state of parameter {dst[1]} of group {dst[0]}",
                              f"the state of parameter {b[1]} of group {b[0]}")

    # ------------------------------------------------------------------ pass 2: write
    def apply(self, state) -> None:
        v = self.v
        for gi, i in self.cleared:
            v.handouts.forget(gi, i)
        # held copies of the state a caller wrote in place: into the state first (a moved entry
        # takes them along)
        v.handouts.adopt(v.held_current, v.rewrite_held)
        if not (self.cleared or self.steps or self.copies or self.restores or self.moved
                or self.packed or self.taken):
            return   # (every warm step; entries looked at every step, DTensors', unchanged)
        view, fd = v.tier.mapping()
        packed = dict(self.packed)
        for dst, (gj, j) in self.moved.items():   # the compressed bytes copied before any write
            packed[dst] = compressed.raw(v.layout, gj, j, v.moment_format(gj, j), view)
        flat = self._sources()
        if flat or packed or self.remaster:
            loader.write_entries(v.layout, v.tier, flat, packed, self.remaster, v.read_master)
            view, fd = v.tier.mapping()
        self._views_back(state, view, fd)

    def _sources(self) -> dict:
        """(gi, i) -> {key: flat tensor} of the replacements, those that may view the state's
        memory copied first (into file-backed memory in the state directory for a tier on disk)."""
        v = self.v
        need = [t for keys in self.copies.values() for t in keys.values() if _external(t)]
        sink = export.DecodedSink(getattr(v.tier, "directory", None),
                                  sum(local(t).numel() for t in need)) if need else None
        out = {}
        for row, keys in self.copies.items():
            out[row] = {}
            for key, t in keys.items():
                lt = local(t).detach()
                if _external(t):
                    out[row][key] = sink.take(lt.numel()).copy_(lt.reshape(-1))
                else:
                    out[row][key] = lt.reshape(-1)
        return out

    def _views_back(self, state, view, fd) -> None:
        """The step counts, and the state's views in place of what was replaced; moved compressed
        entries bound to their new parameter, plain dicts of compressed moments made entries."""
        v = self.v
        reg = v.registry
        for gi, i in self.cleared:
            reg.ready[gi][i] = False
            reg.steps[gi][i] = 0.0
            v.ptrs.pop((gi, i), None)
        for (gi, i), val in self.steps.items():
            reg.steps[gi][i] = val
        for gi, i in self.taken:
            reg.ready[gi][i] = True
            v.tracker.record(gi, [i])   # its master (given or read) is the truth for the parameter
            v.ptrs[(gi, i)] = {}
        for gi, i in self.rows:
            if (gi, i) in self.cleared:
                continue
            st = state[v.groups[gi][i]]
            if (gi, i) in self.steps:
                st["step"] = reg.steps[gi][i]
            if (gi, i) in self.copies or (gi, i) in self.taken:
                fresh = v.entry_views(gi, i, view, fd)
                for key in (fresh if (gi, i) in self.taken else self.copies[(gi, i)]):
                    st[key] = fresh[key]
                    v.ptrs[(gi, i)][key] = local(fresh[key]).data_ptr()
            for key, cur in self.restores.get((gi, i), {}).items():
                st[key] = cur
                v.ptrs[(gi, i)][key] = local(cur).data_ptr()
        v.handouts.remap(self.moved, set(self.packed))
        for gi, i in self.moved:
            v.bind(state[v.groups[gi][i]], gi, i)
        for gi, i in self.packed:
            p = v.groups[gi][i]
            st = state[p]
            base = st.plain() if isinstance(st, CompressedState) else dict(st)
            for key in mformat.MOMENT_KEYS:
                base.pop(key, None)
            state[p] = v.compressed_entry(gi, i, base)


def _name(key: str, gi: int, i: int) -> str:
    return f"state[{key!r}] of parameter {i} of group {gi}"


def _shared(a: str, b: str) -> Exception:
    return SharedMemoryError(
        f"{a} holds the same memory as {b}: torch would update it once for each parameter "
        "that holds it, which the optimizer's state cannot do. Give each parameter a state of its "
        "own (e.g. t.clone())")


def follow_shapes(params: Sequence[torch.Tensor], rows, ready, state,
                  keys: Callable[[int], object], forget: Callable[[int], None]) -> None:
    """Rows ``rows`` of a group (``params``) were revalidated: those with state (``ready``) whose
    views (the entries ``keys(i)`` of ``state[p]``) no longer have the parameter's shape are
    reshaped; ``forget(i)``: the entry changed, look at it again."""
    for i in rows:
        p = params[i]
        if not ready[i] or type(p) not in (torch.Tensor, torch.nn.Parameter):
            continue
        st = state.get(p)
        inner = st.live if isinstance(st, CompressedState) else st
        for key in keys(i):
            t = inner.get(key) if inner else None
            if isinstance(t, torch.Tensor) and t.shape != p.shape and t.numel() == p.numel():
                inner[key] = t.view(p.shape)
                forget(i)
