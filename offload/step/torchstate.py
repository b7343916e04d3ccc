"""step/torchstate.py: the torch-layout face of the state engine: ``opt.state`` views, ``state_dict``
tensors, ``load_state_dict`` bucket by bucket, and re-reading masters from the parameters.

Mixed into StateEngine (step/engine.py); it uses the engine's layout, tier, registry, side and lock.
Tensors are views of the tier (step/views.py), never copies, and keep their memory alive.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ..native.rows import state_rows
from ..moments import format as mformat
from ..base.dist import like, local
from ..base.dtypes import LOW_PRECISION, STATE_KEYS as _KEYS
from . import compressed, export
from .adopt import copy_in, follow_shapes, missing_entry
from .handouts import HeldMoments
from .views import param_views

__all__ = ["TorchLayout"]

# what the per-step check of opt.state compares (csrc/rows.cpp state_rows): these entries of each
# parameter's state, by identity, and the data pointers of the tensors among them
_SKIP = object()   # an entry the check does not look at
_STATE_FNS = ((getattr(torch._C, "TensorBase", None) or torch._C._TensorBase).__dict__["data_ptr"], _SKIP)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _on_another_device(t, cur) -> bool:
    """``t`` lives on another device than the state view ``cur`` (a seam for the CPU-only tests)."""
    return isinstance(t, torch.Tensor) and local(t).device != local(cur).device


class _StateRecords:
    """Per group: what each parameter's opt.state entry was last validated as (state_rows' input)."""

    def __init__(self, n: int):
        self.objs: list = [None] * n                         # (outer, inner, entry per _KEYS) or None
        self.ptrs = np.full((n, len(_KEYS)), -1, dtype=np.int64)
        self.hashes = np.full(n, -1, dtype=np.int64)         # hash(parameter): looked up without __hash__


class TorchLayout(HeldMoments):
    # ------------------------------------------------------------------ torch-layout views
    def _install(self, fresh: list, state: dict) -> None:
        """Give ``state[p]`` its step counter and moments (views of the tier) when its state was created.
        Runs at the end of every step (both schedules): the decoded moments a caller holds take the
        step's new values here."""
        self._handouts().refresh(self._decode_current)
        if not fresh:
            return
        view, fd = self.tier.mapping()
        ptrs = self.__dict__.setdefault("_view_ptrs", {})
        for gi, i in fresh:
            self._forget_state(gi, int(i))
            p = self.groups[gi][int(i)]
            st = state[p]
            st["step"] = self.registry.steps[gi][int(i)]
            views = self._views(gi, int(i), view, fd)
            for k, v in views.items():
                st[k] = v
            ptrs[(gi, int(i))] = {k: local(v).data_ptr() for k, v in views.items()}
            if self.moment_format(gi, int(i)) != "fp32":   # exp_avg / exp_avg_sq decoded on access
                state[p] = self._compressed_state(gi, int(i), st)

    def _compressed_state(self, gi: int, i: int, base: dict):
        def decode():
            return self._decoded(gi, i)

        def watch(key, t):
            self._handouts().watch(gi, i, key, t)
        return compressed.CompressedState(base, decode, self.moment_format(gi, i), watch)

    def _rewrite_buckets(self, hits: dict, apply) -> None:
        """Read, change (``apply(bucket, pieces, block)``) and write back the buckets ``hits`` ({bucket
        index: [pieces]}), then wait for the writes; a failure fails the tier, as in a step."""
        try:
            for bi, pieces in hits.items():
                b = self.layout.buckets[bi]
                blk = self.tier.acquire(b, True)
                apply(b, pieces, blk)
                self.tier.release(b, blk)
            self.tier.drain()
        except BaseException as e:
            self.tier.fail(e)
            raise

    def _decoded(self, gi: int, i: int, sink=None, view=None) -> dict:
        """fp32 exp_avg / exp_avg_sq (shaped like the parameter) of a compressed-moment parameter,
        fresh tensors, or decoded into ``sink`` (step/export.py) chunk by chunk. ``view``: the tier's
        mapping when the caller (a loop over every parameter, under the lock) already holds one.
        In-place writes into this parameter's held decoded moments are adopted first (as torch's
        state would show them)."""
        with self._using():
            self._handouts().adopt(self._decode_current, self._write_moments, only=(gi, i))
            return self._decode_current(gi, i, sink, view)

    def _decode_current(self, gi: int, i: int, sink=None, view=None) -> dict:
        """_decoded without adopting held writes: the state as its buckets hold it."""
        with self._using():
            if view is None:
                view, _fd = self.tier.mapping()   # NVMe: drains the write-backs and maps the file
            fmt = self.moment_format(gi, i)
            raw = compressed.raw(self.layout, gi, i, fmt, view)
            if sink is None:
                m, v = mformat.decode(raw, fmt)
            else:
                m, v = export.decode_into(raw, fmt, self.numels[gi][i], sink)
        p = self.groups[gi][i]
        shape = local(p).shape
        return {"exp_avg": like(p, m.view(shape)), "exp_avg_sq": like(p, v.view(shape))}

    def raw_state_tensors(self) -> dict:
        """(gi, i) -> {key: tensor} in the stored form: fp32 views (master, fp32 moments) and, for
        compressed moments, copies of the compressed tensors under ``<key>.<format>`` (offload.save)."""
        with self._using():
            self._handouts().adopt(self._decode_current, self._write_moments)   # held writes first
            view, fd = self.tier.mapping()
            out = {}
            for gi, params in enumerate(self.groups):
                for i in range(len(params)):
                    if not (self.registry.ready[gi][i] or self.numels[gi][i] == 0):
                        continue
                    fmt = self.moment_format(gi, i)
                    st = self._views(gi, i, view, fd)
                    if fmt != "fp32" and self.numels[gi][i]:
                        shape = local(params[i]).shape
                        for k, t in compressed.raw(self.layout, gi, i, fmt, view).items():
                            st[mformat.saved_key(k, fmt)] = t.view(shape) if not mformat.per_block(fmt, k) else t
                    out[(gi, i)] = st
            return out

    def _adopt_user_state(self, state: dict) -> None:
        """What a user did to ``opt.state`` since the last step, as torch honours it: a replaced
        ``state[p]['step']`` is adopted; a removed or emptied ``state[p]`` (``opt.state.clear()``,
        ``del opt.state[p]``) starts that parameter afresh at step 0. A replaced moment tensor cannot be
        adopted in place here (the moments live in the state file): it is refused by name instead of
        being silently ignored, unless it holds exactly the state's values (a framework moving every
        state tensor to the model's device): then the view of the state goes back in its place.

        Each parameter's entry is recorded once validated; each step only the entries that are not
        the recorded objects, or whose tensors moved (``.data = ...``), are looked at again
        (``state_rows`` of offload/native/rows.py, natively). The records go with any change the engine makes itself."""
        ptrs = self.__dict__.get("_view_ptrs", {})
        recs = self.__dict__.setdefault("_state_recs", [])
        fast = type(state) is dict or type(state) is defaultdict   # their .get is the C lookup state_rows does
        for gi, ps in enumerate(self.groups):
            ready, steps = self.registry.ready[gi], self.registry.steps[gi]
            while len(recs) <= gi:
                recs.append(_StateRecords(len(self.groups[len(recs)])))
            rec = recs[gi]
            if len(rec.objs) != len(ps):
                rec = recs[gi] = _StateRecords(len(ps))
            if fast:
                rows = state_rows(state, ps, ready, rec.objs, _KEYS, rec.ptrs, _STATE_FNS, rec.hashes).tolist()
            else:
                rows = np.flatnonzero(ready).tolist()
            for i in rows:
                rec.objs[i] = None
                st = state.get(ps[i])
                if not st:
                    ready[i] = False
                    steps[i] = 0.0
                    ptrs.pop((gi, i), None)
                    self._handouts().forget(gi, i)
                    continue
                v = st.get("step")
                if not (isinstance(v, torch.Tensor) and v._base is steps and v.storage_offset() == i
                        and v.data_ptr() == steps.data_ptr() + 4 * i):
                    steps[i] = float(v.item() if isinstance(v, torch.Tensor) else (v or 0.0))
                    st["step"] = steps[i]
                for key, ptr in list(ptrs.get((gi, i), {}).items()):
                    t = st.get(key)
                    if not isinstance(t, torch.Tensor):
                        raise missing_entry(key, f"state of parameter {i} of group {gi}", t)
                    if local(t).data_ptr() != ptr:
                        cur = self._holding(gi, i, key, t)
                        if cur is None and self.tier.adopts and self.moment_format(gi, i) == "fp32":
                            cur = self._view_of(gi, i, key)   # a resident tier takes the values over
                            copy_in(cur, t, key, f"state of parameter {i} of group {gi}", self.local_groups)
                        if cur is not None:   # the same values elsewhere (Lightning's _optimizer_to_device)
                            st[key] = cur
                            ptrs[(gi, i)][key] = local(cur).data_ptr()
                            continue
                        raise ValueError(
                            f"state[{key!r}] of parameter {i} of group {gi} was replaced by another tensor: with "
                            f"storage={self.mode!r} the moments live in the state file, so a new tensor cannot be "
                            "adopted; write into the existing one in place (e.g. opt.state[p]['exp_avg'].zero_()) "
                            "or load a whole state with load_state_dict()")
                self._record_state(rec, i, ps[i], st, ptrs.get((gi, i), {}))
        # decoded compressed moments written in place by a caller who holds them (step/handouts.py)
        self._handouts().adopt(self._decode_current, self._write_moments)

    def _follow_shapes(self, state: dict, rows) -> None:
        """Parameters the side revalidated this step (``rows.revalidated``) that were given another
        shape: their state views follow (step/adopt.py)."""
        for gi, idx in getattr(rows, "revalidated", ()):
            follow_shapes(self.groups[gi], idx, self.registry.ready[gi], state,
                          lambda i, gi=gi: self.__dict__.get("_view_ptrs", {}).get((gi, i), ()),
                          lambda i, gi=gi: self._forget_state(gi, i))

    def _view_of(self, gi: int, i: int, key: str):
        """The view of the state entry ``key`` of parameter (gi, i) (a fresh view object)."""
        view, fd = self.tier.mapping()
        return self._views(gi, i, view, fd)[key]

    def _holding(self, gi: int, i: int, key: str, t):
        """The view of the state entry ``key`` of parameter (gi, i) if ``t``, which replaced it, is a copy
        of it on another device (a framework moving every state tensor to the model's device, e.g.
        Lightning's _optimizer_to_device on a GPU: the state stays in its tier and the view goes back
        in), else None. A replacement on the state's own device is refused as before: the user may go
        on writing into it, and it would not be the state."""
        view, fd = self.tier.mapping()
        cur = self._views(gi, i, view, fd).get(key)
        if cur is None or not _on_another_device(t, cur):
            return None
        return cur if compressed.bitwise_equal(t, cur) else None

    def _record_state(self, rec: "_StateRecords", i: int, p, st, ptrs: dict) -> None:
        """Record state[p] (just validated by _adopt_user_state) for state_rows to compare with."""
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
        recs = self.__dict__.get("_state_recs", [])
        if gi < len(recs) and i < len(recs[gi].objs):
            recs[gi].objs[i] = None

    def _views(self, gi: int, i: int, view, fd) -> dict:
        p = self.groups[gi][i]
        lp = local(p)
        if lp.numel() == 0:
            keys = (["master_param"] if (self.device is not None or lp.dtype in LOW_PRECISION)
                    else []) + ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad[gi] else [])
            return {k: like(p, torch.zeros(lp.shape, dtype=torch.float32)) for k in keys}
        if self.moment_format(gi, i) != "fp32":   # only the fp32 master is viewable as it is
            out = param_views(self.tier, self.layout, gi, i, lp.shape, view, fd, only=("master_param",))
        else:
            out = param_views(self.tier, self.layout, gi, i, lp.shape, view, fd)
        if self.device is not None and lp.dtype == torch.float32:
            out.pop("master_param", None)   # torch's layout: an fp32 parameter is its own master
        return {k: like(p, v) for k, v in out.items()}

    def torch_state(self, gi: int, i: int) -> dict:
        """``state[p]`` for parameter ``i`` of group ``gi``: step counter and views of the moments."""
        with self._using():
            view, fd = self.tier.mapping()
            st = {"step": self.registry.steps[gi][i]}
            if self.registry.ready[gi][i]:
                views = self._views(gi, i, view, fd)
                st.update(views)
                # what load_state_dict installs in opt.state: a later replacement is detected against it
                self.__dict__.setdefault("_view_ptrs", {})[(gi, i)] = {k: local(v).data_ptr() for k, v in views.items()}
                self._forget_state(gi, i)
                if self.moment_format(gi, i) != "fp32" and self.numels[gi][i]:
                    return self._compressed_state(gi, i, st)
            return st

    def state_tensors(self) -> dict:
        """(gi, i) -> {key: fp32 tensor} for every parameter that has state (views, never copies).
        Every tensor keeps the memory it views alive, also after ``close()``."""
        with self._using():
            return self._state_tensors()

    def _state_tensors(self) -> dict:
        self._handouts().adopt(self._decode_current, self._write_moments)   # held writes first
        view, fd = self.tier.mapping()
        out = {}
        have = [(gi, i) for gi, params in enumerate(self.groups) for i in range(len(params))
                if self.registry.ready[gi][i] or self.numels[gi][i] == 0]
        packed = {(gi, i) for gi, i in have if self.moment_format(gi, i) != "fp32" and self.numels[gi][i]}
        # compressed moments in a disk tier: decoded into file-backed memory, not 8 B/param of RAM
        sink = export.DecodedSink(getattr(self.tier, "directory", None),   # None: the RAM tier
                                  2 * sum(self.numels[gi][i] for gi, i in packed)) if packed else None
        for gi, i in have:
            out[(gi, i)] = self._views(gi, i, view, fd)
            if (gi, i) in packed:   # torch's fp32 layout
                out[(gi, i)].update(self._decode_current(gi, i, sink, view))
        return out

    def reload_masters(self, which: set) -> None:
        """Re-read the fp32 master of the parameters ``which`` ({(gi, i)}) that have state, from the parameters."""
        with self._using():
            self._reload_masters(which)

    def _reload_masters(self, which: set) -> None:
        hits = {}
        for b in self.layout.buckets:
            hit = [pc for pc in b.pieces if (b.group, pc.param) in which and self.registry.ready[b.group][pc.param]]
            if hit and b.master:
                hits[b.index] = hit

        def apply(b, pieces, blk):
            f32 = blk.data[:b.nbytes].view(torch.float32)
            for pc in pieces:
                sec = b.section("master_param") // 4 + pc.pos
                self.side.read_master(b.group, pc.param, pc.start, pc.n, f32[sec:sec + pc.n], changed_only=True)
        self._rewrite_buckets(hits, apply)

    @property
    def steps(self) -> list:
        return self.registry.steps

    def load(self, entries: dict) -> None:
        """Replace the whole state by ``entries`` ((gi, i) -> state dict), bucket by bucket.
        Parameters without an entry start afresh at their next step (as with torch's loader).
        A missing 'master_param' is taken from the parameter (a state saved by torch.optim).
        After a step failed part-way this is the way back: a load that completes makes the state
        usable again (every parameter's state is either loaded or starts afresh)."""
        with self._using(failed_ok=True):
            self._load(entries)
            self.tier.recover()

    def _load(self, entries: dict) -> None:
        self.__dict__["_view_ptrs"] = {}   # the views in opt.state are re-made after a load (torch_state)
        self.__dict__["_state_recs"] = []
        self._handouts().clear()           # as torch's: tensors read from the old state are not the new state
        packed = {}   # (gi, i) -> flat compressed tensors of the parameter's format
        for (gi, i), st in list(entries.items()):
            fmt = self.moment_format(gi, i)
            has_packed = any(mformat.parse_saved_key(k) for k in st)
            if fmt == "fp32" and not has_packed:
                continue
            where = f"state of parameter {i} of group {gi}"
            conv = compressed.to_format(st, fmt, self.numels[gi][i], where)
            rest = {k: t for k, t in st.items() if not mformat.parse_saved_key(k) and k not in mformat.MOMENT_KEYS}
            if fmt == "fp32":   # a compressed state loaded into fp32 moments: decoded
                entries[(gi, i)] = dict(rest, **conv)
            else:
                packed[(gi, i)] = conv
                entries[(gi, i)] = dict(rest, exp_avg=None, exp_avg_sq=None)
        for (gi, i), st in entries.items():
            n = self.numels[gi][i]
            has_layout = bool(self.layout.of_param.get((gi, i)))
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in st:
                    raise KeyError(f"state of parameter {i} of group {gi} has no '{key}'")
            for key, t in st.items():
                if key == "step" or not isinstance(t, torch.Tensor):
                    continue
                if local(t).numel() != n:
                    raise ValueError(f"state '{key}' of parameter {i} of group {gi} does not match the "
                                     f"parameter's {n} elements")
            if n and not has_layout:
                raise ValueError(f"state of parameter {i} of group {gi}: the parameter had requires_grad=False when "
                                 f"the optimizer was created with storage={self.mode!r}, so it has no room for state")
        try:
            for b in self.layout.buckets:
                hit = [pc for pc in b.pieces if (b.group, pc.param) in entries]
                if not hit:
                    continue
                data = torch.zeros(b.nbytes, dtype=torch.uint8)
                f32 = data.view(torch.float32)
                for pc in hit:
                    st = entries[(b.group, pc.param)]
                    if b.moments != "fp32":
                        compressed.write_piece(b, pc, data, packed[(b.group, pc.param)])
                    for key, _size in b.keys:
                        if b.moments != "fp32" and key != "master_param":
                            continue
                        sec = b.section(key) // 4 + pc.pos
                        dst = f32[sec:sec + pc.n]
                        src = st.get(key)
                        if src is None and key == "master_param":
                            self.side.read_master(b.group, pc.param, pc.start, pc.n, dst)
                        elif src is not None:
                            dst.copy_(local(src).detach().reshape(-1)[pc.start:pc.start + pc.n])
                self.tier.write(b, data)
            self.registry.reset()
            for (gi, i), st in entries.items():
                v = st.get("step", 0.0)
                self.registry.steps[gi][i] = float(v.item() if isinstance(v, torch.Tensor) else v)
                self.registry.ready[gi][i] = True
                self.tracker.record(gi, [i])   # the loaded master is the truth for the parameter as it is now
        except BaseException as e:
            self.tier.fail(e)
            raise
