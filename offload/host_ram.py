"""host_ram.py: the host-RAM path of offload.Adam/AdamW with fp32 moments (the fast path): per-group
task tables (offload/_plan.py GroupPlan), state arenas, and the per-step check of every parameter and
gradient (native `_C.collect_rows`, csrc/rows.cpp; the Python re-validation of what changed).
A mixin of the optimizer class: it works on the optimizer's own attributes."""
from __future__ import annotations

import weakref

import numpy as np
import torch

from . import _C, _kernels
from ._dist import is_dtensor, like, local
from ._kernels import (COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_V, COL_VMAX, DTYPE_CODES,
                       OUT_USER_PARAM, check_tensor)
from ._plan import (REC_KEYS, GroupPlan, OverlapIndex, ParamState, StateMap, check_storage, fingerprint,
                    no_grad_ref, record_param, sync_master)
from .buffers import round_up
from .checks import _STATE_KEYS, _check_param, _scalar

# what the native fast path (_C.collect_rows, csrc/rows.cpp) reads of each param/grad: the getset
# descriptors and unbound methods of torch's tensor base class (direct C calls, no attribute lookup),
# then the constants it compares with; the order is fixed by csrc/rows.cpp
_TensorBase = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
_TB = _TensorBase.__dict__
_ROW_FNS = (_TB["grad"], _TB["data_ptr"], _TB["dtype"], _TB["stride"], _TB["is_neg"], _TB["is_conj"], _TB["_version"],
            _TB["shape"], _TB["is_cpu"], _TB["layout"], _TB["storage_offset"], _TB["untyped_storage"],
            torch._C.StorageBase.nbytes, torch.Tensor, torch.nn.Parameter, torch.strided,
            torch.float32, torch.bfloat16, torch.float16, _TensorBase)
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_ARENA_STAGGER = 16400  # floats (64 KiB + 64 B) between state streams of one arena: see _init_states


def arena_gap(per_kind: int) -> int:
    """Floats left after each state stream of an arena whose streams hold per_kind floats."""
    return _ARENA_STAGGER if per_kind >= (1 << 18) else 16


class HostRamPath:
    """The host-RAM fp32-moment step path (mixed into offload.optim._AdamBase)."""

    def _plan(self, gi: int, group: dict) -> GroupPlan:
        plan = self._plans.get(gi)
        params = group["params"]
        if plan is not None and plan.matches(params):
            return plan
        plan = GroupPlan(params)
        for i, p in enumerate(params):
            st = self.state.get(p)
            if st:
                self._adopt_state(plan, i, p, st, group)
        self._plans[gi] = plan
        self._plans.pop("overlap", None)
        return plan

    # ------------------------------------------------------------------ state
    def _track_state(self) -> None:
        """Make ``self.state`` a mutation-counting map and re-check every row if anything in it changed.

        ``opt.state = defaultdict(dict)``, ``opt.state.clear()``, ``del opt.state[p]`` and
        ``opt.state[p] = {}`` give fresh state (step 0) as in torch; a replaced state tensor is
        adopted (validated, converted to fp32 if needed) and the kernel writes into it from then on.
        """
        d = self.__dict__
        epoch = d.get("_state_epoch")
        if epoch is None:
            epoch = d["_state_epoch"] = [0]
        state = self.state
        if type(state) is not StateMap or state._epoch is not epoch:
            wrapped = StateMap(epoch=epoch)
            for k, v in state.items():
                wrapped[k] = v
            self.state = state = wrapped
            epoch[0] += 1  # a replaced (even empty) opt.state: every row is re-checked below
        if d.get("_state_seen") == epoch[0]:
            return
        for gi, plan in list(self._plans.items()):
            if not isinstance(gi, int):
                continue
            group = self.param_groups[gi] if gi < len(self.param_groups) else None
            if group is None or not plan.matches(group["params"]):
                continue  # rebuilt (and every state adopted) by _plan
            for i, p in enumerate(plan.params):
                st, rec = state.get(p), plan.rec[i]
                if not st:
                    if rec is not None:  # deleted or emptied: fresh state at step 0 on its next gradient
                        plan.rec[i] = None
                        plan.p_ptr[i] = -1
                        plan.g_ref[i] = no_grad_ref
                elif rec is None or st is not rec[0] or any(st.get(k) is not t for k, t in zip(REC_KEYS, rec[1:])):
                    self._adopt_state(plan, i, p, st, group)
        d["_state_seen"] = epoch[0]

    def _init_states(self, plan: GroupPlan, rows: list, group: dict) -> None:
        """Create the state of several parameters at once, carved out of one zeroed fp32 arena.

        Each state kind is one contiguous stream (all exp_avg, then all exp_avg_sq, ...) with every
        tensor starting on a 64-byte boundary, so many small parameters still stream like one large
        one (no page-sized hops, fewer TLB misses). ``state[p][key]`` are ordinary views of it. The
        arena is numpy-backed: its storage cannot be resized (freed) under the kernel.
        """
        dparams = [plan.params[i] for i in rows]
        for i, p in zip(rows, dparams):
            _check_param(p, f"parameter {i}")
        params = [local(p) for p in dparams]  # DTensor (FSDP2): state of the local shard
        kinds = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        padded = [round_up(p.numel(), 16) for p in params]  # 64-byte aligned fp32
        lowp = [p.dtype in _LOW_PRECISION for p in params]
        per_kind = sum(padded)
        # Each stream starts `gap` floats after the previous one ends: streams exactly per_kind
        # apart are congruent modulo a large power of two whenever the sizes are (128M params:
        # 512 MiB), and then contend for the same cache sets / DRAM banks (measured on an AVX2
        # EPYC: a 128M step 250 ms instead of 134 ms). Small arenas fit the caches:
        # one cache line of gap is enough there.
        gap = arena_gap(per_kind)
        total = (per_kind * len(kinds) + sum(n for n, lp in zip(padded, lowp) if lp)
                 + gap * len(kinds))
        arena = torch.from_numpy(np.zeros(total, dtype=np.float32))  # numpy-owned: cannot be resized under the kernel
        off = 0
        views: list = [ParamState() for _ in params]
        for key in kinds:
            for j, (p, n) in enumerate(zip(params, padded)):
                views[j][key] = arena[off:off + p.numel()].view(p.shape)
                off += n
            off += gap
        for j, (p, n) in enumerate(zip(params, padded)):
            if lowp[j]:
                master = arena[off:off + p.numel()].view(p.shape)
                master.copy_(p.detach())
                views[j]["master_param"] = master
                off += n
        for i, p, lp, st, low in zip(rows, dparams, params, views, lowp):
            if is_dtensor(p):
                st.update({k: like(p, v) for k, v in st.items()})
            st["step"] = torch.tensor(0.0)
            self.state[p] = st
            created = self.__dict__.get("_created")
            if created is not None:  # taken back if the step raises before changing anything (optim.py)
                created.append(p)
            self._adopt_state(plan, i, p, st, group)
            if low:
                plan.p_ver[i] = lp._version  # the master was just read from the parameter

    def _adopt_state(self, plan: GroupPlan, i: int, p: torch.Tensor, st: dict, group: dict) -> None:
        """Make state[p] native-ready (fp32, contiguous, CPU, p's shape) and record its pointers and objects."""
        where = f"state of parameter {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                raise KeyError(f"{where} has no '{key}'")
        lp = local(p)
        if group["amsgrad"] and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = like(p, torch.zeros(lp.shape, dtype=torch.float32))
        if p.dtype in _LOW_PRECISION and "master_param" not in st:
            st["master_param"] = like(p, lp.detach().to(torch.float32, copy=True))
            plan.p_ver[i] = lp._version
        for key in _STATE_KEYS:
            if key in st:
                t = st[key]
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{where}: '{key}' is not a tensor")
                lt = local(t)
                if lt.numel() != lp.numel():
                    raise ValueError(f"{where}: '{key}' has shape {tuple(lt.shape)} but the parameter has "
                                     f"shape {tuple(lp.shape)}")
                if lt.dtype != torch.float32 or lt.device.type != "cpu" or not lt.is_contiguous():
                    lt = lt.detach().to(device="cpu", dtype=torch.float32).contiguous()
                    st[key] = like(p, lt.view(lp.shape))
                elif lt.shape != lp.shape:  # same elements, the parameter was reshaped
                    st[key] = like(p, lt.view(lp.shape))
                elif is_dtensor(p) and not is_dtensor(t):
                    st[key] = like(p, lt)
                check_storage(lt, f"{where}: '{key}'")
        step = st.get("step", 0.0)
        if isinstance(step, torch.Tensor) and step.numel() != 1:
            raise ValueError(f"{where}: 'step' must be a number or a 1-element tensor, got shape {tuple(step.shape)}")
        plan.steps[i] = _scalar(step)
        st["step"] = plan.steps[i]  # 0-dim view: one vectorised add advances every step
        row = plan.table[i]
        row[COL_M] = _kernels._ptr(local(st["exp_avg"]))
        row[COL_V] = _kernels._ptr(local(st["exp_avg_sq"]))
        row[COL_VMAX] = _kernels._ptr(local(st.get("max_exp_avg_sq")))
        row[COL_N] = lp.numel()
        plan.rec[i] = (st,) + tuple(st.get(k) for k in REC_KEYS)  # keeps what the kernel writes alive
        plan.p_ptr[i] = -1  # forces the param columns to be refreshed
        plan.p_meta[i] = None
        plan.g_ref[i] = no_grad_ref
        self._plans.pop("overlap", None)

    def _refresh_param(self, plan: GroupPlan, i: int, p: torch.Tensor, st: dict) -> None:
        """Re-validate parameter i if anything a user can change on it differs from the last step."""
        lp = local(p)
        meta = fingerprint(lp)
        if meta == plan.p_meta[i]:
            if plan.lowp[i] and lp._version != plan.p_ver[i]:
                sync_master(st["master_param"], lp)  # written in place since the last step
                plan.p_ver[i] = lp._version
            if plan.p_ptr[i] == -1:  # record dropped (_track_state), row columns still valid
                record_param(plan, i, lp, DTYPE_CODES[lp.dtype])
            return
        _check_param(p, f"parameter {i}")
        check_storage(lp, f"parameter {i}")
        if lp.numel() != plan.table[i, COL_N]:
            raise RuntimeError(f"parameter {i} changed size ({plan.table[i, COL_N]} -> {lp.numel()} elements) "
                               "since its optimizer state was created")
        if plan.rec[i] is not None and plan.rec[i][1] is not None and local(plan.rec[i][1]).shape != lp.shape:
            for key in _STATE_KEYS:  # reshaped (same elements): the state follows the parameter's shape
                if key in st:
                    st[key] = like(p, local(st[key]).view(lp.shape))
            plan.rec[i] = (st,) + tuple(st.get(k) for k in REC_KEYS)
        row = plan.table[i]
        if lp.dtype in _LOW_PRECISION:
            if "master_param" not in st:
                st["master_param"] = like(p, lp.detach().to(torch.float32, copy=True))
                plan.rec[i] = (st,) + tuple(st.get(k) for k in REC_KEYS)
            else:  # a new tensor (p.data = ...) or a write in place: re-read what differs
                sync_master(st["master_param"], lp)
            plan.p_ver[i] = lp._version
            row[COL_P] = _kernels._ptr(local(st["master_param"]))
            row[COL_OUT] = _kernels._ptr(lp)
            row[COL_OD] = OUT_USER_PARAM[lp.dtype]  # writes through p.data are adopted natively
        else:
            row[COL_P] = _kernels._ptr(lp)
            row[COL_OUT] = 0
            row[COL_OD] = 0
        plan.lowp[i] = lp.dtype in _LOW_PRECISION
        record_param(plan, i, lp, DTYPE_CODES[lp.dtype])  # what collect_rows compares from now on
        plan.p_meta[i] = meta
        self._plans.pop("overlap", None)

    # ------------------------------------------------------------------ step
    def _collect(self, plan: GroupPlan, group: dict) -> tuple:
        """Rows of parameters with a gradient, in order, and the rows whose gradient is new (to be
        checked against the buffers the kernel writes); validates whatever changed since the last step.

        The native gather (``_C.collect_rows``, csrc/rows.cpp) compares each row with its record
        (param pointer, dtype, exact shape, contiguity, neg bit, bf16/fp16 version; the grad object,
        and the same of the grad) and validates a new plain CPU gradient of an unchanged param
        itself; every other row with a gradient is (re)validated here.
        """
        ready, newgrad, changed, other = _C.collect_rows(plan.params, plan.g_ref, plan.meta, plan.layouts,
                                                         plan.table, _ROW_FNS)
        n = len(plan.params)
        if len(ready) + len(newgrad) + len(changed) + len(other) < n:
            # rows without a gradient: forget the one they had, so that the same tensor given back later is
            # checked again ("newgrad"), against memory that may have moved meanwhile (overlap index)
            seen = np.zeros(n, dtype=bool)
            for rows in (ready, newgrad, changed, other):
                seen[rows] = True
            for i in np.flatnonzero(~seen).tolist():
                plan.g_ref[i] = no_grad_ref
        if len(other):  # DTensor (FSDP2) and other subclasses: their grad as they report it
            changed = np.union1d(changed, np.array([i for i in other.tolist() if plan.params[i].grad is not None],
                                                   dtype=np.int64))
        if not len(changed):
            if not len(newgrad):
                return ready, newgrad
            return np.union1d(ready, newgrad), newgrad
        changed = changed.tolist()
        table, state = plan.table, self.state
        fresh = [i for i in changed if not state.get(plan.params[i])]
        if fresh:
            self._init_states(plan, fresh, group)
        for i in changed:
            p = plan.params[i]
            st = state[p]
            lp, g = local(p), local(p.grad)
            self._refresh_param(plan, i, p, st)
            check_tensor(g, f"gradient of parameter {i}", dtypes=(p.dtype,), shape=lp.shape)
            check_storage(g, f"gradient of parameter {i}")
            plan.g_ref[i] = weakref.ref(g)
            plan.g_ptr[i] = g.data_ptr()
            table[i, COL_G] = _kernels._ptr(g)
            table[i, COL_GD] = DTYPE_CODES[g.dtype]
        checked = np.union1d(newgrad, changed)
        return np.union1d(ready, checked), checked

    def _check_amsgrad(self, gi: int, plan, rows) -> None:
        """amsgrad switched on after a parameter's first step: its state has no max_exp_avg_sq."""
        miss = rows[(plan.table[rows, COL_VMAX] == 0) & (plan.table[rows, COL_N] > 0)]
        if len(miss):
            raise ValueError(f"param group {gi} has amsgrad=True, but {self._name(gi, int(miss[0]))} has no "
                             "'max_exp_avg_sq' in its state (amsgrad was switched on after its first step; "
                             "torch.optim.AdamW raises KeyError here): set amsgrad=False again, or give each such "
                             "parameter one: opt.state[p]['max_exp_avg_sq'] = torch.zeros_like(p, dtype=torch.float32)")

    def _name(self, gi: int, i: int) -> str:
        names = self.param_groups[gi].get("param_names") if gi < len(self.param_groups) else None
        name = f" ({names[i]!r})" if names and i < len(names) else ""
        return f"parameter {i}{name} of group {gi}"

    def _check_overlap(self, work: list, changed: dict) -> None:
        """Refuse rows about to be stepped that share memory, across all groups: what the kernel writes
        must be disjoint, and no gradient may overlap a write. The write index is rebuilt only when a
        row's parameter or state, or the set of stepped rows, changed; new gradients are checked
        against it (binary search)."""
        index = self._plans.get("overlap")
        key = [(gi, rows) for gi, _, rows, _ in work]
        if index is None or len(index.key) != len(key) or any(
                a[0] != b[0] or not np.array_equal(a[1], b[1]) for a, b in zip(index.key, key)):
            gis = [gi for gi, _, _, _ in work]
            index = OverlapIndex([plan for _, plan, _, _ in work], [rows for _, _, rows, _ in work],
                                 lambda pi, r: self._name(gis[pi], r))
            index.key = key
            self._plans["overlap"] = index
            reads = {pi: rows for pi, (_, _, rows, _) in enumerate(work)}
        else:
            reads = {pi: changed[gi] for pi, (gi, _, _, _) in enumerate(work) if gi in changed}
        if reads:
            index.check_reads([plan for _, plan, _, _ in work], reads)
