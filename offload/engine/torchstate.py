"""engine/torchstate.py: TorchViews, the state in torch's layout: ``opt.state`` views
(installed when a parameter's state is created), the user's edits of ``opt.state`` honoured as torch
would, ``state_dict`` tensors, and (through engine/load.py) ``load_state_dict`` and re-read masters.

The engine (engine/engine.py) builds one and passes it what it reads: the layout, tier, registry,
parameter lists, the handed-out decoded moments (moments/handouts.py), the moment format of each
parameter and ``exclusive`` (the engine's lock). Tensors are views of the tier (engine/views.py),
never copies, and keep their memory alive.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from ..native.rows import state_rows
from ..params.base import resized
from ..moments import format as mformat
from ..base.dist import like, local
from ..base.dtypes import LOW_PRECISION, STATE_KEYS as _KEYS
from ..moments import compressed
from . import export
from . import load as loader
from .adopt import Adoption, follow_shapes
from ..moments.handouts import Handouts, write_moments
from .views import param_views

__all__ = ["TorchViews"]

# what the per-step check of opt.state compares (csrc/rows.cpp state_rows): these entries of each
# parameter's state, by identity, and the data pointers of the tensors among them
_SKIP = object()   # an entry the check does not look at
STATE_FNS = ((getattr(torch._C, "TensorBase", None) or torch._C._TensorBase).__dict__["data_ptr"], _SKIP)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _on_another_device(t, cur) -> bool:
    """``t`` lives on another device than the state view ``cur`` (a seam for the CPU-only tests)."""
    return isinstance(t, torch.Tensor) and local(t).device != local(cur).device


class _StateRecords:
    """Per group: what each parameter's opt.state entry was last validated as (state_rows' input)."""

    def __init__(self, n: int):
        self.objs: list = [None] * n  # (outer, inner, entry per _KEYS) or None
        self.ptrs = np.full((n, len(_KEYS)), -1, dtype=np.int64)
        self.hashes = np.full(n, -1, dtype=np.int64)  # hash(parameter): looked up without __hash__


class TorchViews:
    def __init__(self, layout, tier, registry, groups: list, handouts: Handouts, *, local_groups: list,
                 numels: list, amsgrad: list, moment_format: Callable, all_masters: bool,
                 mode: str, tracker, exclusive: Callable, read_master: Callable):
        """``groups``, ``local_groups``, ``numels``, ``amsgrad``: the engine's per-group lists (they grow
        in place with add_param_group); ``all_masters``: every parameter has an fp32 master (device
        parameters: params/side.py); ``exclusive(failed_ok=False)``: the engine's lock."""
        self.layout, self.tier, self.registry, self.groups, self.handouts = layout, tier, registry, groups, handouts
        self.local_groups, self.numels, self.amsgrad = local_groups, numels, amsgrad
        self.moment_format, self.all_masters, self.mode = moment_format, all_masters, mode
        self.tracker, self.exclusive, self.read_master = tracker, exclusive, read_master
        self.ptrs: dict = {}    # (gi, i) -> {key: data_ptr} of the views installed in opt.state
        self.recs: list = []    # per group: _StateRecords (what state_rows compares with)
        self._placed_masks: dict = {}   # gi -> (layout size, mask): see _placed

    # ------------------------------------------------------------------ torch-layout views
    def install(self, fresh: list, state: dict) -> None:
        """Give ``state[p]`` its step counter and moments (views of the tier) when its state was
        created. Runs at the end of every step (both schedules): the decoded moments a caller holds
        take the step's new values here."""
        self.handouts.refresh(self.held_current)
        if not fresh:
            return
        view, fd = self.tier.mapping()
        ptrs = self.ptrs
        for gi, i in fresh:
            self._forget_state(gi, int(i))
            p = self.groups[gi][int(i)]
            st = state[p]
            st["step"] = self.registry.steps[gi][int(i)]
            views = self.entry_views(gi, int(i), view, fd)
            for k, v in views.items():
                st[k] = v
            ptrs[(gi, int(i))] = {k: local(v).data_ptr() for k, v in views.items()}
            if self.moment_format(gi, int(i)).compressed:   # moments decoded on access
                state[p] = self.compressed_entry(gi, int(i), st)

    def compressed_entry(self, gi: int, i: int, base: dict):
        return self.bind(compressed.CompressedState(base, None, self.moment_format(gi, i)), gi, i)

    def bind(self, st, gi: int, i: int):
        """Make the compressed-moment entry ``st`` that of parameter (gi, i) (also one moved there
        from another parameter): it decodes (gi, i)'s moments and hands them out as (gi, i)'s."""
        def decode():
            return self._decoded(gi, i)

        def watch(key, t):
            self.handouts.watch(gi, i, key, t)
        st.bind(decode, watch, owner=self, origin=(gi, i), stored=lambda: self.stored_entry(gi, i))
        return st

    def stored_entry(self, gi: int, i: int) -> dict:
        """Parameter (gi, i)'s compressed moments, copied, under their saved keys
        (``exp_avg.8bit``, ...): what its ``opt.state`` entry holds, held decoded moments' in-place
        writes first."""
        with self.exclusive():
            self.handouts.adopt(self.held_current, self.rewrite_held, only=(gi, i))
            view, _fd = self.tier.mapping()
            fmt = self.moment_format(gi, i)
            raw = compressed.raw(self.layout, gi, i, fmt, view)
            return {fmt.saved_key(k): t for k, t in raw.items()}

    def _rewrite(self, hits: dict, apply) -> None:
        loader.rewrite_buckets(self.layout, self.tier, hits, apply)

    def rewrite_moments(self, gi: int, i: int, new: dict, cur: dict) -> None:
        write_moments(self.layout, self.moment_format(gi, i), gi, i, new, cur, self._rewrite)

    def entry_views(self, gi: int, i: int, view, fd) -> dict:
        """views_of for an opt.state entry. A tensor that had to be joined by a copy (a parameter
        split over buckets in pieces of under a page per section: a tiny host_budget) is held as
        decoded moments are (moments/handouts.py): in-place writes into it are taken into the state
        and it takes the state's values after each step, as a view would."""
        copied: set = set()
        views = self.views_of(gi, i, view, fd, copied)
        for key in copied & set(views):
            self.handouts.watch(gi, i, key, views[key])
        return views

    def held_current(self, gi: int, i: int) -> dict:
        """What a held copy of parameter (gi, i)'s state holds when unwritten: its fp32 tensors and
        its decoded compressed moments."""
        with self.exclusive():
            view, fd = self.tier.mapping()
            out = self.views_of(gi, i, view, fd)
            if self.moment_format(gi, i).compressed and self.numels[gi][i]:
                out.update(self.decode_current(gi, i, view=view))
            return out

    def rewrite_held(self, gi: int, i: int, new: dict, cur: dict) -> None:
        """Write into the state what a caller wrote into held copies (``new``: {key: tensor};
        ``cur``: held_current's)."""
        packed = self.moment_format(gi, i).compressed
        moments = {k: t for k, t in new.items() if packed and k in mformat.MOMENT_KEYS}
        if moments:
            self.rewrite_moments(gi, i, moments, cur)
        flat = {k: local(t).detach().reshape(-1) for k, t in new.items() if k not in moments}
        if flat:
            loader.write_entries(self.layout, self.tier, {(gi, i): flat})

    def holds_moment_copies(self) -> bool:
        """A caller holds decoded compressed moments from opt.state (moments/handouts.py)."""
        return self.handouts.any_alive()

    def _decoded(self, gi: int, i: int, sink=None, view=None) -> dict:
        """fp32 exp_avg / exp_avg_sq (shaped like the parameter) of a compressed-moment parameter,
        fresh tensors, or decoded into ``sink`` (engine/export.py) chunk by chunk. ``view``: the
        tier's mapping when the caller (a loop over every parameter, under the lock) already holds
        one. In-place writes into this parameter's held decoded moments are adopted first (as
        torch's state would show them)."""
        with self.exclusive():
            self.handouts.adopt(self.held_current, self.rewrite_held, only=(gi, i))
            return self.decode_current(gi, i, sink, view)

    def decode_current(self, gi: int, i: int, sink=None, view=None) -> dict:
        """_decoded without adopting held writes: the state as its buckets hold it."""
        self._check_size(gi, i, local(self.groups[gi][i]))
        with self.exclusive():
            if view is None:
                view, _fd = self.tier.mapping()   # NVMe: drains the write-backs and maps the file
            fmt = self.moment_format(gi, i)
            raw = compressed.raw(self.layout, gi, i, fmt, view)
            if sink is None:
                m, v = fmt.decode(raw)
            else:
                m, v = export.decode_into(raw, fmt, self.numels[gi][i], sink)
        p = self.groups[gi][i]
        shape = local(p).shape
        return {"exp_avg": like(p, m.view(shape)), "exp_avg_sq": like(p, v.view(shape))}

    def raw_state_tensors(self) -> dict:
        """(gi, i) -> {key: tensor} in the stored form: fp32 views (master, fp32 moments) and, for
        compressed moments, copies of the compressed tensors under ``<key>.<format>`` (offload.save)."""
        with self.exclusive():
            self.handouts.adopt(self.held_current, self.rewrite_held)   # held writes first
            view, fd = self.tier.mapping()
            out = {}
            for gi, params in enumerate(self.groups):
                for i in range(len(params)):
                    if not (self.registry.ready[gi][i] or self.numels[gi][i] == 0):
                        continue
                    fmt = self.moment_format(gi, i)
                    st = self.views_of(gi, i, view, fd)
                    if fmt.compressed and self.numels[gi][i]:
                        shape = local(params[i]).shape
                        for k, t in compressed.raw(self.layout, gi, i, fmt, view).items():
                            st[fmt.saved_key(k)] = t.view(shape) if not fmt.per_block(k) else t
                    out[(gi, i)] = st
            return out

    def adopt_user_state(self, state: dict, only=None) -> None:
        """What a user did to ``opt.state`` since the last step, as torch honours it
        (engine/adopt.py): a replaced ``step`` or state tensor is taken over (its values written
        into the state, the state's view back in its place), whole entries moved between
        parameters go with them, a removed or emptied ``state[p]`` (``opt.state.clear()``, ``del
        opt.state[p]``) starts that parameter afresh at step 0, and the entry of a parameter
        without state yet that holds something is its state from then on. Every changed entry is
        read and checked before any is written.
        ``only``: {(gi, i)}, the entries of those parameters alone (laid out late, during a step).

        Each parameter's entry is recorded once validated; each step only the entries that are not
        the recorded objects, or whose tensors moved (``.data = ...``), are looked at again
        (``state_rows`` of offload/native/rows.py, natively). The records go with any change the engine makes itself."""
        recs = self.recs
        fast = type(state) is dict or type(state) is defaultdict   # their .get is the C lookup state_rows does
        todo = Adoption(self)
        for gi, ps in enumerate(self.groups):
            ready = self.registry.ready[gi]
            while len(recs) <= gi:
                recs.append(_StateRecords(len(self.groups[len(recs)])))
            rec = recs[gi]
            if len(rec.objs) != len(ps):
                rec = recs[gi] = _StateRecords(len(ps))
            if only is not None:
                rows = [i for g, i in only if g == gi and ready[i]]
            elif fast:
                rows = state_rows(state, ps, ready, rec.objs, _KEYS, rec.ptrs, STATE_FNS, rec.hashes).tolist()
            else:
                rows = np.flatnonzero(ready).tolist()
            for i in rows:
                rec.objs[i] = None
                todo.look(gi, i, state.get(ps[i]))
            # parameters with room for state but none yet, whose entry holds something: taken over
            idle = ~ready & self._placed(gi)
            for i in np.flatnonzero(idle).tolist() if idle.any() else ():
                st = state.get(ps[i])
                if st and (only is None or (gi, i) in only):
                    todo.look(gi, i, st, taking=True)
        todo.check_shared()
        self.registry.check(lambda gi, i: f"parameter {i} of group {gi}")   # also written in place
        todo.apply(state)
        for gi, i in todo.rows:
            st = state.get(self.groups[gi][i])
            if st:
                self._record_state(recs[gi], i, self.groups[gi][i], st, self.ptrs.get((gi, i), {}))

    def _placed(self, gi: int) -> np.ndarray:
        """Bool mask of group gi's parameters with room for state in the layout (cached)."""
        key = (len(self.layout.buckets), len(self.layout.of_param), len(self.groups[gi]))
        got = self._placed_masks.get(gi)
        if got is None or got[0] != key:
            of, n = self.layout.of_param, len(self.groups[gi])
            mask = np.array([bool(of.get((gi, i))) for i in range(n)], dtype=bool)
            got = self._placed_masks[gi] = (key, mask)
        return got[1]

    def _check_size(self, gi: int, i: int, lp) -> None:
        if lp.numel() != self.numels[gi][i]:   # (p.data = a tensor of another size)
            raise resized(gi, i, self.numels[gi][i], lp.numel(), self.mode)

    def entry_keys(self, gi: int, i: int) -> list:
        """The state tensors ``opt.state`` shows for parameter (gi, i) as views of its buckets."""
        lp = local(self.groups[gi][i])
        shown = self.has_master(gi, i) and not (self.all_masters and lp.dtype == torch.float32)
        keys = ["master_param"] if shown else []
        if not self.moment_format(gi, i).compressed:
            keys += ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad[gi] else [])
        return keys

    def has_master(self, gi: int, i: int) -> bool:
        """Parameter (gi, i)'s buckets hold an fp32 master (device parameters, bf16/fp16 ones)."""
        return self.all_masters or local(self.groups[gi][i]).dtype in LOW_PRECISION

    def follow_shapes(self, state: dict, revalidated) -> None:
        """Parameters the side revalidated this step (``revalidated``: (group, rows)) that were
        given another shape: their views follow (engine/adopt.py)."""
        for gi, idx in revalidated:
            follow_shapes(self.groups[gi], idx, self.registry.ready[gi], state,
                          lambda i, gi=gi: self.ptrs.get((gi, i), ()),
                          lambda i, gi=gi: self._forget_state(gi, i))

    def holding(self, gi: int, i: int, key: str, t):
        """The view of the state entry ``key`` of parameter (gi, i) if ``t``, which replaced it, is
        a copy of it on another device (a framework moving every state tensor to the model's
        device, e.g. Lightning's _optimizer_to_device on a GPU: the state stays in its tier and the
        view goes back in), else None: a replacement on the state's own device has its values taken
        over (the user may go on writing into it, and it would not be the state)."""
        view, fd = self.tier.mapping()
        cur = self.entry_views(gi, i, view, fd).get(key)
        if cur is None or not _on_another_device(t, cur):
            return None
        return cur if compressed.bitwise_equal(t, cur) else None

    def _record_state(self, rec: "_StateRecords", i: int, p, st, ptrs: dict) -> None:
        """Record state[p] (just validated by adopt_user_state) for state_rows to compare with."""
        if type(p) not in _PLAIN:
            return   # a DTensor's entries are DTensors (local() needed): checked in Python every step
        inner = st.live if isinstance(st, compressed.CompressedState) else st if type(st) is dict else None
        if inner is None:
            return
        objs = []
        for j, key in enumerate(_KEYS):
            if key != "step" and key not in ptrs:
                objs.append(_SKIP)
                continue
            t = inner.get(key)
            objs.append(t)
            if type(t) in _PLAIN:
                rec.ptrs[i, j] = t.data_ptr()
            elif t is not None and isinstance(t, torch.Tensor):
                return   # another tensor type: Python every step
            else:
                rec.ptrs[i, j] = -1
        rec.objs[i] = (st, inner, *objs)
        rec.hashes[i] = hash(p)

    def _forget_state(self, gi: int, i: int) -> None:
        """The engine replaced the entries of parameter i of group gi: look at them again next step."""
        recs = self.recs
        if gi < len(recs) and i < len(recs[gi].objs):
            recs[gi].objs[i] = None

    def views_of(self, gi: int, i: int, view, fd, copied=None) -> dict:
        """{key: tensor} of parameter (gi, i)'s fp32 state, views of the tier (``copied``: gets the
        keys joined by a copy, engine/views.py)."""
        p = self.groups[gi][i]
        lp = local(p)
        self._check_size(gi, i, lp)
        if lp.numel() == 0:
            keys = (["master_param"] if (self.all_masters or lp.dtype in LOW_PRECISION)
                    else []) + ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad[gi] else [])
            return {k: like(p, torch.zeros(lp.shape, dtype=torch.float32)) for k in keys}
        if self.moment_format(gi, i).compressed:   # only the fp32 master is viewable as it is
            only = ("master_param",)
        else:
            only = None
        out = param_views(self.tier, self.layout, gi, i, lp.shape, view, fd, only, copied)
        if self.all_masters and lp.dtype == torch.float32:
            out.pop("master_param", None)   # torch's layout: an fp32 parameter is its own master
        return {k: like(p, v) for k, v in out.items()}

    def torch_state(self, gi: int, i: int) -> dict:
        """``state[p]`` for parameter ``i`` of group ``gi``: step counter and views of the moments."""
        with self.exclusive():
            view, fd = self.tier.mapping()
            st = {"step": self.registry.steps[gi][i]}
            if self.registry.ready[gi][i]:
                views = self.entry_views(gi, i, view, fd)
                st.update(views)
                # what load_state_dict installs in opt.state: a later replacement is detected against it
                self.ptrs[(gi, i)] = {k: local(v).data_ptr() for k, v in views.items()}
                self._forget_state(gi, i)
                if self.moment_format(gi, i).compressed and self.numels[gi][i]:
                    return self.compressed_entry(gi, i, st)
            return st

    def state_tensors(self) -> dict:
        """(gi, i) -> {key: fp32 tensor} for every parameter that has state (views, never copies).
        Every tensor keeps the memory it views alive, also after ``close()``."""
        with self.exclusive():
            return self._state_tensors()

    def _state_tensors(self) -> dict:
        self.handouts.adopt(self.held_current, self.rewrite_held)   # held writes first
        view, fd = self.tier.mapping()
        out = {}
        have = [(gi, i) for gi, params in enumerate(self.groups) for i in range(len(params))
                if self.registry.ready[gi][i] or self.numels[gi][i] == 0]
        packed = {(gi, i) for gi, i in have if self.moment_format(gi, i).compressed}   # numel > 0
        # compressed moments in a disk tier: decoded into file-backed memory, not 8 B/param of RAM
        sink = export.DecodedSink(getattr(self.tier, "directory", None),   # None: the RAM tier
                                  2 * sum(self.numels[gi][i] for gi, i in packed)) if packed else None
        for gi, i in have:
            out[(gi, i)] = self.views_of(gi, i, view, fd)
            if (gi, i) in packed:   # torch's fp32 layout
                out[(gi, i)].update(self.decode_current(gi, i, sink, view))
        return out

    def drop_records(self) -> None:
        """Forget what each opt.state entry was validated as: the next step looks at every entry again."""
        self.recs = []

    def reload_masters(self, which: set, read_master: Callable) -> None:
        """Re-read the fp32 master of the parameters ``which`` ({(gi, i)}) that have state, from the parameters."""
        with self.exclusive():
            loader.reload_masters(self.layout, self.tier, self.registry, which, read_master)

    def load(self, entries: dict, read_master: Callable) -> None:
        """Replace the whole state by ``entries`` ((gi, i) -> state dict), bucket by bucket (engine/load.py).
        After a step failed part-way this is the way back: a load that completes makes the state
        usable again (every parameter's state is either loaded or starts afresh)."""
        with self.exclusive(failed_ok=True):
            self.ptrs = {}      # the views in opt.state are re-made after a load (torch_state)
            self.recs = []
            self.handouts.clear()   # as torch's: tensors read from the old state are not the new state
            loader.load(entries, layout=self.layout, tier=self.tier, registry=self.registry, tracker=self.tracker,
                        numels=self.numels, moment_format=self.moment_format, mode=self.mode, read_master=read_master)
            self.tier.recover()
