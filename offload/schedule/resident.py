"""schedule/resident.py: parameters whose Adam state stays on the GPU, stepped there exactly.

With device parameters the CPU steps each bucket as backward delivers its gradients; the buckets
backward reaches last (the model's first layers) have nothing left to hide behind, and their new
weights are the first the next forward needs. When the GPU has memory to spare, those parameters
keep an fp32 master and fp32 moments on the GPU and ``ResidentAdam`` steps them there with torch's
fused AdamW (Adam), in the same ``step()`` and with the same hyperparameters, gradient multiplier
(1/loss scale x clipping coefficient) and skip decision as the buckets the CPU steps. Which
parameters stay is decided from what the first steps measured (schedule/split.py).

The state is torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, and
``master_param`` for bf16/fp16 parameters, as offload keeps it) in the outer optimizer's ``state``
under the same parameters, so ``state_dict()``, ``load_state_dict`` and checkpoints see one layout
whichever side steps a parameter. A bf16/fp16 parameter written by the user since the last step (a
``model.load_state_dict``, a write through ``p.data``) is adopted element by element into its
master before the step, as the CPU kernel does: where the parameter differs from round(master).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..base.dist import local
from ..base.dtypes import LOW_PRECISION
from ..base.torchadam import HYPER_KEYS, check_state, follow_groups

__all__ = ["OnDevice", "ResidentAdam", "on_device", "resident_bytes", "resident_for"]



def resident_bytes(p) -> int:
    """GPU bytes the state of parameter ``p`` takes when it stays there: fp32 moments, an fp32
    master for bf16/fp16, and the fp32 gradient of the step (made from the parameter's gradient at
    step())."""
    lp = local(p)
    return lp.numel() * (8 + 4 + (4 if lp.dtype in LOW_PRECISION else 0))


class ResidentAdam:
    """torch's fused (CUDA; foreach elsewhere) Adam/AdamW over fp32 masters of the parameters that
    stay.

    Each parameter's entry in the outer ``state`` is the dict torch's optimizer steps (with
    ``master_param`` for bf16/fp16 parameters): what the user edits in place is what the next step
    reads, as with torch's; an entry replaced or deleted is taken over (deleted: the parameter
    starts afresh, its master from its weights) before the next step."""

    def __init__(self, port, resident: Dict[int, List[torch.Tensor]], decoupled: bool):
        """``port``: the outer optimizer's StepPort (engine/port.py); ``resident``: outer group
        index -> its parameters whose state stays on the GPU."""
        self.port = port
        # (outer group, id of the parameter): on_device makes a new one when these change
        self.members = [(gi, id(p)) for gi, params in resident.items() for p in params]
        self.group_of: List[int] = []
        self.params: List[torch.Tensor] = []
        # the parameter's own storage when fp32 (stepped in place)
        self.masters: List[torch.Tensor] = []
        self.own: List[bool] = []               # a master of its own (bf16/fp16 parameters)
        groups = []
        for gi, params in resident.items():
            if not params:
                continue
            ms = [self._master(p) for p in params]
            groups.append({"params": ms, **{k: port.groups()[gi][k] for k in HYPER_KEYS}})
            self.group_of.append(gi)
            self.params += params
            self.masters += ms
            self.own += [local(p).dtype in LOW_PRECISION for p in params]
        self.inner = None
        if groups:
            fused = all(local(p).device.type == "cuda" for p in self.params)
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            self.inner = cls(groups, **({"fused": True} if fused else {"foreach": True}))

    @staticmethod
    def _master(p) -> torch.Tensor:
        """An fp32 master of a bf16/fp16 parameter; an fp32 parameter is its own (stepped in
        place)."""
        lp = local(p)
        return lp.detach().float().clone() if lp.dtype in LOW_PRECISION else lp.detach()

    def __bool__(self) -> bool:
        return self.inner is not None

    def gpu_bytes(self) -> int:
        return sum(resident_bytes(p) for p in self.params)

    def grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _where(self, k: int) -> str:
        gi = self.group_of[next(j for j, n in enumerate(self._counts()) if k < n)]
        i = next(j for j, q in enumerate(self.port.groups()[gi]["params"]) if q is self.params[k])
        return f"parameter {i} of group {gi}"

    def _counts(self) -> List[int]:
        ends, n = [], 0
        for g in self.inner.param_groups:
            n += len(g["params"])
            ends.append(n)
        return ends

    def _changed(self, p, m, own: bool) -> bool:
        """The entry of ``p`` in ``state`` is not the one this optimizer steps (replaced, deleted,
        or its master_param replaced)."""
        st, entry = self.inner.state.get(m), self.port.state().get(p)
        if entry is not st:
            return bool(entry) or st is not None
        master = st.get("master_param") if own and st else None
        return master is not None and master.data_ptr() != m.data_ptr()

    def _follow_data(self) -> None:
        """An fp32 parameter is stepped in its own storage: one whose ``.data`` was replaced
        since (``p.data = ...``, of the same shape: the schedule refuses another) is stepped in
        the new one from now on, with its state, as torch's optimizer steps what ``p`` holds."""
        for k, (p, m, own) in enumerate(zip(self.params, self.masters, self.own)):
            lp = local(p).detach()
            if own or lp.shape != m.shape or (lp.data_ptr() == m.data_ptr()
                                              and lp.stride() == m.stride()):
                continue   # (another shape: refused by the schedule's size check)
            st = self.inner.state.pop(m, None)
            for g in self.inner.param_groups:
                g["params"] = [lp if q is m else q for q in g["params"]]
            self.masters[k] = lp
            if st is not None:
                self.inner.state[lp] = st

    @torch.no_grad()
    def check(self) -> None:
        """Before anything is stepped: entries of ``state`` replaced or deleted since the last step
        are taken over, and what torch's Adam code would raise on part-way is refused by name."""
        if self.inner is None:
            return
        self._follow_data()
        self.load()
        for k, m in enumerate(self.masters):
            st = self.inner.state.get(m)
            if st:
                g = self.inner.param_groups[next(j for j, n in enumerate(self._counts()) if k < n)]
                check_state(m, {key: v for key, v in st.items() if key != "master_param"}, g,
                            self._where(k))

    @torch.no_grad()
    def load(self) -> None:
        """Each resident parameter's entry in ``state`` that is not the one this optimizer steps (a
        load_state_dict, an entry replaced or deleted, the state of a parameter that moves here)
        goes to the device. Everything is copied before anything changes: an allocation that fails
        (device memory) leaves every entry as it was."""
        if self.inner is None:
            return
        state, new = self.port.state(), []
        for p, m, own in zip(self.params, self.masters, self.own):
            if not self._changed(p, m, own):
                continue
            entry = state.get(p)
            master = None
            if own:
                src = entry.get("master_param") if entry else None
                src = local(src) if src is not None else local(p).float()
                master = src.reshape(m.shape).to(device=m.device, dtype=torch.float32, copy=True)
            st = None
            if entry:
                st = {k: local(v).detach().to(m.device).clone() if isinstance(v, torch.Tensor)
                      else v
                      for k, v in entry.items() if k != "master_param"}
                if "step" in st and not isinstance(st["step"], torch.Tensor):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
            new.append((p, m, own, master, st))
        for p, m, own, master, st in new:   # (nothing is allocated from here on)
            self.inner.state.pop(m, None)
            if master is not None:
                m.copy_(master)
            if st is None:
                state.pop(p, None)
            else:
                self.inner.state[m] = st
                self._publish(p, m, own)

    def _publish(self, p, m, own: bool) -> None:
        st = self.inner.state.get(m)
        if st:
            if own:
                st["master_param"] = m.view(local(p).shape)
            self.port.state()[p] = st

    @torch.no_grad()
    def adopt_writes(self) -> None:
        """Masters take the elements of bf16/fp16 parameters that differ from round(master)."""
        for p, m, own in zip(self.params, self.masters, self.own):
            if not own:
                continue
            lp = local(p).reshape(m.shape)
            differs = lp.ne(m.to(lp.dtype))
            if bool(differs.any()):
                m[differs] = lp[differs].float()

    @torch.no_grad()
    def step(self, mult: float) -> None:
        """One step of every resident parameter that has a gradient, its gradient times ``mult``
        (the parameters' own ``grad`` stay as backward left them)."""
        if self.inner is None:
            return
        self.check()
        follow_groups(self.inner, self.port.groups(), self.group_of)
        self.adopt_writes()
        stepped = []
        for p, m, own in zip(self.params, self.masters, self.own):
            if p.grad is None:
                m.grad = None
                continue
            g = local(p.grad).reshape(m.shape)
            if own:
                m.grad = g.float().mul_(mult) if mult != 1.0 else g.float()
            else:
                # fp32: the parameter's storage is stepped in place, with a scaled copy of its grad
                m.grad = g if mult == 1.0 else g * mult
            stepped.append((p, m, own))
        if not stepped:
            return
        self.inner.step()
        low = [(local(p).detach(), m) for p, m, own in stepped if own]
        if low:
            torch._foreach_copy_([lp.view(m.shape) for lp, m in low], [m for _, m in low])
        for p, m, own in stepped:
            m.grad = None
            self._publish(p, m, own)


class OnDevice:
    """The parameters torch's code steps where they are, in the device schedule's step(): the small
    ones (schedule/smallparams.py DeviceSideAdam) and those whose state stays on the device
    (ResidentAdam); each part checks, steps and loads its own."""

    def __init__(self, *parts):
        self.parts = [p for p in parts if p]

    def __bool__(self) -> bool:
        return bool(self.parts)

    def check(self) -> None:
        for part in self.parts:
            part.check()

    def step(self, mult: float) -> None:
        for part in self.parts:
            part.check()   # (every part's entries before any part steps)
        for part in self.parts:
            part.step(mult)

    def load(self) -> None:
        for part in self.parts:
            part.load()


def _by_group(groups: list, keys) -> dict:
    return {gi: [groups[gi]["params"][i] for g2, i in sorted(keys) if g2 == gi]
            for gi in range(len(groups))}


def on_device(port, excluded: set, small_param_numel: int,
              resident: Optional[ResidentAdam] = None) -> tuple:
    """(ResidentAdam, OnDevice) of a device schedule whose engine leaves ``excluded`` ({(gi, i)})
    out: those of at most ``small_param_numel`` elements are the small ones, the others stay on the
    device (``resident`` is kept where it steps exactly those: the state it holds goes on)."""
    from .smallparams import DeviceSideAdam, small_params
    groups = port.groups()
    small = small_params(groups, small_param_numel)
    decoupled = port.hyper(0)["decoupled"]
    stay = sorted(excluded - small)
    # (the same parameters in the same groups: a parameter moved to another group is stepped
    # with that group's hyperparameters by a new one, which takes its state from opt.state)
    if resident is None or resident.members != [(gi, id(groups[gi]["params"][i]))
                                                for gi, i in stay]:
        resident = ResidentAdam(port, _by_group(groups, stay), decoupled)
    return resident, OnDevice(DeviceSideAdam(port, _by_group(groups, small), decoupled), resident)


def resident_for(port, params: list) -> ResidentAdam:
    """A ResidentAdam over ``params`` holding their state from ``state`` on the device already (it
    raises, with nothing changed, where the device cannot hold it)."""
    groups = port.groups()
    keys = [(gi, i) for gi, g in enumerate(groups) for i, p in enumerate(g["params"])
            if any(p is q for q in params)]
    res = ResidentAdam(port, _by_group(groups, keys), port.hyper(0)["decoupled"])
    res.load()
    return res
